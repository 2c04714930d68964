"""Qwen 3 MoE and Qwen 2 MoE: top-k routed experts (router probabilities renormalised when
`norm_topk_prob`), and for Qwen 2 MoE a sigmoid-gated shared expert beside them."""

from __future__ import annotations

from typing import Any

from shared.modelfile.config import ModelConfig, ModelFileError
from shared.modelfile.families.base import (
    LLAMA_LAYER_NAMES,
    QK_NORM_NAMES,
    QKV_BIAS_NAMES,
    Family,
    base_config,
    moe_settings,
    require_activation,
)
from shared.modelfile.families.gguf_params import (
    GGUFParams,
    gguf_base_config,
    moe_from_gguf,
    refuse_sliding_window,
)
from shared.modelfile.families.mistral import sliding_everywhere
from shared.modelfile.families.qwen2 import qwen_windows

_MOE_NAMES = {
    "mlp.gate.weight": "expert_gate",
    "mlp.shared_expert.gate_proj.weight": "shared.gate_proj",
    "mlp.shared_expert.up_proj.weight": "shared.up_proj",
    "mlp.shared_expert.down_proj.weight": "shared.down_proj",
    "mlp.shared_expert_gate.weight": "shared_gate",
}
_EXPERT_NAMES = {
    "mlp.experts.{e}.gate_proj.weight": "gate_proj",
    "mlp.experts.{e}.up_proj.weight": "up_proj",
    "mlp.experts.{e}.down_proj.weight": "down_proj",
}


def qwen3_moe_config(raw: dict[str, Any], path: str) -> ModelConfig:
    if raw.get("attention_bias"):
        raise ModelFileError(path, "unsupported config feature: attention biases on Qwen 3 MoE")
    require_activation(raw, path, "hidden_act", "silu")
    # transformers' Qwen 3 MoE slides every layer when the window is on.
    windows = sliding_everywhere(raw) if raw.get("use_sliding_window") else ()
    moe = moe_settings(raw, int(raw["num_hidden_layers"]), always_normalise=False)
    return base_config(raw, path, "qwen3_moe", qk_norm=True, layer_windows=windows, moe=moe)


def qwen2_moe_config(raw: dict[str, Any], path: str) -> ModelConfig:
    require_activation(raw, path, "hidden_act", "silu")
    moe = moe_settings(raw, int(raw["num_hidden_layers"]), always_normalise=False)
    return base_config(
        raw,
        path,
        "qwen2_moe",
        qkv_bias=bool(raw.get("qkv_bias", True)),
        layer_windows=qwen_windows(raw),
        moe=moe,
    )


def qwen3_moe_gguf(p: GGUFParams) -> ModelConfig:
    # llama.cpp renormalises Qwen 3 MoE's top-k weights (every released config sets
    # norm_topk_prob) and not Qwen 2 MoE's; an `expert_weights_norm` key says otherwise.
    refuse_sliding_window(p)
    return gguf_base_config(p, "qwen3_moe", qk_norm=True, moe=moe_from_gguf(p, normalise=True))


def qwen2_moe_gguf(p: GGUFParams) -> ModelConfig:
    refuse_sliding_window(p)
    return gguf_base_config(p, "qwen2_moe", moe=moe_from_gguf(p, normalise=False))


QWEN3_MOE = Family(
    name="qwen3_moe",
    hf_architectures=("Qwen3MoeForCausalLM",),
    config_from_hf=qwen3_moe_config,
    layer_names={**LLAMA_LAYER_NAMES, **QK_NORM_NAMES, **_MOE_NAMES},
    expert_names=_EXPERT_NAMES,
    gguf_architectures=("qwen3moe",),
    config_from_gguf=qwen3_moe_gguf,
)
QWEN2_MOE = Family(
    name="qwen2_moe",
    hf_architectures=("Qwen2MoeForCausalLM",),
    config_from_hf=qwen2_moe_config,
    layer_names={**LLAMA_LAYER_NAMES, **QKV_BIAS_NAMES, **_MOE_NAMES},
    expert_names=_EXPERT_NAMES,
    gguf_architectures=("qwen2moe",),
    config_from_gguf=qwen2_moe_gguf,
)
