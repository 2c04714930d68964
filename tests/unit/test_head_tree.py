"""Which nodes a draft head's tree proposes (HeadDraftProposer._tree, EAGLE-2's dynamic tree),
on a head whose next-token probabilities are a fixed table: the tree keeps the likeliest paths
of any depth, so a path the head is sure of is not cut short by the first depths' siblings."""

from __future__ import annotations

import pytest
import torch

from engine.model.tiny import TINY_CONFIG
from engine.speculative.head_model import DraftHead, head_config
from engine.speculative.head_proposer import HeadDraftProposer
from engine.speculative.proposer import DraftRequest
from engine.speculative.tree import accept_greedy

VOCAB = 512
ROOT = 0  # the token the target emitted last: the head's state after it predicts what follows
# The head's probability of each next token after a token (every other token shares what is
# left). After the root the head hesitates between 1 and 2; after 1 it is sure for four tokens.
TABLE = {
    ROOT: {1: 0.5, 2: 0.4},
    1: {3: 0.99},
    3: {4: 0.99},
    4: {5: 0.99},
    5: {6: 0.99},
    2: {7: 0.5, 8: 0.45},
}


def _logits_after(token: int) -> torch.Tensor:
    probs = torch.full((VOCAB,), 1e-9)
    for nxt, p in TABLE.get(token, {}).items():
        probs[nxt] = p
    return probs.log()


def _state_of(token: int) -> torch.Tensor:
    state = torch.zeros(TINY_CONFIG.hidden_size)
    state[token] = 1.0
    return state


class _TableHead(DraftHead):
    """A real head's shapes and cache, with the table's predictions: a state is the one-hot
    of the token it follows, so `logits` reads the table row of that token."""

    def serve(self, native_weights="q8_0") -> None:  # type: ignore[override]
        """Nothing to place: the table stands in for the layer and the output rows."""

    def forward(self, features, next_ids, start=None, kv=None):  # type: ignore[override]
        return torch.stack([_state_of(ROOT)] * features.shape[1])[None].expand(
            features.shape[0], -1, -1
        )

    def forward_nodes(
        self, features, next_ids, positions, slots, known, ancestry, kv, batch_rows=None
    ):  # type: ignore[override]
        return torch.stack([_state_of(int(t)) for t in next_ids])

    def logits(self, states: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return torch.stack(
            [_logits_after(int(s.argmax())) for s in states.reshape(-1, states.shape[-1])]
        )


def _tree(width: int, budget: int, min_confidence: float = 0.0):
    head = _TableHead(head_config(TINY_CONFIG, VOCAB))
    proposer = HeadDraftProposer(
        head, torch.arange(VOCAB), TINY_CONFIG.vocab_size, tree_width=width,
        tree_min_confidence=min_confidence,
    )  # fmt: skip
    proposer.observe_hidden("r", 0, torch.zeros(3, TINY_CONFIG.hidden_size))
    [draft] = proposer.propose([DraftRequest("r", [9, 9, 9, ROOT], budget)], [False], [True])
    return draft


def _path_probability(draft, node: int) -> float:
    p, token = 1.0, ROOT
    for n in _path(draft, node):
        p *= TABLE.get(token, {}).get(draft.token_ids[n], 0.0)
        token = draft.token_ids[n]
    return p


def _path(draft, node: int) -> list[int]:
    # A tree that is one chain comes back as a chain (no parents).
    parents = draft.parents or tuple(range(-1, len(draft) - 1))
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


def test_the_sure_path_goes_deep_and_the_doubted_sibling_stays():
    draft = _tree(width=2, budget=6)
    # Likeliest six: 1 (0.5), 1-3 (0.495), 1-3-4 (0.49), 1-3-4-5 (0.485), 1-3-4-5-6 (0.48),
    # 2 (0.4). Chosen depth by depth instead, depth 2's candidates (3, 2's children 7 and 8
    # at 0.2 and 0.18, and 1's second guess) took the budget: no path went past depth 2.
    assert draft.token_ids == [1, 2, 3, 4, 5, 6]
    assert draft.parents == (-1, -1, 0, 2, 3, 4)
    # If the target goes 1 3 4 5 42, one verify step keeps four guesses and adds 42 (the
    # target's token after each query row: the root, then nodes 1 2 3 4 5 6).
    accepted, bonus = accept_greedy(draft, [1, 3, 7, 4, 5, 42, 9])
    assert [draft.token_ids[n] for n in accepted] == [1, 3, 4, 5] and bonus == 42


def _table_paths() -> dict[tuple[int, ...], float]:
    """Every path the table gives a real probability, with that probability."""
    out: dict[tuple[int, ...], float] = {}
    frontier = [((), 1.0)]
    while frontier:
        path, p = frontier.pop()
        for nxt, q in TABLE.get(path[-1] if path else ROOT, {}).items():
            out[(*path, nxt)] = p * q
            frontier.append(((*path, nxt), p * q))
    return out


@pytest.mark.parametrize("budget", [1, 3, 6, 8])
@pytest.mark.parametrize("width", [2, 3])
def test_the_tree_is_the_likeliest_paths_parents_first(width, budget):
    draft = _tree(width=width, budget=budget)
    assert all(parent < node for node, parent in enumerate(draft.parents or ()))
    proposed = {tuple(draft.token_ids[n] for n in _path(draft, node)) for node in range(len(draft))}
    paths = _table_paths()
    likeliest = sorted(paths, key=lambda path: -paths[path])[:budget]
    assert proposed == set(likeliest)


def test_a_cutoff_keeps_only_paths_the_head_believes():
    draft = _tree(width=2, budget=8, min_confidence=0.45)
    # 1 (0.5), 1-3 (0.495), 1-3-4 (0.49), 1-3-4-5 (0.485), then 0.480 and 0.475 down the
    # same path; 2 (0.4) is under the cutoff.
    assert 2 not in draft.token_ids
    assert all(_path_probability(draft, n) >= 0.45 for n in range(len(draft)))
