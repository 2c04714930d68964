"""Qwen 2 / 2.5: Llama's layout with biases on Q, K and V; sliding layers per `layer_types`."""

from __future__ import annotations

from typing import Any

from shared.modelfile.config import ModelConfig
from shared.modelfile.families.base import (
    LLAMA_LAYER_NAMES,
    QKV_BIAS_NAMES,
    Family,
    base_config,
    require_activation,
)
from shared.modelfile.families.gguf_params import (
    GGUFParams,
    gguf_base_config,
    refuse_sliding_window,
)


def qwen_windows(raw: dict[str, Any]) -> tuple[int | None, ...]:
    """Qwen slides only with `use_sliding_window`, and then only from `max_window_layers` on
    (transformers' own rule when the config carries no `layer_types`)."""
    n = int(raw["num_hidden_layers"])
    window = raw.get("sliding_window") if raw.get("use_sliding_window") else None
    if not window:
        return (None,) * n
    if raw.get("layer_types"):
        types = raw["layer_types"]
    else:
        first = int(raw.get("max_window_layers", n))
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    return tuple(int(window) if t == "sliding_attention" else None for t in types)


def config_from_hf(raw: dict[str, Any], path: str) -> ModelConfig:
    require_activation(raw, path, "hidden_act", "silu")
    return base_config(raw, path, "qwen2", qkv_bias=True, layer_windows=qwen_windows(raw))


def config_from_gguf(p: GGUFParams) -> ModelConfig:
    refuse_sliding_window(p)
    return gguf_base_config(p, "qwen2")


FAMILY = Family(
    name="qwen2",
    hf_architectures=("Qwen2ForCausalLM",),
    config_from_hf=config_from_hf,
    layer_names={**LLAMA_LAYER_NAMES, **QKV_BIAS_NAMES},
    gguf_architectures=("qwen2",),
    config_from_gguf=config_from_gguf,
)
