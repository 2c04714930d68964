"""Mixtral: Mistral's attention with top-k routed experts, router weights always renormalised."""

from __future__ import annotations

from typing import Any

from shared.modelfile.config import ModelConfig
from shared.modelfile.families.base import (
    LLAMA_LAYER_NAMES,
    Family,
    base_config,
    moe_settings,
    require_activation,
)
from shared.modelfile.families.mistral import sliding_everywhere


def config_from_hf(raw: dict[str, Any], path: str) -> ModelConfig:
    require_activation(raw, path, "hidden_act", "silu")
    moe = moe_settings(raw, int(raw["num_hidden_layers"]), always_normalise=True)
    return base_config(raw, path, "mixtral", layer_windows=sliding_everywhere(raw), moe=moe)


FAMILY = Family(
    name="mixtral",
    hf_architectures=("MixtralForCausalLM",),
    config_from_hf=config_from_hf,
    layer_names={**LLAMA_LAYER_NAMES, "block_sparse_moe.gate.weight": "expert_gate"},
    expert_names={
        "block_sparse_moe.experts.{e}.w1.weight": "gate_proj",
        "block_sparse_moe.experts.{e}.w3.weight": "up_proj",
        "block_sparse_moe.experts.{e}.w2.weight": "down_proj",
    },
)
