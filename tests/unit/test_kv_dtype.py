"""`kv_cache_dtype`: what each name resolves to, and refusals of names that mean nothing."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from engine.core.config import EngineConfig
from engine.core.engine import Engine
from engine.kvcache import kv_dtype
from engine.model.llama import LlamaModel
from engine.model.tiny import tiny_checkpoint
from shared.config.schema import WorkerConfig


def test_named_dtypes_are_taken_as_given():
    assert kv_dtype.resolve_kv_dtype("float32")[0] is torch.float32
    assert kv_dtype.resolve_kv_dtype("float16")[0] is torch.float16


@pytest.mark.parametrize("converts, want", [(True, torch.float16), (False, torch.float32)])
def test_auto_takes_fp16_only_where_the_cpu_converts_it(monkeypatch, converts, want):
    monkeypatch.setattr(kv_dtype, "_cpu_converts_fp16", lambda: converts)
    dtype, why = kv_dtype.resolve_kv_dtype("auto")
    assert dtype is want
    assert why.startswith("auto:")
    assert kv_dtype.resolve_kv_dtype("auto", "cuda:0")[0] is torch.float16


def test_unknown_names_are_refused_at_every_edge():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, float32, float16"):
        kv_dtype.resolve_kv_dtype("bfloat16")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int8")  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="kv_cache_dtype"):
        WorkerConfig(kv_cache_dtype="fp16")  # type: ignore[arg-type]


def test_an_fp16_pool_holds_twice_the_tokens_of_a_budget():
    model = LlamaModel(tiny_checkpoint(seed=0))
    budget = 1 << 20
    fp32 = Engine(EngineConfig(kv_cache_bytes=budget), model=model)
    fp16 = Engine(EngineConfig(kv_cache_bytes=budget, kv_cache_dtype="float16"), model=model)
    assert fp16.pool.tensor.dtype is torch.float16
    assert fp16.pool.num_blocks == 2 * fp32.pool.num_blocks
    assert fp16.pool.nbytes <= budget


def test_fp16_kv_through_the_torch_path_equals_its_own_single_sequence_run():
    """Batched and chunked prompts over an fp16 pool give what each gives alone (torch path;
    the native path's engine tests are parametrized over both dtypes in test_native_step)."""
    from shared.sampling.params import SamplingParams

    model = LlamaModel(tiny_checkpoint(seed=0))
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompts = [[3 + (i * 7 + j) % 400 for j in range(5 + 9 * i)] for i in range(6)]

    def engine(**kw):
        return Engine(EngineConfig(num_blocks=96, kv_cache_dtype="float16", **kw), model=model)

    alone = [engine().generate([p], greedy)[0] for p in prompts]
    for kw in ({}, {"max_num_batched_tokens": 7}):
        e = engine(**kw)
        assert e.generate(prompts, greedy) == alone
        e.blocks.check_integrity()
