"""The profiler and tuner for every family: a model's shape is the same read from its
config.json, its GGUF, or its loaded config (so measured and analytic profiles of one model
carry one hash), and the profiler's measurements run on sliding-window and MoE models."""

from __future__ import annotations

import dataclasses

import pytest

from engine.core.config import EngineConfig
from engine.core.engine import Engine
from engine.model.llama import LlamaModel
from engine.model.loader import read_checkpoint
from engine.model.tiny_families import FAMILIES, save_family
from tests.gguf_convert import write_gguf
from tools.profiler.fit import fit_decode, fit_prefill
from tools.profiler.measure import measure_decode, measure_prefill
from tools.profiler.model_shape import ModelShape, read_model_shape

pytest.importorskip("transformers")


def _fields(shape: ModelShape) -> dict:
    return {k: v for k, v in dataclasses.asdict(shape).items() if k != "name"}


@pytest.mark.parametrize("name", FAMILIES)
def test_shape_is_one_whichever_file_describes_it(tmp_path, name):
    save_family(name, tmp_path, **({"mlp_only_layers": []} if name == "qwen3_moe" else {}))
    analytic = read_model_shape(tmp_path)
    loaded = ModelShape.from_config(read_checkpoint(tmp_path).config, "loaded")
    assert _fields(analytic) == _fields(loaded)
    assert analytic.config_hash == loaded.config_hash
    assert analytic.is_moe == (name in ("qwen3_moe", "qwen2_moe", "mixtral"))
    if name != "gemma3":  # whose GGUF layout needs six layers (test_families_gguf.py)
        gguf = write_gguf(name, tmp_path, tmp_path / "m.gguf")
        assert _fields(read_model_shape(gguf)) == _fields(analytic)


@pytest.mark.parametrize("name", ["mistral", "gemma3", "qwen3_moe"])
def test_profiler_measures_the_family(tmp_path, name):
    """Prefill points reuse exactly the planted prefix (measure_prefill checks it) also where
    layers slide, decode batches run whole, and both fit."""
    save_family(name, tmp_path)
    model = LlamaModel(read_checkpoint(tmp_path), weights="fp32")
    engine = Engine(
        EngineConfig(num_blocks=512, max_num_batched_tokens=64, max_num_seqs=64), model=model
    )
    prefill = measure_prefill(engine, (64, 128), (0.0, 0.5), repeats=1, progress=lambda _: None)
    assert [(p.tokens, p.cached) for p in prefill] == [(64, 0), (64, 32), (128, 0), (128, 64)]
    decode = measure_decode(engine, (1, 4), (32, 64), steps=2, progress=lambda _: None)
    assert all(p.ms > 0 for p in prefill + decode)
    assert engine.blocks.num_available_blocks == engine.blocks.num_blocks
    fit, _ = fit_prefill(prefill, 64)
    assert fit.token_ms >= 0 and fit.step_ms >= 0
    fit_decode(decode)
