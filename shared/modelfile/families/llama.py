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


def config_from_hf(raw: dict[str, Any], path: str) -> ModelConfig:
    if raw.get("attention_bias"):
        raise ModelFileError(path, "unsupported config feature: attention biases on Llama")
    require_activation(raw, path, "hidden_act", "silu")
    return base_config(raw, path, "llama")


FAMILY = Family(
    name="llama",
    hf_architectures=("LlamaForCausalLM",),
    config_from_hf=config_from_hf,
    layer_names=LLAMA_LAYER_NAMES,
    gguf_architectures=("llama",),
)
