"""Mistral: Llama's layout with one sliding window on every layer (when the config sets one)."""

from __future__ import annotations

from typing import Any

from shared.modelfile.config import ModelConfig
from shared.modelfile.families.base import (
    LLAMA_LAYER_NAMES,
    Family,
    base_config,
    require_activation,
)


def sliding_everywhere(raw: dict[str, Any]) -> tuple[int | None, ...]:
    window = raw.get("sliding_window")
    return tuple([int(window) if window else None] * int(raw["num_hidden_layers"]))


def config_from_hf(raw: dict[str, Any], path: str) -> ModelConfig:
    require_activation(raw, path, "hidden_act", "silu")
    return base_config(raw, path, "mistral", layer_windows=sliding_everywhere(raw))


FAMILY = Family(
    name="mistral",
    hf_architectures=("MistralForCausalLM",),
    config_from_hf=config_from_hf,
    layer_names=LLAMA_LAYER_NAMES,
)
