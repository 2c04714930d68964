"""Read a Hugging Face folder: config.json plus safetensors (one file or a sharded index).

The family (shared/modelfile/families/) is picked from `architectures`; it reads the config's
switches and names the tensors, so one loader serves every registered layout.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from engine.model.gguf_file import Checkpoint
from engine.model.tensor_names import expected_tensor_names
from shared.modelfile.config import ModelFileError
from shared.modelfile.hf_config import read_hf_family

INDEX_FILE = "model.safetensors.index.json"


def _shards(folder: Path) -> list[Path]:
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise ModelFileError(str(index), f"unreadable shard index: {exc}") from exc
        shards = [folder / name for name in sorted(set(weight_map.values()))]
        absent = [s.name for s in shards if not s.is_file()]
        if absent:
            raise ModelFileError(str(folder), f"shards named by the index are missing: {absent}")
        return shards
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise ModelFileError(str(folder), "no *.safetensors files in the model folder")
    return shards


def read_hf_folder(folder: str | os.PathLike) -> Checkpoint:
    from safetensors.torch import load_file

    folder = Path(folder)
    family, config = read_hf_family(folder)
    tensors: dict[str, torch.Tensor] = {}
    for shard in _shards(folder):
        try:
            state = load_file(str(shard))
        except Exception as exc:
            raise ModelFileError(str(shard), f"unreadable safetensors file: {exc}") from exc
        for hf_name, value in state.items():
            name = family.our_name(hf_name)
            if name is not None:
                tensors[name] = value.to(torch.float32).contiguous()
    missing = [n for n in expected_tensor_names(config) if n not in tensors]
    if missing:
        raise ModelFileError(str(folder), f"missing tensors: {', '.join(missing[:5])}")
    return Checkpoint(config=config, tensors=tensors, source=str(folder))
