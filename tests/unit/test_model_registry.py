"""The registry picks a family from config.json, reads each family's switches as the Hub
spells them, and refuses — by name — what no family implements."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from engine.model.linear import Linear
from engine.model.llama import LlamaModel, NativeUnavailable
from engine.model.moe import SparseMLP, gated_mlp
from engine.model.tiny import TINY_CONFIG, tiny_checkpoint
from shared.modelfile.config import ModelFileError, RopeScaling
from shared.modelfile.families.registry import FAMILIES, family_for_hf
from shared.modelfile.hf_config import read_hf_config

_BASE = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 12,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def _config(tmp_path, **raw):
    (tmp_path / "config.json").write_text(json.dumps({**_BASE, **raw}))
    return read_hf_config(tmp_path)


def test_every_family_is_reachable_by_its_architecture():
    for family in FAMILIES:
        for arch in family.hf_architectures:
            assert family_for_hf({"architectures": [arch]}, "x") is family


def test_llama_3_2_hub_config(tmp_path):
    cfg = _config(
        tmp_path,
        architectures=["LlamaForCausalLM"],
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        tie_word_embeddings=True,
    )
    assert cfg.rope_scaling == RopeScaling("llama3", 32.0, 1.0, 4.0, 8192)
    assert cfg.rope_theta == 500000.0 and not cfg.is_plain_llama


def test_gemma_3_hub_config(tmp_path):
    cfg = _config(
        tmp_path,
        architectures=["Gemma3ForCausalLM"],
        head_dim=16,
        rope_theta=1e6,
        rope_local_base_freq=1e4,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        sliding_window=512,
        sliding_window_pattern=6,
        query_pre_attn_scalar=256,
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
        hidden_activation="gelu_pytorch_tanh",
    )
    globals_ = [i for i in range(12) if cfg.window(i) is None]
    assert globals_ == [5, 11] and cfg.window(0) == 512
    assert cfg.rope_theta == 1e6 and cfg.local_rope_theta == 1e4
    assert cfg.rope_scaling == RopeScaling("linear", 8.0)
    assert cfg.embed_scale == 8.0 and cfg.query_scale == 256 and cfg.norm_offset == 1.0
    assert cfg.max_window is None  # global layers keep every block


def test_qwen_slides_only_when_asked_and_from_max_window_layers(tmp_path):
    raw = dict(architectures=["Qwen2ForCausalLM"], sliding_window=64, max_window_layers=8)
    assert _config(tmp_path, **raw).layer_windows == (None,) * 12
    cfg = _config(tmp_path, **raw, use_sliding_window=True)
    assert cfg.layer_windows == (None,) * 8 + (64,) * 4 and cfg.qkv_bias


def test_mistral_slides_every_layer(tmp_path):
    cfg = _config(tmp_path, architectures=["MistralForCausalLM"], sliding_window=4096)
    assert cfg.max_window == 4096


@pytest.mark.parametrize(
    ("raw", "named"),
    [
        ({"architectures": ["DeepseekV3ForCausalLM"]}, "DeepseekV3ForCausalLM"),
        ({"architectures": ["Gemma3ForConditionalGeneration"]}, "Gemma3ForConditionalGeneration"),
        ({"architectures": ["LlamaForCausalLM"], "kv_lora_rank": 512}, "MLA"),
        ({"architectures": ["Qwen2ForCausalLM"], "vision_config": {"depth": 2}}, "vision tower"),
        (
            {"architectures": ["Qwen3ForCausalLM"], "rope_scaling": {"rope_type": "yarn"}},
            "RoPE scaling 'yarn'",
        ),
        ({"architectures": ["LlamaForCausalLM"], "hidden_act": "gelu"}, "activation 'gelu'"),
        ({"architectures": ["Gemma3ForCausalLM"], "attn_logit_softcapping": 50.0}, "soft-capping"),
    ],
)
def test_unsupported_is_refused_by_name(tmp_path, raw, named):
    with pytest.raises(ModelFileError, match=named):
        _config(tmp_path, **raw)


def test_native_step_refuses_other_layouts():
    config = dataclasses.replace(TINY_CONFIG, rope_scaling=RopeScaling("linear", 2.0))
    checkpoint = dataclasses.replace(tiny_checkpoint(), config=config)
    with pytest.raises(NativeUnavailable, match="Llama's layout only"):
        LlamaModel(checkpoint, weights="native")


def test_grouped_experts_equal_a_per_token_loop_and_count_load():
    gen = torch.Generator().manual_seed(0)
    hidden, inter, experts, k = 16, 8, 5, 2
    weights = [
        (torch.randn(2 * inter, hidden, generator=gen), torch.randn(hidden, inter, generator=gen))
        for _ in range(experts)
    ]
    router = torch.randn(experts, hidden, generator=gen)
    mlp = SparseMLP(
        router,
        [(Linear(gu, "fp32"), Linear(d, "fp32")) for gu, d in weights],
        inter,
        k,
        normalise=True,
        activation="silu",
    )
    x = torch.randn(23, hidden, generator=gen)
    got = mlp(x)
    probs = torch.softmax(x @ router.T, dim=-1)
    for t in range(x.shape[0]):
        top, ids = probs[t].topk(k)
        top = top / top.sum()
        want = sum(
            w * gated_mlp(x[t : t + 1], *mlp.experts[e], inter, "silu")[0]
            for w, e in zip(top.tolist(), ids.tolist(), strict=True)
        )
        assert torch.allclose(got[t], want, atol=1e-4)
    assert int(mlp.load.sum()) == x.shape[0] * k


def test_format_chooser_slices_per_layer_switches_with_the_layers():
    from engine.model.formats import _slice
    from engine.model.gguf_file import Checkpoint
    from shared.modelfile.config import MoEConfig

    moe = MoEConfig(4, 2, 16, True, sparse_layers=(True, False, True))
    config = dataclasses.replace(
        TINY_CONFIG, num_layers=3, layer_windows=(8, None, 8), moe=moe, architecture="x"
    )
    sliced = _slice(Checkpoint(config=config, tensors={}, source="x")).config
    assert sliced.num_layers == 2 and sliced.layer_windows == (8, None)
    assert sliced.moe is not None and sliced.moe.sparse_layers == (True, False)
