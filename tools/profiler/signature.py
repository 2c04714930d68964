"""Which machine and model a profile describes, and how that differs from another.

A profile's step times hold for the hardware it was measured on (or, for an analytic profile,
the hardware it was derived for), the weight format it ran and the model it timed. The
signature records those; whoever uses a profile (`splitserve tune`, `bench tune`, the planner)
compares it with where it runs, or with the hardware the user says the fleet has, and says so
when they differ. The CPU's identity is the one the native kernel build and the weight-format
chooser already key their caches on (`kernels.native.build.cpu_signature`).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import asdict, dataclass
from typing import Literal

from kernels.native.build import cpu_signature
from tools.profiler.model_shape import ModelShape

Device = Literal["cpu", "gpu"]
# Flags that decide a CPU path's speed here (bf16/int8 dot products, vector width): named when
# two signatures differ in them, so the difference says what it means.
TELLING_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512_bf16",
    "avx512_vnni",
    "avx_vnni",
    "amx_bf16",
    "amx_int8",
)


@dataclass(frozen=True)
class HardwareSignature:
    device: Device
    processor: str  # CPU model name, or the GPU's name
    flags: str  # a CPU's instruction-set flags, sorted; "" for a GPU
    cores: int  # CPU cores the process can use, or GPUs per replica (tensor parallel)
    threads: int  # torch threads a replica runs with (1 per GPU for a GPU replica)
    weights: str  # the weight format(s) timed, e.g. "bf16" or "auto: prefill=fp32 decode=native"
    model: str
    config_hash: str
    kv_dtype: str = ""  # the KV cache's element type ("" where not recorded)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict) -> HardwareSignature:
        optional = {"kv_dtype": ""}
        return cls(**{k: raw[k] if k in raw else optional[k] for k in cls.__dataclass_fields__})

    @property
    def flags_digest(self) -> str:
        return hashlib.sha256(self.flags.encode()).hexdigest()[:12] if self.flags else ""

    def describe(self) -> str:
        where = self.processor
        if self.device == "cpu":
            telling = [f for f in TELLING_FLAGS if f in self.flags.split()]
            where += f" ({', '.join(telling) or 'no AVX2'}), {self.cores} cores, "
            where += f"{self.threads} thread{'s' * (self.threads != 1)}"
        elif self.cores > 1:
            where += f" x{self.cores} (tensor parallel)"
        if not self.model:  # a machine, not a profile: nothing was timed on it
            return where
        kv = f", KV {self.kv_dtype}" if self.kv_dtype else ""
        return f"{where}; {self.model} [{self.config_hash}] in {self.weights}{kv}"


def cpu_here(
    threads: int, weights: str, shape: ModelShape, kv_dtype: str = ""
) -> HardwareSignature:
    """This machine as a CPU replica sees it."""
    _, model, flags = cpu_signature().split("|", 2)
    return HardwareSignature(
        device="cpu",
        processor=model or "unknown CPU",
        flags=flags,
        cores=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        threads=threads,
        weights=weights,
        model=shape.name,
        config_hash=shape.config_hash,
        kv_dtype=kv_dtype,
    )


def gpu_here() -> str | None:
    """The name of this machine's first GPU, if torch sees one."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:  # a broken driver is "no GPU" for this purpose
        return None
    return None


def machine_here(threads: int) -> HardwareSignature:
    """This machine's hardware, for comparisons that do not involve a model: its GPU if torch
    sees one, else its CPU."""
    from tools.profiler.model_shape import ModelShape

    nothing = ModelShape("", 1, 1, 1, 1, 1, 1, 1, 2, True)
    gpu = gpu_here()
    if gpu is not None:
        return HardwareSignature("gpu", gpu, "", 1, 1, "", "", "")
    return cpu_here(threads, "", nothing)


def named_gpu(key: str, tp: int = 1) -> HardwareSignature:
    """The hardware a user says the fleet runs on (a key of `hardware_specs.GPUS`)."""
    from tools.profiler.hardware_specs import GPUS

    if key not in GPUS:
        raise ValueError(f"unknown GPU {key!r}; known: {', '.join(GPUS)}")
    return HardwareSignature("gpu", GPUS[key].name, "", tp, 1, "", "", "")


def _same_hardware(a: HardwareSignature, b: HardwareSignature) -> bool:
    if a.device != b.device:
        return False
    if a.device == "gpu":  # torch's device names and the datasheets' differ in suffixes
        from tools.profiler.hardware_specs import gpu_key_for_name

        key = gpu_key_for_name(a.processor)
        return key is not None and key == gpu_key_for_name(b.processor)
    return a.processor == b.processor


@dataclass(frozen=True)
class Difference:
    field: str
    profile: str
    other: str

    def describe(self) -> str:
        return f"{self.field} {self.profile!r} vs {self.other!r}"


def differences(
    profile: HardwareSignature, other: HardwareSignature, hardware_only: bool = False
) -> list[Difference]:
    """What differs between a profile's signature and another (this machine, or the fleet the
    user named). `hardware_only`: the other side says nothing about model and weights."""
    out = []
    if not _same_hardware(profile, other):
        out.append(
            Difference("hardware", f"{profile.device}: {profile.processor}", other.processor)
        )
    if profile.device == other.device == "cpu":
        mine, theirs = set(profile.flags.split()), set(other.flags.split())
        if mine != theirs:
            missing = sorted(f for f in mine - theirs if f in TELLING_FLAGS)
            extra = sorted(f for f in theirs - mine if f in TELLING_FLAGS)
            note = f"{len(mine ^ theirs)} flags differ"
            if missing:
                note += f"; missing here: {', '.join(missing)}"
            if extra:
                note += f"; only here: {', '.join(extra)}"
            out.append(Difference("cpu flags", profile.flags_digest, note))
    fields = ["cores"] if profile.device == other.device else []
    if not hardware_only:
        fields += ["threads", "weights", "kv_dtype", "config_hash"]
    for name in fields:
        mine_v, theirs_v = getattr(profile, name), getattr(other, name)
        if mine_v != theirs_v:
            out.append(Difference(name, str(mine_v), str(theirs_v)))
    return out


def mismatch_report(
    profile_meta: dict, other: HardwareSignature | None, against: str, hardware_only: bool = False
) -> dict:
    """What a command says about the profile it runs on: `matches`, and `warnings` to print.

    `against` names the other side ("this machine", "the fleet's h200"). A profile without a
    signature (measured before profiles recorded one) is reported as of an unknown machine."""
    raw = profile_meta.get("signature")
    try:
        mine = HardwareSignature.from_dict(raw) if isinstance(raw, dict) else None
    except (KeyError, TypeError):
        mine = None  # written by hand or by another version: as good as none
    if mine is None:
        return {
            "matches": False,
            "profile_signature": None,
            "against": against,
            "warnings": [
                f"the profile records no hardware signature: it may come from another machine "
                f"than {against}; measure one with `splitserve profile` there"
            ],
        }
    report: dict = {
        "matches": True,
        "profile_signature": mine.describe(),
        "against": against,
        "warnings": [],
    }
    if other is None:
        return report
    diffs = differences(mine, other, hardware_only)
    report["other_signature"] = other.describe()
    if diffs:
        report["matches"] = False
        kind = profile_meta.get("kind", "measured")
        report["warnings"] = [
            f"the {kind} profile is for {mine.describe()}, not {against} "
            f"({other.describe()}): " + "; ".join(d.describe() for d in diffs)
        ]
        report["differences"] = [asdict(d) for d in diffs]
    return report
