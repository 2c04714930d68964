"""The Triton attention kernel is a drop-in for the torch one: same K/V writes, outputs, model."""

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed; the kernels cannot be run")

from kernels.attention_metadata import AttentionMetadata  # noqa: E402
from kernels.select import attention_kernel_for  # noqa: E402
from kernels.torch_attention import TorchPagedAttention  # noqa: E402
from kernels.triton_attention import TritonPagedAttention, plan_step  # noqa: E402
from tests.kernels.paged_case import make_case  # noqa: E402


def test_step_plan_sorts_sequences_by_kernel():
    case = make_case([1, 17, 4, 1, 16], [9, 40, 30, 3, 16], head_dim=64, group=1, block_size=16)
    step = plan_step(case.metadata())
    assert step.decode.query_start.tolist() == [0, 22]
    assert step.verify.query_start.tolist() == [18, 23]
    assert step.prefill.query_start.tolist() == [1]
    assert step.verify.token_seq.tolist() == [0] * 4 + [1] * 16
    assert (
        plan_step(make_case([1], [5], head_dim=64, group=1, block_size=16).metadata()).verify
        is None
    )


@pytest.mark.parametrize("group", [1, 3])
def test_mixed_step_matches_torch_kernel(group):
    # Decode, verify (2 and 16 queries) and prefill chunks (a prompt, a chunk after a prefix).
    query_lens = [1, 2, 16, 1, 30, 21]
    contexts = [33, 18, 40, 1, 30, 21 + 35]
    case = make_case(query_lens, contexts, head_dim=80, group=group, block_size=16, seed=5)
    torch_pool = case.pool.clone()
    expected = TorchPagedAttention().forward(
        case.q,
        case.k_new,
        case.v_new,
        torch_pool[:, 1, 0],
        torch_pool[:, 1, 1],
        case.metadata(),
        0.1,
    )
    meta = case.metadata()
    kernel = TritonPagedAttention(num_splits=2)
    kernel.prepare(meta)
    out = kernel.forward(
        case.q, case.k_new, case.v_new, case.key_cache, case.value_cache, meta, 0.1
    )
    assert torch.equal(case.pool, torch_pool)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def test_tiny_model_forward_is_the_same_with_either_kernel(tiny_model):
    from engine.kvcache.pool import KVPool
    from engine.model.llama import LlamaModel
    from engine.model.tiny import tiny_checkpoint

    triton_model = LlamaModel(tiny_checkpoint(seed=0), weights="fp32",
                              attention=TritonPagedAttention())  # fmt: skip
    models = (tiny_model, triton_model)
    pools = [KVPool(model.kv_layout(16), num_blocks=12) for model in models]

    def step(query_lens, contexts, ids):
        hidden = [
            model.forward(
                torch.tensor(ids), AttentionMetadata(query_lens, contexts, tables, 16), kv
            )
            for model, kv in zip(models, pools, strict=True)
        ]
        torch.testing.assert_close(hidden[1], hidden[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(pools[1].tensor, pools[0].tensor, atol=1e-5, rtol=1e-5)

    gen = torch.Generator().manual_seed(0)
    prompt_a = torch.randint(0, 512, (40,), generator=gen).tolist()
    prompt_b = torch.randint(0, 512, (5,), generator=gen).tolist()
    tables = [[3, 7, 1, 9], [0, 5]]
    step([20, 5], [20, 5], prompt_a[:20] + prompt_b)  # a prompt chunk, a verify-sized prompt
    step([20, 1], [40, 6], prompt_a[20:] + [11])  # a chunk after a cached prefix, a decode
    step([6, 1], [46, 7], [1, 2, 3, 4, 5, 6] + [12])  # a verify, a decode


def test_kernel_selection_by_device():
    assert isinstance(attention_kernel_for("cpu"), TorchPagedAttention)
    assert isinstance(attention_kernel_for(torch.device("cuda", 0)), TritonPagedAttention)
