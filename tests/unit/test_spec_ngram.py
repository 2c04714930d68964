"""Prompt-lookup proposals: the latest earlier occurrence of the longest matching suffix."""

from __future__ import annotations

import random

import pytest

from engine.speculative.ngram import NgramProposer
from engine.speculative.proposer import DraftRequest


def _propose(proposer: NgramProposer, tokens: list[int], k: int, rid: str = "r") -> list[int]:
    (draft,) = proposer.propose([DraftRequest(rid, tokens, k)], [False])
    assert draft.probs is None  # model-free drafts are one-hot
    return draft.token_ids


def _brute_force(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    end = len(tokens) - 1
    for n in range(min(max_n, end), min_n - 1, -1):
        suffix = tokens[end - n + 1 :]
        for start in range(end - n, -1, -1):  # latest earlier occurrence first
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_continues_after_the_latest_match():
    proposer = NgramProposer(max_n=3)
    assert _propose(proposer, [1, 2, 3, 4, 5, 9, 1, 2, 3], 3) == [4, 5, 9]
    # Grown incrementally: [1, 2] last occurred right before the current position.
    assert _propose(proposer, [1, 2, 3, 4, 5, 9, 1, 2, 3, 4, 7, 1, 2], 5) == [3, 4, 7, 1, 2]


def test_longer_suffix_wins_over_more_recent_short_one():
    proposer = NgramProposer(max_n=3)
    tokens = [5, 6, 7, 8, 0, 7, 9, 5, 6, 7]  # [5, 6, 7] -> 8 beats the later 7 -> 9
    assert _propose(proposer, tokens, 2) == [8, 0]


def test_no_match_and_limits():
    proposer = NgramProposer(max_n=2, min_n=2)
    assert _propose(proposer, [1, 2, 3, 4], 4) == []
    assert _propose(proposer, [1, 2, 1, 2], 0, rid="zero") == []
    assert _propose(proposer, [1], 3, rid="short") == []


@pytest.mark.parametrize("seed", range(5))
def test_incremental_index_equals_brute_force(seed):
    rng = random.Random(seed)
    proposer = NgramProposer(max_n=4, min_n=1)
    tokens = [rng.randrange(6) for _ in range(5)]
    for _ in range(60):
        k = rng.randrange(1, 6)
        assert _propose(proposer, tokens, k) == _brute_force(tokens, k, 4, 1)
        tokens = tokens + [rng.randrange(6) for _ in range(rng.randrange(1, 4))]


def test_rollback_and_release_reset_state():
    proposer = NgramProposer()
    tokens = [1, 2, 3, 1, 2]
    assert _propose(proposer, tokens, 2) == [3, 1]
    proposer.rollback("r", 3)  # the sequence shrank: the index must not remember [1, 2]
    assert _propose(proposer, [1, 2, 3], 2) == []
    proposer.release("r")
    assert "r" not in proposer._indexes


def test_bad_sizes_refused():
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(max_n=2, min_n=3)
