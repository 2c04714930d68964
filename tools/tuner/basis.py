"""What a recommendation rests on: the profile's kind and hardware, whether that matches the
hardware it is used for, and what the fleet it recommends costs at a stated price."""

from __future__ import annotations

import sys

from services.planner.replica_profile import ReplicaProfile
from tools.profiler.hardware_specs import GPU_HOUR_PRICES
from tools.profiler.signature import machine_here, mismatch_report, named_gpu
from tools.tuner.trace import Trace


def profile_basis(profile: ReplicaProfile, fleet_hardware: str | None) -> dict:
    """The profile's kind and signature checked against the named fleet hardware (a GPU key),
    or against this machine when none is named; warnings go to stderr as well."""
    meta = profile.meta
    if fleet_hardware:
        other = named_gpu(fleet_hardware, int(meta.get("gpus_per_replica", 1)))
        against = f"the fleet's {fleet_hardware}"
    else:
        other = machine_here(int(meta.get("threads", 1)))
        against = "this machine"
    check = mismatch_report(meta, other, against, hardware_only=True)
    for warning in check["warnings"]:
        print(f"[tune] WARNING: {warning}", file=sys.stderr)
    kind = meta.get("kind", "measured")
    what = check["profile_signature"] or "an unrecorded machine"
    return {
        "kind": kind,
        "description": f"{kind} profile of {what}",
        "check": check,
    }


def fleet_cost(
    trace: Trace, profile: ReplicaProfile, replicas: int, usd_per_gpu_hour: float | None
) -> dict | None:
    """Cost per million tokens of serving `trace` on `replicas` replicas, each of the
    profile's `gpus_per_replica` (1 for a CPU replica: the price is then per replica-hour).
    None without a price: the shipped table has only some GPUs, and no CPU."""
    gpu = profile.meta.get("gpu")
    source = "--gpu-hour-usd"
    if usd_per_gpu_hour is None:
        if gpu not in GPU_HOUR_PRICES:
            return None
        usd_per_gpu_hour = GPU_HOUR_PRICES[gpu].usd_per_gpu_hour
        source = GPU_HOUR_PRICES[gpu].source
    units = replicas * int(profile.meta.get("gpus_per_replica", 1))
    usd_per_hour = units * usd_per_gpu_hour
    hours = trace.duration_s / 3600.0
    prompt = float(trace.input_tokens.sum())
    output = float(trace.output_tokens.sum())
    if hours <= 0 or output + prompt <= 0:
        return None
    spent = usd_per_hour * hours
    return {
        "usd_per_gpu_hour": usd_per_gpu_hour,
        "price_source": source,
        "gpus": units,
        "usd_per_hour": usd_per_hour,
        "usd_per_million_tokens": spent / (prompt + output) * 1e6,
        "usd_per_million_output_tokens": spent / output * 1e6 if output else None,
        "note": "the fleet's cost over the trace's duration at the trace's rate, per token "
        "served (prompt + output), and per output token",
    }
