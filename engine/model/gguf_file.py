"""Read a GGUF of any registered family: its hyper-parameters and its tensors, dequantized to fp32.

GGUF names a tensor by its role, the same for every architecture (`ffn_norm` is always the
norm before the MLP, `post_attention_norm` always the one on the attention's output), so one
table maps them onto our names. llama.cpp's converter permutes the rows of Q and K of `llama`
files (only those) so that RoPE rotates adjacent pairs; we undo that here so GGUF and Hugging
Face checkpoints share one model (rotate-half RoPE) and one layout. Experts arrive merged into
one [experts, out, in] tensor per matrix and are split back. Q4_1 tensors also keep their raw
blocks, so the int4 path can reuse the file's own quantization instead of re-quantizing
already-quantized weights.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from math import prod

import numpy as np
import torch

from engine.model.gguf_dequant import PLAIN_TYPES as _PLAIN_TYPES
from engine.model.gguf_dequant import dequantize_rows
from engine.model.tensor_names import expected_tensor_names
from shared.modelfile.config import ModelConfig, ModelFileError
from shared.modelfile.gguf_header import GGML_TYPES_BY_NAME, TensorInfo
from shared.modelfile.gguf_meta import config_from_header, read_header

# GGUF per-layer tensor names (after `blk.{i}.`) -> ours.
_LAYER_NAMES = {
    "attn_norm.weight": "input_norm",
    "attn_q.weight": "q_proj",
    "attn_k.weight": "k_proj",
    "attn_v.weight": "v_proj",
    "attn_q.bias": "q_bias",
    "attn_k.bias": "k_bias",
    "attn_v.bias": "v_bias",
    "attn_q_norm.weight": "q_norm",
    "attn_k_norm.weight": "k_norm",
    "attn_output.weight": "o_proj",
    "post_attention_norm.weight": "attn_out_norm",
    "ffn_norm.weight": "post_attention_norm",
    "post_ffw_norm.weight": "mlp_out_norm",
    "ffn_gate.weight": "gate_proj",
    "ffn_up.weight": "up_proj",
    "ffn_down.weight": "down_proj",
    "ffn_gate_inp.weight": "expert_gate",
    "ffn_gate_shexp.weight": "shared.gate_proj",
    "ffn_up_shexp.weight": "shared.up_proj",
    "ffn_down_shexp.weight": "shared.down_proj",
    "ffn_gate_inp_shexp.weight": "shared_gate",
}
# Experts merged into one tensor per matrix ([experts, out, in] in PyTorch order).
_MERGED_EXPERTS = {
    "ffn_gate_exps.weight": "gate_proj",
    "ffn_up_exps.weight": "up_proj",
    "ffn_down_exps.weight": "down_proj",
}
# Older Mixtral files: one tensor per expert, `blk.{i}.ffn_gate.{e}.weight`.
_SPLIT_EXPERTS = {"ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}
# Architectures whose converter permutes the rows of Q and K.
_PERMUTED_ARCHITECTURES = ("llama",)


@dataclass
class Checkpoint:
    """Weights by our own names, each an fp32 tensor with PyTorch's [out, in] layout."""

    config: ModelConfig
    tensors: dict[str, torch.Tensor]
    source: str
    # Name -> (uint8 blocks [out, in/32, 20]) for Q4_1 tensors, already un-permuted.
    q4_1_blocks: dict[str, np.ndarray] = field(default_factory=dict)
    # Name -> (uint8 blocks [out, in/32, 34]) for Q8_0 tensors (the native step reads them).
    q8_0_blocks: dict[str, np.ndarray] = field(default_factory=dict)
    metadata: dict[str, object] = field(default_factory=dict)


def unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's Q/K row permutation (interleaved pairs -> rotate-half halves)."""
    rows = w.shape[0]
    return (
        w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
    )


def read_gguf(path: str | os.PathLike) -> Checkpoint:
    path = str(path)
    header = read_header(path)  # checks the whole file is there before anything maps it
    config = config_from_header(header)
    permuted = header.get("general.architecture") in _PERMUTED_ARCHITECTURES
    n_heads, n_kv = config.num_heads, config.num_kv_heads
    tensors: dict[str, torch.Tensor] = {}
    q4_1: dict[str, np.ndarray] = {}
    q8_0: dict[str, np.ndarray] = {}
    # The tensor directory comes from our own header parser: the `gguf` package's reader
    # builds a numpy view per metadata element, 9 s for SmolLM2's vocabulary on the 2-core
    # machine, paid by every worker start (and every restart after a crash).
    file_bytes = np.memmap(path, dtype=np.uint8, mode="r")
    for t in header.tensors:
        name = _our_name(t.name)
        if name is None:
            continue
        shape = tuple(reversed(t.shape))  # PyTorch order: the contiguous dimension last
        raw = _raw_rows(file_bytes, t)
        if header.byte_order != "<" and t.type_name not in _PLAIN_TYPES:
            raise ModelFileError(
                path,
                f"tensor '{t.name}' is {t.type_name} in a big-endian GGUF: only F32, F16 and "
                "BF16 tensors are read from big-endian files",
            )
        weight = torch.from_numpy(dequantize_rows(raw, t.type_name, header.byte_order))
        weight = weight.reshape(shape)
        if name.endswith(".experts"):  # merged: one [out, in] matrix per expert
            layer, matrix = name.removesuffix(".experts").rsplit(".", 1)
            for e in range(weight.shape[0]):
                tensors[f"{layer}.experts.{e}.{matrix}"] = weight[e]
            continue
        if name.endswith("shared_gate"):
            weight = weight.reshape(1, -1)  # a [1, hidden] projection, however the file shaped it
        heads = 0
        if permuted:
            heads = n_heads if name.endswith("q_proj") else n_kv if name.endswith("k_proj") else 0
        if heads:
            weight = unpermute_rope_rows(weight, heads)
        tensors[name] = weight
        if t.type_name in ("Q4_1", "Q8_0"):
            width = 20 if t.type_name == "Q4_1" else 34
            # A view of the mapped file (pages shared with the OS cache), copied only to reorder.
            blocks = raw.reshape(shape[0], -1, width)
            if heads:
                blocks = unpermute_rope_rows(torch.from_numpy(blocks.copy()), heads).numpy()
            (q4_1 if t.type_name == "Q4_1" else q8_0)[name] = blocks
    _check_complete(path, config, tensors)
    meta = {k: header.get(k) for k in ("general.name", "general.file_type")}
    return Checkpoint(
        config=config,
        tensors=tensors,
        source=path,
        q4_1_blocks=q4_1,
        q8_0_blocks=q8_0,
        metadata=meta,
    )


def _raw_rows(file_bytes: np.ndarray, t: TensorInfo) -> np.ndarray:
    """The tensor's bytes in the file, one row (ne0 elements) per line: read-only, mapped."""
    _, block, block_bytes = GGML_TYPES_BY_NAME[t.type_name]
    row_bytes = t.shape[0] // block * block_bytes
    rows = prod(t.shape[1:])
    return file_bytes[t.offset : t.offset + rows * row_bytes].reshape(rows, row_bytes)


def _our_name(gguf_name: str) -> str | None:
    """Our name for a GGUF tensor; merged experts come back as `layers.{i}.{matrix}.experts`
    (split by the caller). None for tensors recomputed (rope_freqs) or not ours."""
    if gguf_name == "token_embd.weight":
        return "embed_tokens"
    if gguf_name == "output_norm.weight":
        return "norm"
    if gguf_name == "output.weight":
        return "lm_head"
    if not gguf_name.startswith("blk."):
        return None
    _, layer, rest = gguf_name.split(".", 2)
    if rest in _LAYER_NAMES:
        return f"layers.{layer}.{_LAYER_NAMES[rest]}"
    if rest in _MERGED_EXPERTS:
        return f"layers.{layer}.{_MERGED_EXPERTS[rest]}.experts"
    matrix, _, expert = rest.removesuffix(".weight").partition(".")
    if matrix in _SPLIT_EXPERTS and expert.isdigit():
        return f"layers.{layer}.experts.{expert}.{_SPLIT_EXPERTS[matrix]}"
    return None


def _check_complete(path: str, config: ModelConfig, tensors: dict[str, torch.Tensor]) -> None:
    missing = [n for n in expected_tensor_names(config) if n not in tensors]
    if missing:
        raise ModelFileError(path, f"missing tensors: {', '.join(missing[:5])}")
