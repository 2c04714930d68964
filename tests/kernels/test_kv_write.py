"""The K/V slot-write kernel stores exactly what the reference stores."""

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed; the kernels cannot be run")

from kernels.reference_attention import reference_write_kv  # noqa: E402
from kernels.triton_kv_write import write_kv_slots  # noqa: E402
from tests.kernels.paged_case import make_case  # noqa: E402


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 80])
def test_write_matches_reference(head_dim, block_size, cache_dtype):
    case = make_case([5], [2 * block_size], head_dim=head_dim, group=1, block_size=block_size,
                     kv_heads=3, cache_dtype=cache_dtype)  # fmt: skip
    table = case.block_tables[0]
    # Across a block boundary, plus one padding token (block -1) that must write nothing.
    positions = [block_size - 2, block_size - 1, block_size, block_size + 1]
    blocks = [table[p // block_size] for p in positions] + [-1]
    offsets = [p % block_size for p in positions] + [0]
    # New K/V already in the cache dtype, as a bf16 model produces them: the interpreter's
    # fp32 -> bf16 cast can differ from torch's by one ulp, and casting is not under test.
    k_new, v_new = case.k_new.to(cache_dtype), case.v_new.to(cache_dtype)
    expected = case.pool.clone()
    reference_write_kv(k_new, v_new, expected[:, 1, 0], expected[:, 1, 1], blocks, offsets)
    write_kv_slots(k_new, v_new, case.key_cache, case.value_cache, torch.tensor(blocks),
                   torch.tensor(offsets))  # fmt: skip
    assert torch.equal(case.pool, expected)  # other layer and untouched slots included
    assert torch.equal(case.value_cache[blocks[2], offsets[2]], v_new[2])


def test_write_rejects_mismatched_shapes():
    case = make_case([2], [4], head_dim=64, group=1, block_size=16)
    with pytest.raises(ValueError, match="kv_heads, head_dim"):
        write_kv_slots(case.k_new[:, :1], case.v_new, case.key_cache, case.value_cache,
                       torch.tensor([0, 0]), torch.tensor([0, 1]))  # fmt: skip
    with pytest.raises(ValueError, match="slot_blocks"):
        write_kv_slots(case.k_new, case.v_new, case.key_cache, case.value_cache,
                       torch.tensor([0]), torch.tensor([0, 1]))  # fmt: skip
