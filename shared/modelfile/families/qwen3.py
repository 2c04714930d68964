"""Qwen 3 dense: Llama's layout with an RMSNorm over each head of q and k before RoPE."""

from __future__ import annotations

from typing import Any

from shared.modelfile.config import ModelConfig, ModelFileError
from shared.modelfile.families.base import (
    LLAMA_LAYER_NAMES,
    QK_NORM_NAMES,
    Family,
    base_config,
    require_activation,
)
from shared.modelfile.families.gguf_params import (
    GGUFParams,
    gguf_base_config,
    refuse_sliding_window,
)
from shared.modelfile.families.qwen2 import qwen_windows


def config_from_hf(raw: dict[str, Any], path: str) -> ModelConfig:
    if raw.get("attention_bias"):
        raise ModelFileError(path, "unsupported config feature: attention biases on Qwen 3")
    require_activation(raw, path, "hidden_act", "silu")
    return base_config(raw, path, "qwen3", qk_norm=True, layer_windows=qwen_windows(raw))


def config_from_gguf(p: GGUFParams) -> ModelConfig:
    refuse_sliding_window(p)
    return gguf_base_config(p, "qwen3", qk_norm=True)


FAMILY = Family(
    name="qwen3",
    hf_architectures=("Qwen3ForCausalLM",),
    config_from_hf=config_from_hf,
    layer_names={**LLAMA_LAYER_NAMES, **QK_NORM_NAMES},
    gguf_architectures=("qwen3",),
    config_from_gguf=config_from_gguf,
)
