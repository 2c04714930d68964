"""A GGUF's hyper-parameters from its metadata, without reading its tensors.

For processes that never run the model (the coordinator needs the context length) and as the
first step of loading one (`shared.model.gguf_file`).
"""

from __future__ import annotations

import os

from shared.modelfile.config import ModelConfig, ModelFileError
from shared.modelfile.gguf_header import GGUFFormatError, GGUFHeader, read_gguf_header

SUPPORTED_ARCHITECTURES = ("llama",)
SUPPORTED_TENSOR_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)


def read_header(path: str | os.PathLike) -> GGUFHeader:
    """The file's metadata and tensor directory, or a ModelFileError saying what is wrong."""
    path = str(path)
    if not os.path.isfile(path):
        raise ModelFileError(path, "model file does not exist")
    try:
        return read_gguf_header(path)
    except (OSError, GGUFFormatError) as exc:
        raise ModelFileError(
            path, f"not a readable GGUF file (truncated or corrupt?): {exc}"
        ) from exc


def _require(header: GGUFHeader, key: str):
    value = header.get(key)
    if value is None:
        raise ModelFileError(header.path, f"GGUF metadata key '{key}' is missing")
    return value


def config_from_header(header: GGUFHeader) -> ModelConfig:
    """The hyper-parameters the header describes; refuses what we cannot run."""
    path = header.path
    arch = _require(header, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelFileError(
            path,
            f"unsupported architecture '{arch}' (supported: {', '.join(SUPPORTED_ARCHITECTURES)})",
        )
    for t in header.tensors:
        if t.type_name not in SUPPORTED_TENSOR_TYPES:
            raise ModelFileError(
                path,
                f"tensor '{t.name}' has unsupported type {t.type_name} "
                f"(supported: {', '.join(SUPPORTED_TENSOR_TYPES)})",
            )
    n_heads = int(_require(header, f"{arch}.attention.head_count"))
    n_kv = int(header.get(f"{arch}.attention.head_count_kv") or n_heads)
    hidden = int(_require(header, f"{arch}.embedding_length"))
    names = {t.name for t in header.tensors}
    scaling = header.get(f"{arch}.rope.scaling.type")
    if "rope_freqs.weight" in names or scaling not in (None, "none"):
        # Llama 3.1+ files carry per-frequency factors; recomputing RoPE from the theta alone
        # would serve a silently different model.
        raise ModelFileError(
            path, f"unsupported config feature: RoPE scaling ({scaling or 'rope_freqs tensor'})"
        )
    vocab = header.get(f"{arch}.vocab_size")
    if vocab is None:
        tokens = header.get("tokenizer.ggml.tokens")
        embd = next((t for t in header.tensors if t.name == "token_embd.weight"), None)
        vocab = len(tokens) if tokens is not None else embd.shape[-1] if embd else None
    if vocab is None:
        raise ModelFileError(path, "cannot tell the vocabulary size")
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_require(header, f"{arch}.feed_forward_length")),
        num_layers=int(_require(header, f"{arch}.block_count")),
        num_heads=n_heads,
        num_kv_heads=n_kv,
        rope_theta=float(header.get(f"{arch}.rope.freq_base") or 10000.0),
        rms_norm_eps=float(_require(header, f"{arch}.attention.layer_norm_rms_epsilon")),
        max_position=int(header.get(f"{arch}.context_length") or 2048),
        tie_embeddings="output.weight" not in names,
    )


def read_gguf_config(path: str | os.PathLike) -> ModelConfig:
    """Only the hyper-parameters (tensors stay on disk): for processes that never run it."""
    return config_from_header(read_header(path))
