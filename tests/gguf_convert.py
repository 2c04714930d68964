"""Write a saved transformers checkpoint as a GGUF, the way llama.cpp's converter does.

For the GGUF loader's tests: names come from the `gguf` package's own HF -> GGUF tensor map,
and the converter's transformations are redone here — Q/K rows permuted for `llama` files,
Gemma's norms stored with their 1 added, experts stacked into one tensor per matrix, the
tied head left out — so a loader that forgot to undo one of them fails its logits test.
Our own extension: Mistral's and Mixtral's sliding window is kept as
`llama.attention.sliding_window` (llama.cpp's converter drops it).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

# Our family -> the GGUF architecture its converter writes.
GGUF_ARCH = {
    "llama3": "LLAMA",
    "mistral": "LLAMA",
    "mixtral": "LLAMA",
    "qwen2": "QWEN2",
    "qwen3": "QWEN3",
    "qwen3_moe": "QWEN3MOE",
    "qwen2_moe": "QWEN2MOE",
    "gemma3": "GEMMA3",
}
# The HF per-expert names and the merged name the converter stacks them under.
_EXPERT_MATRICES = {
    "mlp.experts.{e}.gate_proj": "mlp.experts.gate_proj",
    "mlp.experts.{e}.up_proj": "mlp.experts.up_proj",
    "mlp.experts.{e}.down_proj": "mlp.experts.down_proj",
    "block_sparse_moe.experts.{e}.w1": "block_sparse_moe.experts.w1",
    "block_sparse_moe.experts.{e}.w3": "block_sparse_moe.experts.w3",
    "block_sparse_moe.experts.{e}.w2": "block_sparse_moe.experts.w2",
}


def permute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's Q/K row order: each head's rotate-half halves interleaved into pairs."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .transpose(1, 2)
        .reshape(w.shape)
    )


def _rope(config: dict, layer_type: str) -> dict:
    params = config.get("rope_parameters") or {}
    params = params.get(layer_type, params)
    return params or {"rope_theta": config.get("rope_theta", 10000.0)}


def llama3_rope_factors(rope: dict, head_dim: int) -> np.ndarray:
    """The per-pair divisors the converter stores as `rope_freqs` for Llama 3.1's blend:
    1 for short wavelengths, `factor` for long ones, interpolated between."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    pairs = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
    wavelen = 2 * math.pi * rope["rope_theta"] ** pairs
    smooth = (old / wavelen - low) / (high - low)
    blended = 1 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelen < old / high, 1.0, np.where(wavelen > old / low, factor, blended))
    return out.astype(np.float32)


def _metadata(writer, family: str, c: dict) -> None:
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(c["hidden_size"])
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(c["num_attention_heads"])
    writer.add_head_count_kv(c["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    rope = _rope(c, "full_attention")
    writer.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "linear":
        import gguf

        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if "sliding_attention" in (c.get("rope_parameters") or {}):
        writer.add_rope_freq_base_swa(_rope(c, "sliding_attention")["rope_theta"])
    experts = c.get("num_local_experts") or c.get("num_experts")
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(c["num_experts_per_tok"])
    if c.get("moe_intermediate_size"):
        writer.add_expert_feed_forward_length(c["moe_intermediate_size"])
    if c.get("shared_expert_intermediate_size"):
        writer.add_expert_shared_feed_forward_length(c["shared_expert_intermediate_size"])
    if c.get("head_dim"):
        writer.add_key_length(c["head_dim"])
        writer.add_value_length(c["head_dim"])
    if family == "gemma3":
        if c.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(c["final_logit_softcapping"])
        writer.add_sliding_window(c["sliding_window"])
    if family in ("mistral", "mixtral") and c.get("sliding_window"):
        writer.add_sliding_window(c["sliding_window"])


def _merge_experts(state: dict[str, torch.Tensor], layers: int) -> dict[str, torch.Tensor]:
    out = dict(state)
    for i in range(layers):
        for per_expert, merged in _EXPERT_MATRICES.items():
            names = []
            while (name := f"model.layers.{i}.{per_expert.format(e=len(names))}.weight") in out:
                names.append(name)
            if names:
                out[f"model.layers.{i}.{merged}.weight"] = torch.stack([out.pop(n) for n in names])
    return out


def write_gguf(
    family: str,
    folder: Path,
    path: Path,
    q8_0: bool = False,
    extra: Callable[[Any], None] | None = None,
) -> Path:
    """`folder` (a saved transformers checkpoint of `family`) as the GGUF at `path`: every
    tensor F32, or with `q8_0` every matrix whose rows split into 32-blocks in Q8_0.
    `extra(writer)` adds metadata a converter would not write (the refusal tests)."""
    import gguf
    from safetensors.torch import load_file

    c = json.loads((folder / "config.json").read_text())
    arch = gguf.MODEL_ARCH[GGUF_ARCH[family]]
    layers = c["num_hidden_layers"]
    names = gguf.get_tensor_name_map(arch, layers)
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    _metadata(writer, family, c)
    if extra is not None:
        extra(writer)
    rope = _rope(c, "full_attention")
    if rope.get("rope_type") == "llama3":
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(rope, head_dim))
    state = _merge_experts(load_file(str(folder / "model.safetensors")), layers)
    for hf_name, tensor in state.items():
        if hf_name == "lm_head.weight" and c.get("tie_word_embeddings"):
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, f"no GGUF name for {hf_name}"
        w = tensor.to(torch.float32)
        if arch == gguf.MODEL_ARCH.LLAMA and hf_name.endswith("q_proj.weight"):
            w = permute_rope_rows(w, c["num_attention_heads"])
        if arch == gguf.MODEL_ARCH.LLAMA and hf_name.endswith("k_proj.weight"):
            w = permute_rope_rows(w, c["num_key_value_heads"])
        if family == "gemma3" and hf_name.endswith("norm.weight"):
            w = w + 1.0
        data = np.ascontiguousarray(w.numpy())
        if q8_0 and data.ndim >= 2 and data.shape[-1] % 32 == 0:
            kind = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@torch.no_grad()
def round_trip_q8_0(model) -> None:
    """Replace the model's matrices by what Q8_0 stores of them: the reference a Q8_0 GGUF
    of it must match (each row's blocks are independent, so any row order agrees)."""
    import gguf

    kind = gguf.GGMLQuantizationType.Q8_0
    for p in model.parameters():
        if p.dim() >= 2 and p.shape[-1] % 32 == 0:
            data = np.ascontiguousarray(p.numpy())
            back = gguf.quants.dequantize(gguf.quants.quantize(data, kind), kind)
            p.copy_(torch.from_numpy(np.asarray(back, dtype=np.float32).reshape(p.shape)))
