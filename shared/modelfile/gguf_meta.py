"""A GGUF's hyper-parameters from its metadata, without reading its tensors.

For processes that never run the model (the coordinator needs the context length) and as the
first step of loading one (`engine.model.gguf_file`).
"""

from __future__ import annotations

import os

from shared.modelfile.config import ModelConfig, ModelFileError
from shared.modelfile.families.gguf_params import GGUFParams
from shared.modelfile.families.registry import family_for_gguf
from shared.modelfile.gguf_header import GGUFFormatError, GGUFHeader, read_gguf_header

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
    """The hyper-parameters the header describes, read by the family its
    `general.architecture` names; refuses what we cannot run."""
    path = header.path
    arch = _require(header, "general.architecture")
    family = family_for_gguf(arch, path)
    for t in header.tensors:
        if t.type_name not in SUPPORTED_TENSOR_TYPES:
            raise ModelFileError(
                path,
                f"tensor '{t.name}' has unsupported type {t.type_name} "
                f"(supported: {', '.join(SUPPORTED_TENSOR_TYPES)})",
            )
    assert family.config_from_gguf is not None  # the registry lists only families that read GGUF
    return family.config_from_gguf(GGUFParams(header, arch))


def read_gguf_config(path: str | os.PathLike) -> ModelConfig:
    """Only the hyper-parameters (tensors stay on disk): for processes that never run it."""
    return config_from_header(read_header(path))
