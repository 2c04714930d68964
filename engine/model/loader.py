"""Find and read a checkpoint: the bundled SmolLM2 by default, or any GGUF file / HF folder."""

from __future__ import annotations

import os
from pathlib import Path

from engine.model.gguf_file import Checkpoint, read_gguf
from engine.model.hf_folder import read_hf_folder
from shared.modelfile.config import ModelFileError
from shared.modelfile.default import default_model_path


def read_checkpoint(path: str | os.PathLike | None = None) -> Checkpoint:
    path = str(path) if path is not None else default_model_path()
    if os.path.isdir(path):
        return read_hf_folder(path)
    if not os.path.exists(path):
        raise ModelFileError(path, "model file does not exist")
    if Path(path).suffix.lower() == ".gguf" or _has_gguf_magic(path):
        return read_gguf(path)
    raise ModelFileError(path, "not a GGUF file nor a Hugging Face model folder")


def _has_gguf_magic(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"
