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


FAMILY = Family(
    name="gemma3",
    hf_architectures=("Gemma3ForCausalLM",),
    config_from_hf=config_from_hf,
    layer_names=_NAMES,
)
