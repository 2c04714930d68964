"""Llama 2 / 3 / 3.1 / 3.2 and SmolLM2: the base layout (Llama 3.1+ adds `llama3` RoPE scaling)."""

from __future__ import annotations

from typing import Any

from shared.modelfile.config import ModelConfig, ModelFileError
from shared.modelfile.families.base import (
    LLAMA_LAYER_NAMES,
    Family,
    base_config,
    require_activation,
)
from shared.modelfile.families.gguf_params import (
    GGUFParams,
    every_layer,
    gguf_base_config,
    moe_from_gguf,
)


def config_from_hf(raw: dict[str, Any], path: str) -> ModelConfig:
    if raw.get("attention_bias"):
        raise ModelFileError(path, "unsupported config feature: attention biases on Llama")
    require_activation(raw, path, "hidden_act", "silu")
    return base_config(raw, path, "llama")


def config_from_gguf(p: GGUFParams) -> ModelConfig:
    """llama.cpp writes Llama, Mistral and Mixtral all as `llama` (Q and K rows permuted,
    undone by the tensor reader). A sliding window, where a file keeps Mistral's, makes it
    Mistral's layout; experts make it Mixtral's, whose router weights llama.cpp always
    renormalises."""
    window = p.get("attention.sliding_window")
    moe = moe_from_gguf(p, normalise=True)
    architecture = "mixtral" if moe else "mistral" if window else "llama"
    return gguf_base_config(p, architecture, layer_windows=every_layer(p, window), moe=moe)


FAMILY = Family(
    name="llama",
    hf_architectures=("LlamaForCausalLM",),
    config_from_hf=config_from_hf,
    layer_names=LLAMA_LAYER_NAMES,
    gguf_architectures=("llama",),
    config_from_gguf=config_from_gguf,
)
