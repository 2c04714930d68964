"""The tensors a config needs, by our own names (whatever the file called them)."""

from __future__ import annotations

from shared.modelfile.config import ModelConfig

DENSE_LAYER_NAMES = (
    "input_norm",
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "post_attention_norm",
    "gate_proj",
    "up_proj",
    "down_proj",
)
MLP_NAMES = ("gate_proj", "up_proj", "down_proj")


def is_sparse(config: ModelConfig, layer: int) -> bool:
    return config.moe is not None and config.moe.sparse_layers[layer]


def layer_tensor_names(config: ModelConfig, layer: int) -> list[str]:
    names = [n for n in DENSE_LAYER_NAMES if n not in MLP_NAMES]
    if config.qkv_bias:
        names += ["q_bias", "k_bias", "v_bias"]
    if config.qk_norm:
        names += ["q_norm", "k_norm"]
    if config.sandwich_norms:
        names += ["attn_out_norm", "mlp_out_norm"]
    moe = config.moe
    if moe is not None and is_sparse(config, layer):
        names.append("expert_gate")
        names += [f"experts.{e}.{m}" for e in range(moe.num_experts) for m in MLP_NAMES]
        if moe.shared_intermediate_size:
            names += [f"shared.{m}" for m in MLP_NAMES] + ["shared_gate"]
    else:
        names += list(MLP_NAMES)
    return [f"layers.{layer}.{n}" for n in names]


def expected_tensor_names(config: ModelConfig) -> list[str]:
    names = ["embed_tokens", "norm"] + ([] if config.tie_embeddings else ["lm_head"])
    for i in range(config.num_layers):
        names += layer_tensor_names(config, i)
    return names
