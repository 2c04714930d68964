"""The element type of a replica's KV pool: what `kv_cache_dtype` names resolve to.

fp16 halves the bytes every decode step reads from the cache (at batch 8 and 512 tokens of
context those reads were half the native step) and doubles the tokens a KV budget holds.
Attention still computes in fp32: fp16 is only how values are stored, and a value is
rounded once, to nearest even, when its K/V is written. `auto` takes fp16 where the hardware
converts it in one instruction (x86 F16C, every CUDA GPU) and fp32 elsewhere, where each
load would pay a software conversion.
"""

from __future__ import annotations

import functools

import torch

from shared.config.engine_defaults import KV_CACHE_DTYPES, KVCacheDtype

_NAMED = {"float32": torch.float32, "float16": torch.float16}


@functools.cache
def _cpu_converts_fp16() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    words = line.split()
                    return "f16c" in words or "fphp" in words  # x86, ARM (asimdhp's scalar twin)
    except OSError:
        pass
    return False


def resolve_kv_dtype(name: KVCacheDtype | str, device: str = "cpu") -> tuple[torch.dtype, str]:
    """The pool's dtype for a configured name, and why (for the startup log)."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}"
        )
    if name != "auto":
        return _NAMED[name], f"kv_cache_dtype {name} (configured)"
    if str(device).startswith("cuda"):
        return torch.float16, "auto: fp16 on a GPU"
    if _cpu_converts_fp16():
        return torch.float16, "auto: fp16, this CPU converts fp16 in hardware (F16C)"
    return torch.float32, "auto: fp32, this CPU has no hardware fp16 conversion"
