"""Profiles for hardware not at hand: a roofline over the model's FLOPs and bytes per step.

A step takes `step_ms + max(flops / (peak_flops * compute), bytes / (peak_bw * memory))` on
a GPU, whose tensor cores and memory system overlap; on one CPU thread, which issues its loads
and its FMAs itself, the two add up instead. Tensor parallelism splits FLOPs and bytes over
the replica's GPUs and adds two all-reduces of the step's activations per layer. The times
are taken over the same grid a measured profile covers and fitted with the same fits
(`tools.profiler.fit`), so the simulator, the tuner and the planner read an analytic
profile exactly like a measured one; `meta.kind` says which it is, and `meta.analytic` every
figure and factor it rests on.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from services.planner.replica_profile import ReplicaProfile, TransferModel
from tools.profiler.fit import DecodePoint, PrefillPoint, fit_decode, fit_prefill
from tools.profiler.model_shape import ModelShape
from tools.profiler.roofline import (
    Precision,
    StepCost,
    decode_step_cost,
    kv_bytes_per_token,
    prefill_chunk_cost,
)


@dataclass(frozen=True)
class Efficiency:
    """How much of the peaks an engine gets on one path, and what a step costs besides."""

    compute: float  # fraction of peak FLOP/s (MFU)
    memory: float  # fraction of peak bandwidth reading weights (MBU)
    # ... reading and writing KV: a paged gather can cost more per byte than a weight stream
    kv_memory: float
    step_ms: float  # per step: scheduling, launches, sampling
    source: str
    # Fraction of peak FLOP/s attention's own FLOPs get (None: the same as `compute`).
    attention: float | None = None

    def __post_init__(self) -> None:
        if not (self.compute > 0 and self.memory > 0 and self.kv_memory > 0 and self.step_ms >= 0):
            raise ValueError(f"efficiency factors must be positive: {self}")
        if self.attention is not None and not self.attention > 0:
            raise ValueError(f"efficiency factors must be positive: {self}")

    @property
    def attention_compute(self) -> float:
        return self.compute if self.attention is None else self.attention


@dataclass(frozen=True)
class Machine:
    name: str
    device: str  # "cpu" or "gpu"
    flops_per_ms: float  # the whole replica's peak (all its GPUs)
    bytes_per_ms: float
    overlap: bool  # compute and memory time overlap (max) or add up (sum)
    tp: int = 1
    allreduce_bytes_per_ms: float = 0.0  # per GPU, for tensor-parallel all-reduces
    allreduce_latency_ms: float = 0.0


def step_ms(
    machine: Machine, eff: Efficiency, cost: StepCost, tokens: float, layers: int, hidden: int
) -> float:
    dense = cost.flops - cost.attention_flops
    compute = (
        dense / eff.compute + cost.attention_flops / eff.attention_compute
    ) / machine.flops_per_ms
    memory = (cost.weight_bytes / eff.memory + cost.kv_bytes / eff.kv_memory) / machine.bytes_per_ms
    body = max(compute, memory) if machine.overlap else compute + memory
    comm = 0.0
    if machine.tp > 1:
        # Ring all-reduce of the step's activations (bf16), twice per layer.
        payload = tokens * hidden * 2.0 * 2.0 * (machine.tp - 1) / machine.tp
        comm = (
            2 * layers * (payload / machine.allreduce_bytes_per_ms + machine.allreduce_latency_ms)
        )
    return eff.step_ms + body + comm


@dataclass(frozen=True)
class Grid:
    prefill_lengths: tuple[int, ...]
    cached_fractions: tuple[float, ...]
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]


GPU_GRID = Grid(
    prefill_lengths=(256, 1024, 4096, 16384, 32768),
    cached_fractions=(0.0, 0.5, 0.9),
    decode_batches=(1, 8, 32, 64, 128, 256),
    decode_contexts=(512, 2048, 8192),
)


@dataclass(frozen=True)
class AnalyticModel:
    shape: ModelShape
    machine: Machine
    prefill_precision: Precision
    decode_precision: Precision
    prefill_eff: Efficiency
    decode_eff: Efficiency
    chunk_tokens: int

    def chunk_ms(self, tokens: int, offset: int) -> float:
        cost = prefill_chunk_cost(self.shape, self.prefill_precision, tokens, offset)
        return step_ms(
            self.machine,
            self.prefill_eff,
            cost,
            tokens,
            self.shape.num_layers,
            self.shape.hidden_size,
        )

    def prefill_ms(self, tokens: int, cached: int) -> float:
        """A prompt alone, chunk by chunk (the last token is always computed)."""
        offset = min(cached, tokens - 1)
        total = 0.0
        while offset < tokens:
            n = min(self.chunk_tokens, tokens - offset)
            total += self.chunk_ms(n, offset)
            offset += n
        return total

    def decode_ms(self, batch: int, context: int) -> float:
        cost = decode_step_cost(self.shape, self.decode_precision, batch, batch * context)
        return step_ms(
            self.machine,
            self.decode_eff,
            cost,
            batch,
            self.shape.num_layers,
            self.shape.hidden_size,
        )

    def prefill_points(self, grid: Grid, block: int = 16) -> list[PrefillPoint]:
        points = []
        for tokens in grid.prefill_lengths:
            for fraction in grid.cached_fractions:
                cached = min(int(tokens * fraction) // block * block, (tokens - 1) // block * block)
                points.append(PrefillPoint(tokens, cached, self.prefill_ms(tokens, cached)))
        return points

    def decode_points(self, grid: Grid) -> list[DecodePoint]:
        return [
            DecodePoint(b, c, self.decode_ms(b, c))
            for c in grid.decode_contexts
            for b in grid.decode_batches
        ]


def build_profile(
    model: AnalyticModel,
    grid: Grid,
    transfer: TransferModel,
    kv_capacity_tokens: int,
    meta: dict,
    points: tuple[Iterable[PrefillPoint], Iterable[DecodePoint]] | None = None,
) -> ReplicaProfile:
    """The roofline's times over `grid`, fitted into the profile the simulator reads."""
    prefill_points, decode_points = (
        (list(points[0]), list(points[1]))
        if points
        else (model.prefill_points(grid), model.decode_points(grid))
    )
    prefill, prefill_err = fit_prefill(prefill_points, model.chunk_tokens)
    shape = model.shape
    if shape.is_moe:
        decode, decode_err = fit_decode(decode_points, shape.num_experts, shape.experts_per_token)
    else:
        decode, decode_err = fit_decode(decode_points)
    kvpt = kv_bytes_per_token(model.shape, model.decode_precision)
    meta = {
        "kind": "analytic",
        "model": model.shape.name,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "fit_max_rel_error": {"prefill": prefill_err, "decode": decode_err, "transfer": 0.0},
        "analytic": {
            "machine": asdict(model.machine),
            "prefill_efficiency": asdict(model.prefill_eff),
            "decode_efficiency": asdict(model.decode_eff),
            "prefill_precision": asdict(model.prefill_precision),
            "decode_precision": asdict(model.decode_precision),
            "shape": asdict(model.shape),
        },
    } | meta
    profile = ReplicaProfile(
        prefill=prefill,
        decode=decode,
        transfer=transfer,
        chunk_tokens=model.chunk_tokens,
        kv_bytes_per_token=int(round(kvpt)),
        max_context=model.shape.max_position,
        kv_capacity_tokens=kv_capacity_tokens,
        meta=meta,
        measurements={
            "prefill": [asdict(p) for p in prefill_points],
            "decode": [asdict(p) for p in decode_points],
        },
    )
    profile.check()
    return profile
