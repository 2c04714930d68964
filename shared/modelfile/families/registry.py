"""The families served, picked from a checkpoint's `architectures` (or GGUF architecture)."""

from __future__ import annotations

from typing import Any

from shared.modelfile.config import ModelFileError
from shared.modelfile.families import gemma3, llama, mistral, mixtral, qwen2, qwen3, qwen_moe
from shared.modelfile.families.base import Family

FAMILIES: tuple[Family, ...] = (
    llama.FAMILY,
    mistral.FAMILY,
    qwen2.FAMILY,
    qwen3.FAMILY,
    gemma3.FAMILY,
    qwen_moe.QWEN3_MOE,
    qwen_moe.QWEN2_MOE,
    mixtral.FAMILY,
)
_BY_HF = {arch: f for f in FAMILIES for arch in f.hf_architectures}
_BY_GGUF = {arch: f for f in FAMILIES for arch in f.gguf_architectures}
# Older folders name no `architectures`; their `model_type` still says which layout it is.
_BY_MODEL_TYPE = {"llama": llama.FAMILY, "mistral": mistral.FAMILY, "qwen2": qwen2.FAMILY}


def family_for_hf(raw: dict[str, Any], path: str) -> Family:
    architectures = raw.get("architectures") or []
    for arch in architectures:
        if arch in _BY_HF:
            return _BY_HF[arch]
    if not architectures and raw.get("model_type", "llama") in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[raw.get("model_type", "llama")]
    named = ", ".join(architectures) or f"model_type '{raw.get('model_type')}'"
    supported = ", ".join(sorted(_BY_HF))
    raise ModelFileError(path, f"unsupported architecture {named} (supported: {supported})")


def family_for_gguf(arch: str, path: str) -> Family:
    """The family reading a GGUF of `general.architecture` `arch`; refuses others by name."""
    if arch not in _BY_GGUF:
        supported = ", ".join(sorted(_BY_GGUF))
        raise ModelFileError(path, f"unsupported architecture '{arch}' (supported: {supported})")
    return _BY_GGUF[arch]
