"""Gemma 3 (text): interleaved sliding/global layers with their own RoPE thetas, (1 + w)
RMSNorms (four per layer), per-head q/k norms, GeGLU, embeddings scaled by sqrt(hidden),
attention scaled by query_pre_attn_scalar, and final-logit soft-capping when configured."""

from __future__ import annotations

from typing import Any

from shared.modelfile.config import ModelConfig, ModelFileError
from shared.modelfile.families.base import (
    LLAMA_LAYER_NAMES,
    QK_NORM_NAMES,
    Family,
    base_config,
    require_activation,
    rope_settings,
)
from shared.modelfile.families.gguf_params import GGUFParams, gguf_base_config, rope_scaling

# What llama.cpp hard-codes for Gemma 3 rather than reading from the file: every sixth layer
# is global, the sliding layers rotate with theta 10000 (unscaled), and attention is scaled
# by head_dim except for the 27B model (62 layers), whose query_pre_attn_scalar is
# hidden / heads.
_GGUF_PATTERN = 6
_GGUF_LOCAL_THETA = 10000.0
_GGUF_27B_LAYERS = 62

# Gemma's `post_attention_layernorm` normalises the attention *output*; its pre-MLP norm is
# `pre_feedforward_layernorm` (Llama's `post_attention_layernorm` role).
_NAMES = {
    **LLAMA_LAYER_NAMES,
    **QK_NORM_NAMES,
    "post_attention_layernorm.weight": "attn_out_norm",
    "pre_feedforward_layernorm.weight": "post_attention_norm",
    "post_feedforward_layernorm.weight": "mlp_out_norm",
}


def _layer_types(raw: dict[str, Any]) -> list[str]:
    n = int(raw["num_hidden_layers"])
    if raw.get("layer_types"):
        return list(raw["layer_types"])
    pattern = int(raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6)
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]


def config_from_hf(raw: dict[str, Any], path: str) -> ModelConfig:
    if raw.get("attn_logit_softcapping") is not None:
        # transformers' Gemma 3 ignores this key; serving it would disagree with the reference.
        raise ModelFileError(path, "unsupported config feature: attention logit soft-capping")
    if raw.get("attention_bias"):
        raise ModelFileError(path, "unsupported config feature: attention biases on Gemma 3")
    require_activation(raw, path, "hidden_activation", "gelu_pytorch_tanh")
    theta, scaling = rope_settings(raw, path, "full_attention")
    if (
        isinstance(raw.get("rope_parameters"), dict)
        and "sliding_attention" in raw["rope_parameters"]
    ):
        local_theta, local_scaling = rope_settings(raw, path, "sliding_attention")
        if local_scaling is not None:
            raise ModelFileError(path, "unsupported config feature: scaled RoPE on local layers")
    else:
        local_theta = float(raw.get("rope_local_base_freq", 10000.0))
    window = int(raw.get("sliding_window") or 4096)
    windows = tuple(window if t == "sliding_attention" else None for t in _layer_types(raw))
    cap = raw.get("final_logit_softcapping")
    head_dim = int(raw.get("head_dim") or 256)
    return base_config(
        raw,
        path,
        "gemma3",
        rope_theta=theta,
        rope_scaling=scaling,
        local_rope_theta=local_theta,
        layer_windows=windows,
        qk_norm=True,
        norm_offset=1.0,
        activation="gelu_tanh",
        embed_scale=float(raw["hidden_size"]) ** 0.5,
        query_scale=float(raw.get("query_pre_attn_scalar") or head_dim),
        final_softcap=float(cap) if cap is not None else None,
        sandwich_norms=True,
    )


def _gguf_windows(p: GGUFParams, window: int) -> tuple[int | None, ...]:
    """Per layer window: a `sliding_window_pattern` key (a period, or a flag per layer,
    True where the layer slides) where the file has one, else llama.cpp's period of 6."""
    pattern = p.get("attention.sliding_window_pattern", _GGUF_PATTERN)
    n = p.num_layers
    if isinstance(pattern, list):
        if len(pattern) != n:
            raise ModelFileError(p.path, f"{len(pattern)} sliding-window flags for {n} layers")
        return tuple(window if slides else None for slides in pattern)
    period = int(pattern)
    return tuple(window if period and i % period < period - 1 else None for i in range(n))


def config_from_gguf(p: GGUFParams) -> ModelConfig:
    """llama.cpp's converter stores Gemma's norms with the 1 already added (so no offset
    here) and keeps the interleaving, query scale and local theta as conventions."""
    if p.get("attn_logit_softcapping") is not None:
        raise p.unsupported("attention logit soft-capping")
    window = int(p.require("attention.sliding_window"))
    hidden, heads = int(p.require("embedding_length")), int(p.require("attention.head_count"))
    head_dim = int(p.require("attention.key_length"))
    query_scale = hidden / heads if p.num_layers == _GGUF_27B_LAYERS else head_dim
    cap = p.get("final_logit_softcapping")
    return gguf_base_config(
        p,
        "gemma3",
        rope_theta=float(p.get("rope.freq_base", 1_000_000.0)),
        rope_scaling=rope_scaling(p, head_dim),
        local_rope_theta=float(p.get("rope.freq_base_swa", _GGUF_LOCAL_THETA)),
        layer_windows=_gguf_windows(p, window),
        qk_norm=True,
        activation="gelu_tanh",
        embed_scale=hidden**0.5,
        query_scale=float(query_scale),
        final_softcap=float(cap) if cap is not None else None,
        sandwich_norms=True,
    )


FAMILY = Family(
    name="gemma3",
    hf_architectures=("Gemma3ForCausalLM",),
    config_from_hf=config_from_hf,
    layer_names=_NAMES,
    gguf_architectures=("gemma3",),
    config_from_gguf=config_from_gguf,
)
