"""`splitserve profile --analytic --cpu`: the roofline on this machine, its efficiency factors
calibrated against a measured profile of this machine.

The peaks are measured here (one thread's fp32 GEMM rate and streaming-read bandwidth,
`tools.bench.hardware`); the weight bytes per path are those of the formats the measured
profile timed. A measured prompt's time is then fitted as
    ms = gemm_flops / (peak_flops * compute) + attention_flops / (peak_flops * attention)
         + weight_bytes / (peak_bw * memory) + kv_bytes / (peak_bw * kv_memory)
and a decode step's likewise (one thread issues both its loads and its FMAs, so the terms
add), giving each path's factors. Attention's FLOPs (QK^T and PV) have a factor of their own:
they run in other kernels than the weight GEMMs (a gather, scores, a softmax), at a small
fraction of the GEMMs' rate here, so one compute factor for both cannot follow a prompt's
time as it grows quadratically with length. There is no separate per-step constant: every step
reads the weights once, so it would be the weight term under another name; the KV has its
own factor because the engine's paged attention gathers blocks (a copy) before reading them.
How well that holds is measured by leaving each point out of the fit in turn and predicting
it: `analytic_vs_measured_error`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from services.planner.replica_profile import ProfileError, ReplicaProfile
from tools.profiler.analytic import AnalyticModel, Efficiency, Grid, Machine, build_profile
from tools.profiler.fit import DecodePoint, PrefillPoint, nnls
from tools.profiler.model_shape import ModelShape
from tools.profiler.roofline import Precision, decode_step_cost, prefill_chunk_cost

# Bytes per weight each engine format reads (Q4_1 blocks: 20 bytes per 32 weights).
FORMAT_BYTES: dict[str, float] = {
    "fp32": 4.0,
    "bf16": 2.0,
    "int8": 1.0,
    "int4": 0.625,
    "native": 0.625,
    "native-a8": 0.625,
}
UNNEEDED = 1e6  # a factor whose term the fit dropped: that resource never bounds the step


@dataclass(frozen=True)
class CpuPeaks:
    gflops: float
    gb_s: float
    threads: int


def measure_peaks(threads: int = 1) -> CpuPeaks:
    import torch

    from tools.bench.hardware import measure_matmul_gflops, measure_read_bandwidth_gb_s

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return CpuPeaks(measure_matmul_gflops(), measure_read_bandwidth_gb_s(1 << 28), threads)
    finally:
        torch.set_num_threads(previous)


def path_formats(weights: str) -> tuple[str, str]:
    """(prefill, decode) formats from a signature's weights: 'bf16' or 'auto: prefill=X
    decode=Y'."""
    if weights.startswith("auto:"):
        parts = dict(p.split("=", 1) for p in weights.removeprefix("auto:").split())
        return parts["prefill"], parts["decode"]
    return weights, weights


def _machine(peaks: CpuPeaks) -> Machine:
    return Machine(
        name=f"this CPU ({peaks.threads} thread{'s' * (peaks.threads != 1)})",
        device="cpu",
        flops_per_ms=peaks.gflops * 1e6,
        bytes_per_ms=peaks.gb_s * 1e6,
        overlap=False,
    )


def _prefill_features(
    shape: ModelShape, precision: Precision, machine: Machine, point: PrefillPoint, chunk: int
) -> tuple[float, ...]:
    offset = min(point.cached, point.tokens - 1)
    dense, attention, weights, kv = 0.0, 0.0, 0.0, 0.0
    while offset < point.tokens:
        n = min(chunk, point.tokens - offset)
        cost = prefill_chunk_cost(shape, precision, n, offset)
        dense += cost.flops - cost.attention_flops
        attention += cost.attention_flops
        weights, kv = weights + cost.weight_bytes, kv + cost.kv_bytes
        offset += n
    return _scaled(machine, dense, attention, weights, kv)


def _scaled(
    machine: Machine, dense: float, attention: float, weights: float, kv: float
) -> tuple[float, ...]:
    """Each resource's time at its peak: the fit's coefficients are 1 / efficiency."""
    peak, peak_bw = machine.flops_per_ms, machine.bytes_per_ms
    return dense / peak, attention / peak, weights / peak_bw, kv / peak_bw


def _decode_features(
    shape: ModelShape, precision: Precision, machine: Machine, point: DecodePoint
) -> tuple[float, ...]:
    cost = decode_step_cost(shape, precision, point.batch, point.batch * point.context)
    dense = cost.flops - cost.attention_flops
    return _scaled(machine, dense, cost.attention_flops, cost.weight_bytes, cost.kv_bytes)


def _efficiency(coef: np.ndarray, source: str) -> Efficiency:
    compute, attention, memory, kv = (1.0 / float(c) if c > 0 else UNNEEDED for c in coef)
    return Efficiency(compute, memory, kv, 0.0, source, attention=attention)


def _loo_errors(features: np.ndarray, target: np.ndarray) -> list[float]:
    """Each point predicted by the fit to all the others: relative errors."""
    errors = []
    for i in range(len(target)):
        keep = np.arange(len(target)) != i
        coef = nnls(features[keep], target[keep])
        errors.append(float(abs(features[i] @ coef - target[i]) / target[i]))
    return errors


@dataclass(frozen=True)
class Calibration:
    prefill: Efficiency
    decode: Efficiency
    prefill_errors: list[float]  # leave-one-out, per measured point
    decode_errors: list[float]

    @property
    def error(self) -> float:
        """The headline: the worse path's mean leave-one-out relative error."""
        return max(float(np.mean(self.prefill_errors)), float(np.mean(self.decode_errors)))

    def report(self) -> dict:
        return {
            "analytic_vs_measured_error": self.error,
            "prefill_mean_error": float(np.mean(self.prefill_errors)),
            "prefill_max_error": float(np.max(self.prefill_errors)),
            "decode_mean_error": float(np.mean(self.decode_errors)),
            "decode_max_error": float(np.max(self.decode_errors)),
            "points": {"prefill": len(self.prefill_errors), "decode": len(self.decode_errors)},
            "prefill_efficiency": asdict(self.prefill),
            "decode_efficiency": asdict(self.decode),
            "method": "each measured point predicted by the analytic model calibrated on the "
            "others (leave-one-out); mean relative error of the worse path",
        }


def _precisions(shape: ModelShape, measured: ReplicaProfile) -> tuple[Precision, Precision]:
    signature = measured.meta.get("signature")
    weights = signature["weights"] if signature else measured.meta.get("weights", "bf16")
    prefill_fmt, decode_fmt = path_formats(str(weights))
    elements = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim
    kv = measured.kv_bytes_per_token / elements  # the engine's KV element size
    try:
        return Precision(FORMAT_BYTES[prefill_fmt], kv), Precision(FORMAT_BYTES[decode_fmt], kv)
    except KeyError as exc:
        raise ProfileError(
            f"unknown weight format {exc.args[0]!r} in the measured profile"
        ) from None


def calibrate(shape: ModelShape, measured: ReplicaProfile, peaks: CpuPeaks) -> Calibration:
    raw = measured.measurements
    if not raw.get("prefill") or not raw.get("decode"):
        raise ProfileError("the measured profile keeps no raw points to calibrate against")
    prefill_points = [PrefillPoint(**p) for p in raw["prefill"]]
    decode_points = [DecodePoint(**p) for p in raw["decode"]]
    machine = _machine(peaks)
    pre_prec, dec_prec = _precisions(shape, measured)
    chunk = measured.chunk_tokens
    pf = np.array([_prefill_features(shape, pre_prec, machine, p, chunk) for p in prefill_points])
    pt = np.array([p.ms for p in prefill_points])
    df = np.array([_decode_features(shape, dec_prec, machine, p) for p in decode_points])
    dt = np.array([p.ms for p in decode_points])
    source = f"calibrated on {len(pt)} prefill and {len(dt)} decode points measured here"
    return Calibration(
        _efficiency(nnls(pf, pt), source),
        _efficiency(nnls(df, dt), source),
        _loo_errors(pf, pt),
        _loo_errors(df, dt),
    )


def cpu_profile(
    shape: ModelShape, measured: ReplicaProfile, peaks: CpuPeaks
) -> tuple[ReplicaProfile, Calibration]:
    """The calibrated roofline's profile of this machine, over the measured profile's grid."""
    calibration = calibrate(shape, measured, peaks)
    pre_prec, dec_prec = _precisions(shape, measured)
    model = AnalyticModel(
        shape,
        _machine(peaks),
        pre_prec,
        dec_prec,
        calibration.prefill,
        calibration.decode,
        measured.chunk_tokens,
    )
    raw = measured.measurements
    grid = Grid(
        prefill_lengths=tuple(sorted({p["tokens"] for p in raw["prefill"]})),
        cached_fractions=(0.0, 0.5, 0.9),
        decode_batches=tuple(sorted({p["batch"] for p in raw["decode"]})),
        decode_contexts=tuple(sorted({p["context"] for p in raw["decode"]})),
    )
    meta = {
        "signature": measured.meta.get("signature"),
        "weights": measured.meta.get("weights"),
        "calibration": calibration.report(),
        "peaks": asdict(peaks),
    }
    profile = build_profile(model, grid, measured.transfer, measured.kv_capacity_tokens, meta)
    return profile, calibration
