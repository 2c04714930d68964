"""A Hugging Face folder's config.json, read through the family its `architectures` names.

Torch-free (the coordinator reads it for the context length); the tensors are read by
engine/model/hf_folder.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from shared.modelfile.config import ModelConfig, ModelFileError
from shared.modelfile.families.base import Family
from shared.modelfile.families.registry import family_for_hf


def read_raw_config(folder: str | os.PathLike) -> tuple[dict[str, Any], str]:
    config_path = Path(folder) / "config.json"
    if not config_path.is_file():
        raise ModelFileError(str(folder), "no config.json in the model folder")
    try:
        return json.loads(config_path.read_text()), str(config_path)
    except json.JSONDecodeError as exc:
        raise ModelFileError(str(config_path), f"invalid JSON: {exc}") from exc


def read_hf_family(folder: str | os.PathLike) -> tuple[Family, ModelConfig]:
    """The folder's family and config; refuses what no family serves, by name."""
    raw, path = read_raw_config(folder)
    family = family_for_hf(raw, path)
    return family, family.config_from_hf(raw, path)


def read_hf_config(folder: str | os.PathLike) -> ModelConfig:
    return read_hf_family(folder)[1]
