"""What every family module declares, and the config.json reading they share.

A family is Llama's decoder plus switches (ModelConfig's fields); its module says which
`architectures` / GGUF `general.architecture` names it serves, how its config.json sets the
switches, and which Hugging Face tensor names differ from Llama's. Anything a config asks for
that no switch covers is refused here, by name — a silently wrong model is the one failure
a user cannot see.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shared.modelfile.config import ModelConfig, ModelFileError, MoEConfig, RopeScaling
from shared.modelfile.families.gguf_params import GGUFParams

# Keys whose presence means a feature no family here implements.
_REFUSED_KEYS = {
    "vision_config": "a vision tower",
    "audio_config": "an audio tower",
    "kv_lora_rank": "multi-head latent attention (MLA)",
    "q_lora_rank": "multi-head latent attention (MLA)",
}

# HF per-layer tensor names (after `model.layers.{i}.`, `.weight`/`.bias` kept) -> ours.
LLAMA_LAYER_NAMES = {
    "input_layernorm.weight": "input_norm",
    "self_attn.q_proj.weight": "q_proj",
    "self_attn.k_proj.weight": "k_proj",
    "self_attn.v_proj.weight": "v_proj",
    "self_attn.o_proj.weight": "o_proj",
    "post_attention_layernorm.weight": "post_attention_norm",
    "mlp.gate_proj.weight": "gate_proj",
    "mlp.up_proj.weight": "up_proj",
    "mlp.down_proj.weight": "down_proj",
}
QKV_BIAS_NAMES = {
    "self_attn.q_proj.bias": "q_bias",
    "self_attn.k_proj.bias": "k_bias",
    "self_attn.v_proj.bias": "v_bias",
}
QK_NORM_NAMES = {"self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm"}


@dataclass(frozen=True)
class Family:
    name: str  # ModelConfig.architecture
    hf_architectures: tuple[str, ...]
    config_from_hf: Callable[[dict[str, Any], str], ModelConfig]
    layer_names: dict[str, str]
    # Expert tensors: HF name pattern with `{e}` -> our per-expert suffix.
    expert_names: dict[str, str] = field(default_factory=dict)
    # The GGUF `general.architecture` names this family reads, and how (None: none).
    gguf_architectures: tuple[str, ...] = ()
    config_from_gguf: Callable[[GGUFParams], ModelConfig] | None = None

    def our_name(self, hf_name: str) -> str | None:
        if hf_name == "lm_head.weight":
            return "lm_head"
        name = hf_name.removeprefix("model.")
        if name == "embed_tokens.weight":
            return "embed_tokens"
        if name == "norm.weight":
            return "norm"
        if not name.startswith("layers."):
            return None
        _, layer, rest = name.split(".", 2)
        if rest in self.layer_names:
            return f"layers.{layer}.{self.layer_names[rest]}"
        for pattern, ours in self.expert_names.items():
            prefix, suffix = pattern.split("{e}")
            if rest.startswith(prefix) and rest.endswith(suffix):
                expert = rest[len(prefix) : len(rest) - len(suffix)]
                if expert.isdigit():
                    return f"layers.{layer}.experts.{expert}.{ours}"
        return None


def refuse_unsupported(raw: dict[str, Any], path: str) -> None:
    for key, feature in _REFUSED_KEYS.items():
        if raw.get(key):
            raise ModelFileError(path, f"unsupported config feature: {feature} ('{key}')")
    if float(raw.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ModelFileError(path, "unsupported config feature: partial rotary embeddings")
    if raw.get("mlp_bias"):
        raise ModelFileError(path, "unsupported config feature: MLP biases ('mlp_bias')")


def rope_settings(raw: dict[str, Any], path: str, layer_type: str | None = None):
    """(theta, scaling) from either spelling: transformers 5's `rope_parameters` (maybe per
    layer type) or the Hub's `rope_theta` + `rope_scaling`."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and layer_type is not None and layer_type in params:
        params = params[layer_type]
    if not isinstance(params, dict) or "rope_theta" not in params:
        params = dict(raw.get("rope_scaling") or {}, rope_theta=raw.get("rope_theta", 10000.0))
    theta = float(params["rope_theta"])
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "default":
        return theta, None
    if kind == "linear":
        return theta, RopeScaling("linear", float(params["factor"]))
    if kind == "llama3":
        return theta, RopeScaling(
            "llama3",
            float(params["factor"]),
            float(params["low_freq_factor"]),
            float(params["high_freq_factor"]),
            int(params["original_max_position_embeddings"]),
        )
    raise ModelFileError(path, f"unsupported config feature: RoPE scaling '{kind}'")


def require_activation(raw: dict[str, Any], path: str, key: str, allowed: str) -> None:
    value = raw.get(key) or allowed
    if value != allowed:
        raise ModelFileError(path, f"unsupported config feature: activation '{value}'")


def moe_settings(raw: dict[str, Any], num_layers: int, always_normalise: bool) -> MoEConfig:
    experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    step = int(raw.get("decoder_sparse_step", 1) or 1)
    dense_only = set(raw.get("mlp_only_layers") or ())
    sparse = tuple(
        experts > 0 and i not in dense_only and (i + 1) % step == 0 for i in range(num_layers)
    )
    return MoEConfig(
        num_experts=experts,
        top_k=int(raw["num_experts_per_tok"]),
        expert_intermediate_size=int(raw.get("moe_intermediate_size") or raw["intermediate_size"]),
        norm_topk_prob=always_normalise or bool(raw.get("norm_topk_prob", False)),
        shared_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0),
        sparse_layers=sparse,
    )


def base_config(raw: dict[str, Any], path: str, architecture: str, **switches) -> ModelConfig:
    """The Llama-shaped part every family shares, plus the family's switches."""
    refuse_unsupported(raw, path)
    if "rope_theta" not in switches:
        theta, scaling = rope_settings(raw, path)
        switches = {"rope_theta": theta, "rope_scaling": scaling, **switches}
    try:
        return ModelConfig(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=int(raw["num_attention_heads"]),
            num_kv_heads=int(raw.get("num_key_value_heads") or raw["num_attention_heads"]),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
            max_position=int(raw.get("max_position_embeddings", 2048)),
            tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
            head_dim_override=raw.get("head_dim"),
            architecture=architecture,
            **switches,
        )
    except KeyError as exc:
        raise ModelFileError(path, f"missing key {exc}") from exc
    except ValueError as exc:
        raise ModelFileError(path, str(exc)) from exc
