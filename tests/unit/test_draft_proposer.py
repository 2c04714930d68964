"""The model-based draft proposer: exact greedy continuation, cache sync, rollback, release."""

from __future__ import annotations

import pytest
import torch

from engine.model.tiny import TINY_CONFIG, tiny_checkpoint
from engine.speculative.draft_model import BatchKV, model_from_checkpoint
from engine.speculative.draft_proposer import ModelDraftProposer
from engine.speculative.proposer import DraftRequest

V = TINY_CONFIG.vocab_size
PROMPTS = [[5, 17, 300, 42, 8, 99, 123], [7, 8, 9], [400, 1, 2, 3, 4, 250, 6, 7, 8, 9, 10]]


@pytest.fixture(scope="module")
def checkpoint():
    return tiny_checkpoint(0)


def full_proposer(checkpoint) -> ModelDraftProposer:
    """A 'draft' that is the whole tiny target over its whole vocabulary: its greedy proposals
    must be exactly the target's greedy continuation, which pins down the cache bookkeeping."""
    layers = tuple(range(TINY_CONFIG.num_layers))
    model = model_from_checkpoint(checkpoint, layers, torch.arange(V)).eval()
    return ModelDraftProposer(model, torch.arange(V), V)


@torch.inference_mode()
def greedy_reference(checkpoint, prompt: list[int], n: int) -> list[int]:
    teacher = model_from_checkpoint(checkpoint, tuple(range(TINY_CONFIG.num_layers)), None)
    ids = list(prompt)
    for _ in range(n):
        hidden = teacher(torch.tensor([ids]))
        ids.append(int(teacher.logits(hidden[0, -1]).argmax()))
    return ids[len(prompt) :]


def test_greedy_proposals_are_the_targets_continuation_for_a_mixed_batch(checkpoint):
    proposer = full_proposer(checkpoint)
    reqs = [
        DraftRequest(f"r{i}", p, k) for i, (p, k) in enumerate(zip(PROMPTS, (4, 6, 1), strict=True))
    ]
    drafts = proposer.propose(reqs, [False] * 3)
    for req, draft in zip(reqs, drafts, strict=True):
        assert draft.token_ids == greedy_reference(checkpoint, req.token_ids, req.max_tokens)
        assert draft.probs is None


def test_rollback_then_continue_matches_a_fresh_proposer(checkpoint):
    proposer = full_proposer(checkpoint)
    prompt = PROMPTS[0]
    first = proposer.propose([DraftRequest("a", prompt, 5)], [False])[0].token_ids
    # The target accepted 2 guesses and then chose a token of its own.
    bonus = (first[2] + 1) % V
    proposer.rollback("a", len(prompt) + 2)
    assert proposer.cached_tokens("a") == prompt + first[:2]
    seq = prompt + first[:2] + [bonus]
    again = proposer.propose([DraftRequest("a", seq, 4)], [False])[0].token_ids
    assert again == greedy_reference(checkpoint, seq, 4)


def test_missed_rollback_is_still_correct_and_batches_of_several_resync(checkpoint):
    proposer = full_proposer(checkpoint)
    reqs = [DraftRequest("a", PROMPTS[0], 3), DraftRequest("b", PROMPTS[1], 3)]
    first = proposer.propose(reqs, [False, False])
    # No rollback calls: the next call must notice the rejected tail by itself.
    seqs = [PROMPTS[0] + [(first[0].token_ids[0] + 7) % V], PROMPTS[1] + first[1].token_ids]
    second = proposer.propose(
        [DraftRequest("a", seqs[0], 4), DraftRequest("b", seqs[1], 2)], [False, False]
    )
    assert second[0].token_ids == greedy_reference(checkpoint, seqs[0], 4)
    assert second[1].token_ids == greedy_reference(checkpoint, seqs[1], 2)


def test_release_frees_state_and_zero_tokens_proposes_nothing(checkpoint):
    proposer = full_proposer(checkpoint)
    drafts = proposer.propose(
        [DraftRequest("a", PROMPTS[0], 2), DraftRequest("b", PROMPTS[1], 0)], [False, False]
    )
    assert drafts[1].token_ids == [] and len(drafts[0]) == 2
    assert proposer.num_cached_requests == 1
    proposer.release("a")
    proposer.release("never-seen")  # releasing an unknown request is harmless
    assert proposer.num_cached_requests == 0
    assert proposer.cached_tokens("a") == []


def test_greedy_is_deterministic_and_sampling_returns_q_over_the_draft_vocab(checkpoint):
    vocab = torch.arange(0, V, 2)  # a reduced vocabulary: even ids only
    model = model_from_checkpoint(checkpoint, (0,), vocab).eval()
    reqs = [DraftRequest("a", PROMPTS[2], 5)]
    one = ModelDraftProposer(model, vocab, V).propose(reqs, [False])[0]
    two = ModelDraftProposer(model, vocab, V).propose(reqs, [False])[0]
    assert one.token_ids == two.token_ids
    sampled = ModelDraftProposer(model, vocab, V, seed=3).propose(reqs, [True])[0]
    q = sampled.probs
    assert q is not None and q.shape == (5, V)
    torch.testing.assert_close(q.sum(-1), torch.ones(5))
    assert float(q[:, 1::2].abs().sum()) == 0.0  # odd ids are outside the draft vocabulary
    assert all(t % 2 == 0 and q[i, t] > 0 for i, t in enumerate(sampled.token_ids))


def test_cached_batch_step_equals_uncached_forward(checkpoint):
    model = model_from_checkpoint(checkpoint, (0, 1), None).eval()
    with torch.inference_mode():
        full = model(torch.tensor([PROMPTS[2]]))[0]
        kv = BatchKV.empty(model.config, 2, 32)
        # Row 1 is a different, shorter sequence: rows of a batch must not see each other.
        ids = torch.zeros(2, 6, dtype=torch.long)
        ids[0] = torch.tensor(PROMPTS[2][:6])
        ids[1, :3] = torch.tensor(PROMPTS[1])
        head = model(ids, torch.tensor([0, 0]), kv)
        tail = model(torch.tensor([PROMPTS[2][6:], [1] * 5]), torch.tensor([6, 3]), kv)
    torch.testing.assert_close(torch.cat([head[0], tail[0]]), full, atol=1e-4, rtol=1e-4)


def test_proposals_stop_at_the_context_limit_while_the_batch_goes_on(checkpoint):
    proposer = full_proposer(checkpoint)
    limit = TINY_CONFIG.max_position
    long = [(7 * i) % V for i in range(limit - 2)]
    drafts = proposer.propose(
        [DraftRequest("long", long, 5), DraftRequest("short", PROMPTS[1], 5)], [False, False]
    )
    assert drafts[0].token_ids == greedy_reference(checkpoint, long, 2)
    assert drafts[1].token_ids == greedy_reference(checkpoint, PROMPTS[1], 5)
    full = proposer.propose([DraftRequest("full", long + [1, 2], 3)], [False])[0]
    assert full.token_ids == []
