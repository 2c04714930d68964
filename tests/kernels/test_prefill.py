"""Chunked-prefill kernel equals the torch reference (Triton interpreter on CPU)."""

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed; the kernels cannot be run")

from kernels.reference_attention import reference_paged_attention  # noqa: E402
from kernels.triton_prefill import chunked_prefill_attention  # noqa: E402
from tests.kernels.paged_case import make_case  # noqa: E402

SCALE = 0.1


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("head_dim", [64, 80])
def test_prefill_matches_reference(head_dim, group, block_size):
    # A whole prompt (no prefix), and a 37-token chunk after a prefix ending mid-block; with
    # 16-query tiles the chunks span several tiles and the diagonal falls inside them.
    query_lens = [20, 37]
    contexts = [20, block_size + 3 + 37]
    case = make_case(query_lens, contexts, head_dim=head_dim, group=group,
                     block_size=block_size, kv_heads=1, seed=2)  # fmt: skip
    out = torch.full_like(case.q, float("nan"))
    chunked_prefill_attention(case.q, case.key_cache, case.value_cache, out, case.batch(), SCALE,
                              block_m=16, block_n=32)  # fmt: skip
    expected = reference_paged_attention(
        case.q, case.key_cache, case.value_cache, query_lens, contexts, case.block_tables, SCALE
    )
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def test_prefill_rejects_bad_tiles():
    case = make_case([20], [20], head_dim=64, group=1, block_size=16)
    out = torch.empty_like(case.q)
    with pytest.raises(ValueError, match="power of two"):
        chunked_prefill_attention(case.q, case.key_cache, case.value_cache, out, case.batch(),
                                  SCALE, block_m=24)  # fmt: skip
