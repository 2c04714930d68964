"""A GGUF's hyper-parameters from its metadata, without reading its tensors.

For processes that never run the model (the coordinator needs the context length) and as the
first step of loading one (`shared.model.gguf_file`).
"""

from __future__ import annotations

import os

from shared.modelfile.config import ModelConfig, ModelFileError

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


def field_value(reader, key: str):
    """A metadata value, or None when the file does not have the key."""
    f = reader.fields.get(key)
    if f is None:
        return None
    try:
        return f.contents()
    except Exception:  # older gguf versions lack contents(); fall back to raw parts
        return f.parts[f.data[0]].tolist()[0] if f.data else None


def _require(reader, path: str, key: str):
    value = field_value(reader, key)
    if value is None:
        raise ModelFileError(path, f"GGUF metadata key '{key}' is missing")
    return value


def config_from_reader(reader, path: str) -> ModelConfig:
    """The hyper-parameters of an open `gguf.GGUFReader`; refuses what we cannot run."""
    arch = _require(reader, path, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelFileError(
            path,
            f"unsupported architecture '{arch}' (supported: {', '.join(SUPPORTED_ARCHITECTURES)})",
        )
    for t in reader.tensors:
        if t.tensor_type.name not in SUPPORTED_TENSOR_TYPES:
            raise ModelFileError(
                path,
                f"tensor '{t.name}' has unsupported type {t.tensor_type.name} "
                f"(supported: {', '.join(SUPPORTED_TENSOR_TYPES)})",
            )
    n_heads = int(_require(reader, path, f"{arch}.attention.head_count"))
    n_kv = int(field_value(reader, f"{arch}.attention.head_count_kv") or n_heads)
    hidden = int(_require(reader, path, f"{arch}.embedding_length"))
    names = {t.name for t in reader.tensors}
    vocab = field_value(reader, f"{arch}.vocab_size")
    if vocab is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
        vocab = len(tokens.data) if tokens is not None else embd.shape[-1] if embd else None
    if vocab is None:
        raise ModelFileError(path, "cannot tell the vocabulary size")
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_require(reader, path, f"{arch}.feed_forward_length")),
        num_layers=int(_require(reader, path, f"{arch}.block_count")),
        num_heads=n_heads,
        num_kv_heads=n_kv,
        rope_theta=float(field_value(reader, f"{arch}.rope.freq_base") or 10000.0),
        rms_norm_eps=float(_require(reader, path, f"{arch}.attention.layer_norm_rms_epsilon")),
        max_position=int(field_value(reader, f"{arch}.context_length") or 2048),
        tie_embeddings="output.weight" not in names,
    )


def open_gguf(path: str):
    """A `gguf.GGUFReader` (memory-maps the file), or a ModelFileError saying what is wrong."""
    import gguf  # imported here: loading HF checkpoints must not need it

    if not os.path.isfile(path):
        raise ModelFileError(path, "model file does not exist")
    try:
        return gguf.GGUFReader(path)
    except Exception as exc:  # the gguf package raises plain ValueError/struct errors
        raise ModelFileError(
            path, f"not a readable GGUF file (truncated or corrupt?): {exc}"
        ) from exc


def read_gguf_config(path: str | os.PathLike) -> ModelConfig:
    """Only the hyper-parameters (tensors stay on disk): for processes that never run it."""
    path = str(path)
    return config_from_reader(open_gguf(path), path)
