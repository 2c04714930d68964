"""Every family with a GGUF architecture, written as llama.cpp's converter writes it
(tests/gguf_convert.py) and loaded through our GGUF path: the same config as the
Hugging Face folder, logits within 1e-3 of `transformers`, the same greedy tokens through the
engine — in F32, and in Q8_0 against the reference holding Q8_0's own weights. What a GGUF
cannot say unambiguously is refused by name."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from engine.core.config import EngineConfig
from engine.core.engine import Engine
from engine.kvcache.pool import KVPool
from engine.model.llama import LlamaModel
from engine.model.loader import read_checkpoint
from engine.model.rope import inverse_frequencies
from engine.model.tiny_families import VOCAB, reference_greedy, reference_logits, save_family
from kernels.attention_metadata import AttentionMetadata
from shared.modelfile.config import ModelConfig, ModelFileError
from shared.sampling.params import SamplingParams
from tests.gguf_convert import round_trip_q8_0, write_gguf

pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
LENGTHS = (3, 11, 17, 30, 45)  # straddling the 12-token window and the 16-token block
# What a GGUF can hold of each tiny family. llama.cpp hard-codes Gemma 3's layer pattern
# (every sixth layer global) and its query scale (head_dim), and has no dense layers in
# Qwen 3 MoE: the Gemma model here has six layers, and the Qwen 3 MoE one is sparse throughout.
GGUF_FAMILIES = {
    "llama3": {},
    "qwen2": {},
    "qwen3": {},
    "mistral": {},
    "gemma3": dict(
        num_hidden_layers=6,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
        query_pre_attn_scalar=16,
    ),
    "qwen3_moe": dict(mlp_only_layers=[]),
    "qwen2_moe": {},
    "mixtral": {},
}


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in LENGTHS]


@pytest.fixture(scope="module", params=sorted(GGUF_FAMILIES))
def converted(request, tmp_path_factory):
    """(name, the HF folder, the GGUF written from it, the transformers reference)."""
    name = request.param
    folder = tmp_path_factory.mktemp(name)
    reference = save_family(name, folder, **GGUF_FAMILIES[name])
    return name, folder, write_gguf(name, folder, folder / f"{name}.gguf"), reference


def _comparable(cfg: ModelConfig) -> ModelConfig:
    """The config with what only the spelling differs in made equal: GGUF stores the epsilon
    as float32, an all-global layout as no windows, Gemma's norms with the 1 added, and
    Llama 3's RoPE blend as per-pair factors (the frequencies are compared instead)."""
    return dataclasses.replace(
        cfg,
        rms_norm_eps=round(cfg.rms_norm_eps, 9),
        layer_windows=tuple(cfg.window(i) for i in range(cfg.num_layers)),
        norm_offset=0.0,
        rope_scaling=None,
    )


def _max_logit_error(model: LlamaModel, reference) -> float:
    worst = 0.0
    for prompt in _prompts():
        n = len(prompt)
        pool = KVPool(model.kv_layout(16), 4)
        meta = AttentionMetadata([n], [n], [[0, 1, 2, 3]], 16)
        got = model.logits(model.forward(torch.tensor(prompt), meta, pool))
        worst = max(worst, (got - reference_logits(reference, prompt)).abs().max().item())
    return worst


def _greedy(model: LlamaModel, prompts, **engine) -> list[list[int]]:
    cfg = dict(num_blocks=64, block_size=16, max_num_batched_tokens=256) | engine
    eng = Engine(EngineConfig(**cfg), model=model)
    ids = [eng.add_request(p, GREEDY) for p in prompts]
    out: dict[str, list[int]] = {i: [] for i in ids}
    while eng.has_work:
        for step in eng.step():
            out[step.request_id].extend(step.new_token_ids)
        eng.blocks.check_integrity()
    return [out[i] for i in ids]


def test_gguf_config_is_the_folders(converted):
    name, folder, path, _ = converted
    from_gguf, from_folder = read_checkpoint(path).config, read_checkpoint(folder).config
    expected = {"llama3": "llama"}.get(name, name)
    assert from_gguf.architecture == from_folder.architecture == expected
    assert _comparable(from_gguf) == _comparable(from_folder)
    assert math.isclose(from_gguf.rms_norm_eps, from_folder.rms_norm_eps, rel_tol=1e-6)
    want = inverse_frequencies(
        from_folder.head_dim, from_folder.rope_theta, from_folder.rope_scaling
    )
    got = inverse_frequencies(from_gguf.head_dim, from_gguf.rope_theta, from_gguf.rope_scaling)
    assert torch.allclose(got, want, rtol=1e-6)
    if name == "gemma3":  # the file's norms carry the offset already
        assert from_gguf.norm_offset == 0.0 and from_folder.norm_offset == 1.0


def test_gguf_logits_and_greedy_equal_transformers(converted):
    """Logits on five prompts, and greedy tokens alone, batched and in 7-token chunks."""
    _, _, path, reference = converted
    model = LlamaModel(read_checkpoint(path), weights="fp32")
    assert _max_logit_error(model, reference) <= 1e-3
    prompts = _prompts()
    want = [reference_greedy(reference, p, GREEDY.max_tokens) for p in prompts]
    assert [_greedy(model, [p])[0] for p in prompts] == want
    assert _greedy(model, prompts, max_num_batched_tokens=7) == want


@pytest.mark.parametrize("name", ["qwen2", "mixtral"])
def test_q8_0_gguf_equals_its_dequantized_reference(tmp_path, name):
    """Q8_0 matrices (Qwen 2's biased attention; Mixtral's permuted Q/K and merged experts):
    the model equals transformers holding exactly the weights Q8_0 stores."""
    reference = save_family(name, tmp_path, **GGUF_FAMILIES[name])
    checkpoint = read_checkpoint(write_gguf(name, tmp_path, tmp_path / "q8.gguf", q8_0=True))
    assert "layers.0.q_proj" in checkpoint.q8_0_blocks
    round_trip_q8_0(reference)
    model = LlamaModel(checkpoint, weights="fp32")
    assert _max_logit_error(model, reference) <= 1e-3
    prompts = _prompts()[2:]
    want = [reference_greedy(reference, p, GREEDY.max_tokens) for p in prompts]
    assert _greedy(model, prompts) == want


@pytest.mark.parametrize(
    ("name", "extra", "refused"),
    [
        ("qwen2", lambda w: w.add_sliding_window(12), "sliding window on a 'qwen2' GGUF"),
        (
            "qwen2_moe",
            lambda w: w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID),
            "router that is not a softmax",
        ),
        (
            "qwen3",
            lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.YARN),
            r"RoPE scaling \(yarn\)",
        ),
        ("gemma3", lambda w: w.add_attn_logit_softcapping(50.0), "attention logit soft"),
    ],
)
def test_what_a_gguf_cannot_say_is_refused_by_name(tmp_path, name, extra, refused):
    save_family(name, tmp_path, **GGUF_FAMILIES[name])
    path = write_gguf(name, tmp_path, tmp_path / "x.gguf", extra=extra)
    with pytest.raises(ModelFileError, match=f"unsupported config feature: .*{refused}"):
        read_checkpoint(path)


def test_an_unregistered_architecture_names_those_served(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "phi3.gguf"), "phi3")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelFileError, match="unsupported architecture 'phi3'.*qwen3moe"):
        read_checkpoint(tmp_path / "phi3.gguf")


def test_every_gguf_architecture_reaches_its_family():
    from shared.modelfile.families.registry import FAMILIES, family_for_gguf

    served = {a: f for f in FAMILIES for a in f.gguf_architectures}
    assert set(served) == {"llama", "qwen2", "qwen3", "qwen3moe", "qwen2moe", "gemma3"}
    for arch, family in served.items():
        assert family_for_gguf(arch, "x.gguf") is family and family.config_from_gguf is not None
