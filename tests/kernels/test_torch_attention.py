"""The torch paged-attention kernel: a verify step whose sequences all bring the same number of
queries (the dense group, served by views instead of gathers) computes what the general
padded-batch path and the float64 reference compute."""

from __future__ import annotations

import pytest
import torch

from kernels.reference_attention import reference_paged_attention
from kernels.torch_attention import TorchPagedAttention
from tests.kernels.paged_case import make_case

SCALE = 0.125


def _run(case, *, dense: bool, trees=None, window=None):
    """The kernel's output and the pool after it, with the dense path allowed or not."""
    pool = case.pool.clone()
    kernel = TorchPagedAttention()
    meta = case.metadata(trees)
    kernel.prepare(meta)
    state = meta.kernel_state["torch"]
    if not dense:
        state["dense"] = False
    taken = state["dense"]
    out = kernel.forward(
        case.q, case.k_new, case.v_new, pool[:, 1, 0], pool[:, 1, 1], meta, SCALE, window
    )
    return out, pool, taken


@pytest.mark.parametrize(
    ("query_lens", "contexts"),
    [
        ([9], [300]),  # one sequence verifying eight drafted tokens
        ([5, 5, 5], [40, 37, 60]),  # a batch, contexts within one bucket
        ([2, 2], [2, 17]),  # a context no longer than the queries
    ],
)
@pytest.mark.parametrize("group", [1, 3])
def test_a_dense_verify_step_matches_the_general_path_and_the_reference(
    query_lens, contexts, group
):
    case = make_case(query_lens, contexts, head_dim=64, group=group, block_size=16, seed=3)
    out, pool, taken = _run(case, dense=True)
    general, general_pool, _ = _run(case, dense=False)
    assert taken, "equal query lengths in flat order are a dense group"
    assert torch.equal(pool, general_pool)  # the same K/V writes
    torch.testing.assert_close(out, general, atol=1e-6, rtol=1e-6)
    expected = reference_paged_attention(
        case.q, pool[:, 1, 0], pool[:, 1, 1], case.query_lens, case.context_lens,
        case.block_tables, SCALE,
    )  # fmt: skip
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def test_a_dense_draft_tree_and_a_sliding_window_match_the_general_path():
    case = make_case([4, 4], [50, 33], head_dim=64, group=3, block_size=16, seed=4)
    trees = [(-1, 0, 0), (-1, 0, 1)]  # a fork, then a chain
    out, _, taken = _run(case, dense=True, trees=trees)
    general, _, _ = _run(case, dense=False, trees=trees)
    assert taken
    torch.testing.assert_close(out, general, atol=1e-6, rtol=1e-6)
    out, _, _ = _run(case, dense=True, window=20)
    general, _, _ = _run(case, dense=False, window=20)
    torch.testing.assert_close(out, general, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    ("query_lens", "contexts"),
    [
        ([1, 1], [30, 30]),  # decode rows: their own path
        ([3, 5], [30, 40]),  # unequal query lengths: padded
        ([4, 20], [30, 40]),  # a prefill chunk beside a verify
    ],
)
def test_other_steps_are_not_dense(query_lens, contexts):
    case = make_case(query_lens, contexts, head_dim=64, group=3, block_size=16, seed=5)
    _, _, taken = _run(case, dense=True)
    assert not taken


@pytest.mark.parametrize(
    ("query_lens", "contexts"),
    [
        ([9, 3, 1, 5], [120, 100, 90, 130]),  # a batch's verify step: padded to 9 queries
        ([1, 1, 1], [30, 41, 17]),  # decode rows of unequal contexts: masked keys
        ([4, 20], [30, 40]),  # a prefill chunk beside a verify
    ],
)
def test_padded_and_masked_steps_match_the_reference_with_one_mask_a_step(query_lens, contexts):
    case = make_case(query_lens, contexts, head_dim=64, group=3, block_size=16, seed=6)
    pool = case.pool.clone()
    kernel = TorchPagedAttention()
    meta = case.metadata()
    keys, values = pool[:, 1, 0], pool[:, 1, 1]
    out = kernel.forward(case.q, case.k_new, case.v_new, keys, values, meta, SCALE)
    masks = [g.sdpa_mask for g in meta.kernel_state["torch"]["groups"]]
    assert all(m is not None and m.dtype == case.q.dtype for m in masks)
    # A second layer of the same step reuses the additive mask SDPA reads, not a new one.
    again = kernel.forward(case.q, case.k_new, case.v_new, keys, values, meta, SCALE)
    groups = meta.kernel_state["torch"]["groups"]
    assert all(g.sdpa_mask is m for g, m in zip(groups, masks, strict=True))
    assert torch.equal(out, again)
    expected = reference_paged_attention(
        case.q, keys, values, case.query_lens, case.context_lens, case.block_tables, SCALE
    )
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
