"""Split-KV decode and verify kernels equal the torch reference (Triton interpreter on CPU)."""

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed; the kernels cannot be run")

from kernels.reference_attention import reference_paged_attention  # noqa: E402
from kernels.triton_split_kv import (  # noqa: E402
    choose_num_splits,
    paged_decode_attention,
    split_kv_attention,
    verify_attention,
)
from tests.kernels.paged_case import make_case  # noqa: E402

SCALE = 0.125


def _reference(case):
    return reference_paged_attention(
        case.q, case.key_cache, case.value_cache, case.query_lens, case.context_lens,
        case.block_tables, SCALE,
    )  # fmt: skip


def _contexts(block_size: int) -> list[int]:
    # A single token, one short of a block, one past it, several blocks plus a ragged tail.
    return [1, block_size - 1, block_size + 1, 3 * block_size + 5]


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("head_dim", [64, 80])
def test_decode_matches_reference(head_dim, group, block_size):
    contexts = _contexts(block_size)
    case = make_case([1] * len(contexts), contexts, head_dim=head_dim, group=group,
                     block_size=block_size)  # fmt: skip
    out = torch.full_like(case.q, float("nan"))
    # 3 splits of 32 keys: short contexts leave whole splits empty, long ones span pages.
    paged_decode_attention(case.q, case.key_cache, case.value_cache, out, case.batch(), SCALE,
                           num_splits=3)  # fmt: skip
    torch.testing.assert_close(out, _reference(case), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("head_dim", [64, 80])
def test_verify_matches_reference(head_dim, group, block_size):
    # 2, 7 and 16 queries in one batch; the 16-query one's first query sees only key 0..3.
    query_lens = [2, 7, 16]
    contexts = [block_size + 1, 2 * block_size + 3, 19]
    case = make_case(query_lens, contexts, head_dim=head_dim, group=group,
                     block_size=block_size, seed=1)  # fmt: skip
    out = torch.full_like(case.q, float("nan"))
    verify_attention(case.q, case.key_cache, case.value_cache, out, case.batch(), SCALE,
                     num_splits=2)  # fmt: skip
    torch.testing.assert_close(out, _reference(case), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("q_len", [1, 3, 8, 16])
def test_split_count_does_not_change_the_result(q_len):
    case = make_case([q_len, q_len], [q_len + 70, q_len + 5], head_dim=80, group=3,
                     block_size=16, seed=q_len)  # fmt: skip
    expected = _reference(case)
    for splits in (1, 2, 5):  # 1 is the unsplit kernel that writes `out` directly
        out = torch.full_like(case.q, float("nan"))
        split_kv_attention(case.q, case.key_cache, case.value_cache, out, case.batch(), SCALE,
                           num_splits=splits, block_n=16)  # fmt: skip
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def test_bf16_cache():
    case = make_case([1, 4], [40, 33], head_dim=64, group=8, block_size=16,
                     cache_dtype=torch.bfloat16, seed=3)  # fmt: skip
    q = case.q.to(torch.bfloat16)
    out = torch.empty_like(q)
    split_kv_attention(q, case.key_cache, case.value_cache, out, case.batch(), SCALE, 2)
    expected = reference_paged_attention(
        q, case.key_cache, case.value_cache, case.query_lens, case.context_lens,
        case.block_tables, SCALE,
    )  # fmt: skip
    torch.testing.assert_close(out.float(), expected.float(), atol=1e-2, rtol=1e-2)


def test_wrappers_reject_what_they_cannot_run():
    case = make_case([1, 17], [5, 30], head_dim=64, group=1, block_size=16)
    out = torch.empty_like(case.q)
    with pytest.raises(ValueError, match="1-16 query tokens"):
        split_kv_attention(case.q, case.key_cache, case.value_cache, out, case.batch(), SCALE, 1)
    with pytest.raises(ValueError, match="one query per sequence"):
        paged_decode_attention(case.q, case.key_cache, case.value_cache, out, case.batch(), SCALE)
    with pytest.raises(ValueError, match="head_dim"):
        split_kv_attention(case.q[..., :32], case.key_cache, case.value_cache, out[..., :32],
                           case.batch(), SCALE, 1)  # fmt: skip
    with pytest.raises(ValueError, match="contiguous head_dim"):
        split_kv_attention(case.q.transpose(1, 2), case.key_cache, case.value_cache, out,
                           case.batch(), SCALE, 1)  # fmt: skip
    three_heads = make_case([1], [5], head_dim=64, group=1, block_size=16, kv_heads=3)
    with pytest.raises(ValueError, match="multiple of 3 KV heads"):
        split_kv_attention(case.q[:1], three_heads.key_cache, three_heads.value_cache, out[:1],
                           three_heads.batch(), SCALE, 1)  # fmt: skip


def test_split_count_fills_the_device_but_keeps_splits_long():
    # H100: 132 SMs. One sequence, 8 KV heads: 8 programs unsplit, so split until ~264 ...
    assert choose_num_splits(1, 8, 32768, 132) == 33
    # ... but never below MIN_SPLIT_TOKENS keys a split (1k context -> 4 splits at most).
    assert choose_num_splits(1, 8, 1024, 132) == 4
    # A large batch already fills the device: no split, no combine pass.
    assert choose_num_splits(64, 8, 32768, 132) == 1
    assert choose_num_splits(1, 1, 10**6, 132) == 64  # capped
