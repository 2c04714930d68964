"""The draft head's step in the native library (head_native.py) against its torch path, on
the tiny model: with fp32 weights, true pairs fed in a batch (padded through torch, ragged
through the library), chained guesses and tree nodes give the same states and write the same
K/V to float rounding, and a proposer drafts the same chains and trees through either path;
with Q8_0 weights (the served default) the states stay within the blocks' rounding and the
drafts mostly agree."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from engine.model.tiny import TINY_CONFIG, tiny_checkpoint
from engine.speculative.draft_model import BatchKV, gather_kv
from engine.speculative.head_model import DraftHead, head_config, init_head_from_checkpoint
from engine.speculative.head_native import NativeHeadError, WeightFormat, quantize_q8_0
from engine.speculative.head_proposer import HeadDraftProposer
from engine.speculative.proposer import DraftRequest

TOL = dict(atol=2e-4, rtol=2e-4)


def _heads(weights: WeightFormat = "fp32") -> tuple[DraftHead, DraftHead]:
    """The same served head twice: through the library, and through torch."""
    checkpoint = tiny_checkpoint(seed=0)
    head = DraftHead(head_config(TINY_CONFIG, 512))
    init_head_from_checkpoint(head, checkpoint.tensors)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():  # off the identity start, so fc mixes both inputs
        head.fc.weight.add_(0.05 * torch.randn(head.fc.weight.shape, generator=gen))
    head.attach_target(checkpoint.tensors["embed_tokens"], checkpoint.tensors["embed_tokens"])
    torch_head = copy.deepcopy(head)
    for h in (head, torch_head):
        h.eval().requires_grad_(False)
        h.serve(weights)
    assert head.native is not None and head.native.weights == weights, head.native_reason
    torch_head.native = None
    return head, torch_head


@pytest.fixture(scope="module")
def heads():
    return _heads()


def _inputs(batch: int, t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(batch, t, TINY_CONFIG.hidden_size, generator=gen)
    return features, torch.randint(0, 512, (batch, t), generator=gen)


@torch.inference_mode()
def test_true_pairs_and_chains_match_torch_in_a_padded_batch(heads):
    native, plain = heads
    c = native.config
    # Three requests with their own caches at different lengths, gathered into one batch
    # whose chunks are padded to the longest (as the proposer feeds them).
    lengths = [5, 9, 2]
    caches = []
    for row, n in enumerate(lengths):
        features, ids = _inputs(1, n, seed=row)
        kv = BatchKV.empty(c, 1, 32)
        plain(features, ids, torch.tensor([0]), kv)
        caches.append(kv)
    starts = [3, 6, 1]
    results = []
    for head in (native, plain):
        kv = gather_kv(c, caches, starts, 48)
        features, ids = _inputs(3, 4, seed=9)
        f = head(features, ids, torch.tensor(starts), kv)
        chained = [f]
        pos = torch.tensor(starts) + 4
        last = f[:, -1]
        for step in range(3):
            last = head(last[:, None], ids[:, step : step + 1], pos + step, kv)[:, 0]
            chained.append(last)
        results.append((chained, kv))
    (ours, our_kv), (theirs, their_kv) = results
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, **TOL)
    torch.testing.assert_close(our_kv.storage, their_kv.storage, **TOL)


@torch.inference_mode()
def test_tree_nodes_match_torch(heads):
    native, plain = heads
    c = native.config
    known = 7
    # Depth 1: two nodes (entries 0, 1); depth 2: three nodes under them (entries 2, 3, 4).
    depth_one = torch.tensor([[1, 0], [0, 1]], dtype=torch.bool)
    depth_two = torch.tensor([[1, 0, 1, 0, 0], [1, 0, 0, 1, 0], [0, 1, 0, 0, 1]], dtype=torch.bool)
    outputs = []
    for head in (native, plain):
        kv = BatchKV.empty(c, 1, 32)
        features, ids = _inputs(1, known, seed=3)
        head(features, ids, torch.tensor([0]), kv)
        parents, node_ids = _inputs(1, 2, seed=4)
        first = head.forward_nodes(
            parents[0],
            node_ids[0],
            torch.full((2,), known),
            torch.tensor([known, known + 1]),
            known,
            depth_one,
            kv,
        )
        _, more_ids = _inputs(1, 3, seed=5)
        second = head.forward_nodes(
            first[torch.tensor([0, 0, 1])],
            more_ids[0],
            torch.full((3,), known + 1),
            torch.tensor([known + 2, known + 3, known + 4]),
            known,
            depth_two,
            kv,
        )
        outputs.append((first, second, kv.storage[:, :, :, : known + 5].clone()))
    for a, b in zip(*outputs, strict=True):
        torch.testing.assert_close(a, b, **TOL)


def _drafts(
    head: DraftHead,
    tree_width: int,
    alone: bool = False,
    budgets: tuple[int, ...] = (5, 5, 5),
    sampled: tuple[bool, ...] = (False, False, False),
) -> list[list[int]]:
    """Three requests' drafts, proposed in one batch (or each `alone`); a `sampled` row
    drafts a chain with q whatever the width."""
    proposer = HeadDraftProposer(
        head, torch.arange(512), TINY_CONFIG.vocab_size, tree_width=tree_width
    )
    gen = torch.Generator().manual_seed(8)
    requests = []
    for row, (n, budget) in enumerate(zip([12, 30, 7], budgets, strict=True)):
        ids = torch.randint(0, 512, (n + 1,), generator=gen).tolist()
        states = torch.randn(n, TINY_CONFIG.hidden_size, generator=gen)
        proposer.observe_hidden(f"r{row}", 0, states)
        requests.append(DraftRequest(f"r{row}", ids, budget))
    flags = list(zip(requests, sampled, strict=True))
    groups = [[f] for f in flags] if alone else [flags]
    drafts = [
        d
        for group in groups
        for d in proposer.propose(
            [r for r, _ in group], [q for _, q in group], [tree_width > 1] * len(group)
        )
    ]
    return [d.token_ids + list(d.parents or ()) for d in drafts]


@pytest.mark.parametrize("tree_width", [1, 2])
def test_a_proposer_drafts_the_same_through_either_path(heads, tree_width):
    native, plain = heads
    drafted = _drafts(native, tree_width)
    assert all(len(d) > 0 for d in drafted)
    assert drafted == _drafts(plain, tree_width)


def test_a_batch_feeds_each_request_only_its_new_pairs(heads, monkeypatch):
    """Requests catching up on 12, 30 and 7 pairs cost the native step 49 rows, not three
    padded to 30 (90); their drafts are still what each drafts alone."""
    native = heads[0]
    calls: list[int] = []
    layer = type(native.native)  # the proposer serves the head anew: patch its class
    forward = layer.forward

    def counted(self, token_ids, features, *args, **kwargs):
        calls.append(int(features.shape[0]))
        return forward(self, token_ids, features, *args, **kwargs)

    monkeypatch.setattr(layer, "forward", counted)
    together = _drafts(native, 1)
    assert calls[0] == 12 + 30 + 7
    assert together == _drafts(native, 1, alone=True)


@pytest.mark.parametrize("path", ["native", "torch"])
def test_a_batch_of_trees_is_each_rows_tree_alone(heads, path):
    """Every row's tree grows in the same head calls (one a depth for the batch), over its
    own cache row: the trees are those each request drafts alone, budgets differing."""
    head = heads[0] if path == "native" else heads[1]
    budgets = (3, 7, 5)
    together = _drafts(head, 3, budgets=budgets)
    # Full trees (tokens, then parents: a chain would carry none).
    assert [len(d) for d in together] == [2 * b for b in budgets]
    assert together == _drafts(head, 3, alone=True, budgets=budgets)
    # Beside a sampled row's chain, the greedy rows' trees are still their own.
    mixed = _drafts(head, 3, budgets=budgets, sampled=(False, True, False))
    assert len(mixed[1]) == budgets[1]  # a chain: tokens only
    assert [mixed[0], mixed[2]] == [together[0], together[2]]


@torch.inference_mode()
def test_a_position_past_the_cache_is_refused(heads):
    native, _ = heads
    c = native.config
    kv = BatchKV.empty(c, 1, 8)
    features, ids = _inputs(1, 1, seed=1)
    with pytest.raises(NativeHeadError, match="refused"):
        native(features, ids, torch.tensor([8]), kv)
    layer = native.native
    assert layer is not None
    with pytest.raises(NativeHeadError, match="refused"):
        layer.forward(
            np.array([1]), torch.zeros(1, c.hidden_size), np.array([-1]), np.array([0]), kv
        )
    with pytest.raises(NativeHeadError, match="refused"):  # a token past the embedding
        layer.forward(
            np.array([512]), torch.zeros(1, c.hidden_size), np.array([0]), np.array([0]), kv
        )


def test_q8_0_weights_stay_close_to_fp32():
    """The served default: every matrix in Q8_0 blocks. A block's rounding moves each weight by
    at most half its scale, so states and logits move little, and the drafts mostly agree."""
    native, plain = _heads("q8_0")
    with torch.inference_mode():
        features, ids = _inputs(2, 6, seed=2)
        ours = native(features, ids, torch.tensor([0, 0]), BatchKV.empty(native.config, 2, 16))
        theirs = plain(features, ids, torch.tensor([0, 0]), BatchKV.empty(native.config, 2, 16))
        cosine = torch.nn.functional.cosine_similarity(ours, theirs, dim=-1)
        assert float(cosine.min()) > 0.995
        logits, reference = native.logits(ours), plain.logits(theirs)
        assert (logits.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.9
    drafted, reference_drafts = _drafts(native, 1), _drafts(plain, 1)
    assert sum(a == b for a, b in zip(drafted, reference_drafts, strict=True)) >= 2


def test_q8_0_blocks_round_trip_rows_that_were_blocks():
    """Output rows read back from the target's Q8_0 table quantize to the same integers."""
    gen = torch.Generator().manual_seed(0)
    quants = torch.randint(-127, 128, (6, 4, 32), generator=gen, dtype=torch.int8)
    quants[:, :, 0] = 127  # each block's largest magnitude, as a quantizer leaves it
    scales = torch.rand(6, 4, generator=gen) / 100
    rows = (quants.float() * scales[..., None]).reshape(6, 128)
    got_quants, got_scales = quantize_q8_0(rows)
    assert np.array_equal(got_quants, quants.numpy())
    np.testing.assert_allclose(got_scales, scales.numpy(), rtol=1e-6)
