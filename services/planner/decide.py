"""The planner's decision: replica counts for one model's two pools from a window of samples.

Pure: the same samples, counts and policy always give the same decision, so it is tested on
recorded series. Sizing is by throughput against measured per-replica capacity at a target
utilization (forecast load, never less than the current level), then nudged by the latency
SLOs: a pool whose p99 is over target gains a replica and is not shrunk. Scale-downs go one
step at a time; bounds are applied last and always.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from services.planner.forecast import Forecast, holt_forecast
from services.planner.metrics import MetricSample, counter_delta, window_quantile

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class PoolSizes:
    prefill: int
    decode: int

    def get(self, role: str) -> int:
        return self.prefill if role == "prefill" else self.decode


@dataclass(frozen=True)
class Policy:
    min_prefill: int = 1
    max_prefill: int = 8
    min_decode: int = 1
    max_decode: int = 16
    # Per-replica capacity, measured (`splitserve profile`) on the serving hardware.
    prefill_tokens_per_s: float = 4000.0
    decode_tokens_per_s: float = 600.0
    decode_seqs: int = 32
    target_utilization: float = 0.7
    window_s: float = 300.0
    horizon_s: float = 60.0
    ttft_p99_s: float | None = 1.0
    itl_p99_s: float | None = 0.1
    # Fewer observations than this in the window say nothing reliable about a p99.
    min_slo_observations: int = 20
    max_step_down: int = 1
    alpha: float = 0.5
    beta: float = 0.3

    def __post_init__(self) -> None:
        for role in ROLES:
            lo, hi = self.bounds(role)
            if lo < 1:
                raise ValueError(f"min_{role} must be at least 1 (a model needs both pools)")
            if lo > hi:
                raise ValueError(f"min_{role} ({lo}) exceeds max_{role} ({hi})")
        if not 0 < self.target_utilization <= 1:
            raise ValueError("target_utilization must be in (0, 1]")
        if min(self.prefill_tokens_per_s, self.decode_tokens_per_s, self.decode_seqs) <= 0:
            raise ValueError("per-replica capacities must be positive")
        if self.max_step_down < 1:
            raise ValueError("max_step_down must be at least 1")

    def bounds(self, role: str) -> tuple[int, int]:
        if role == "prefill":
            return self.min_prefill, self.max_prefill
        return self.min_decode, self.max_decode

    def clamp(self, role: str, n: int) -> int:
        lo, hi = self.bounds(role)
        return max(lo, min(hi, n))


@dataclass(frozen=True)
class Decision:
    prefill: int
    decode: int
    reason: str
    signals: dict[str, float | None] = field(default_factory=dict, compare=False)

    @property
    def sizes(self) -> PoolSizes:
        return PoolSizes(self.prefill, self.decode)


@dataclass(frozen=True)
class _Load:
    prefill_tps: Forecast
    decode_tps: Forecast
    in_flight: Forecast
    ttft_p99_s: float | None
    itl_p99_s: float | None


def decide(series: Sequence[MetricSample], current: PoolSizes, policy: Policy) -> Decision:
    window = _window(series, policy.window_s)
    if len(window) < 2:
        return _hold(current, policy, f"{len(window)} sample(s) in the window, need 2")
    load = _load(window, policy)
    if load is None:
        return _hold(current, policy, "no time passed between the window's samples")
    per_prefill = policy.prefill_tokens_per_s * policy.target_utilization
    per_decode_tps = policy.decode_tokens_per_s * policy.target_utilization
    per_decode_seqs = policy.decode_seqs * policy.target_utilization
    need = {
        "prefill": _replicas(_demand(load.prefill_tps), per_prefill),
        "decode": max(
            _replicas(_demand(load.decode_tps), per_decode_tps),
            _replicas(_demand(load.in_flight), per_decode_seqs),
        ),
    }
    slo_breach = {
        "prefill": _over(load.ttft_p99_s, policy.ttft_p99_s),
        "decode": _over(load.itl_p99_s, policy.itl_p99_s),
    }
    sizes, notes = {}, []
    for role in ROLES:
        cur, want = current.get(role), need[role]
        why = f"load needs {want}"
        if slo_breach[role]:
            want = max(want, cur + 1)
            why = (
                f"p99 {'TTFT' if role == 'prefill' else 'ITL'} over target, load needs {need[role]}"
            )
        elif want < cur:
            want = max(want, cur - policy.max_step_down)
        final = policy.clamp(role, want)
        if final != want:
            why += f", bounded to [{policy.bounds(role)[0]}, {policy.bounds(role)[1]}]"
        sizes[role] = final
        notes.append(f"{role} {_move(cur, final)} ({why})")
    signals = {
        "prefill_tokens_per_s": load.prefill_tps.level,
        "prefill_tokens_per_s_forecast": load.prefill_tps.predicted,
        "decode_tokens_per_s": load.decode_tps.level,
        "decode_tokens_per_s_forecast": load.decode_tps.predicted,
        "in_flight": load.in_flight.level,
        "in_flight_forecast": load.in_flight.predicted,
        "ttft_p99_s": load.ttft_p99_s,
        "itl_p99_s": load.itl_p99_s,
    }
    return Decision(sizes["prefill"], sizes["decode"], "; ".join(notes), signals)


def _window(series: Sequence[MetricSample], window_s: float) -> list[MetricSample]:
    ordered = sorted(series, key=lambda s: s.t)
    if not ordered:
        return []
    start = ordered[-1].t - window_s
    return [s for s in ordered if s.t >= start]


def _load(window: list[MetricSample], policy: Policy) -> _Load | None:
    prefill, decode, in_flight = [], [], []
    for a, b in zip(window, window[1:], strict=False):
        dt = b.t - a.t
        if dt <= 0:
            continue
        computed = counter_delta(a.prompt_tokens, b.prompt_tokens) - counter_delta(
            a.cached_tokens, b.cached_tokens
        )
        prefill.append((b.t, max(0.0, computed) / dt))
        decode.append((b.t, counter_delta(a.completion_tokens, b.completion_tokens) / dt))
        in_flight.append((b.t, counter_delta(a.e2e_seconds, b.e2e_seconds) / dt))
    if not prefill:
        return None

    def smooth(points: list[tuple[float, float]]) -> Forecast:
        return holt_forecast(points, policy.horizon_s, policy.alpha, policy.beta)

    first, last = window[0], window[-1]
    return _Load(
        prefill_tps=smooth(prefill),
        decode_tps=smooth(decode),
        in_flight=smooth(in_flight),
        ttft_p99_s=_p99(first.ttft_buckets, last.ttft_buckets, policy.min_slo_observations),
        itl_p99_s=_p99(first.itl_buckets, last.itl_buckets, policy.min_slo_observations),
    )


def _p99(first, last, min_observations: int) -> float | None:
    if not last:
        return None
    observed = counter_delta(first[-1][1] if first else 0.0, last[-1][1])
    if observed < min_observations:
        return None
    return window_quantile(first, last, 0.99)


def _demand(f: Forecast) -> float:
    # Scale up ahead of a rising forecast; never scale down ahead of a falling one.
    return max(f.level, f.predicted)


def _replicas(demand: float, per_replica: float) -> int:
    # The epsilon keeps 2.0000000001 replicas' worth of float noise from buying a third.
    return max(0, math.ceil(demand / per_replica - 1e-9))


def _over(observed: float | None, target: float | None) -> bool:
    return observed is not None and target is not None and observed > target


def _move(before: int, after: int) -> str:
    return f"{before} held" if before == after else f"{before}->{after}"


def _hold(current: PoolSizes, policy: Policy, why: str) -> Decision:
    prefill = policy.clamp("prefill", current.prefill)
    decode = policy.clamp("decode", current.decode)
    if (prefill, decode) == (current.prefill, current.decode):
        return Decision(prefill, decode, f"holding: {why}")
    return Decision(
        prefill,
        decode,
        f"holding within bounds: {why}; prefill {_move(current.prefill, prefill)}, "
        f"decode {_move(current.decode, decode)}",
    )
