"""Choosing pool sizes: the fewest replicas whose simulated replay meets the SLO.

In the simulated fleet a request's first token depends only on the prefill pool (the prompt's
queue, its compute, the KV push) and its inter-token gaps mostly on the decode pool. So the
search is two one-dimensional ones: the smallest prefill count meeting the TTFT targets, then,
with it, the smallest decode count meeting the ITL targets; each gallops (1, 2, 4, ...) to the
first count that passes and bisects back. The pair is then checked as a whole. When no split
within the replica limit meets the SLO, the closest configuration simulated is reported.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from services.planner.replica_profile import ReplicaProfile
from tools.tuner.colocation import Colocation, simulate_colocated
from tools.tuner.fleet import FleetConfig
from tools.tuner.simulator import simulate
from tools.tuner.slo import SLO
from tools.tuner.trace import Trace

Log = Callable[[str], None]


def _stderr(message: str) -> None:
    print(f"[tune] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Evaluation:
    prefill: int
    decode: int
    latency: dict  # percentiles over the SLO's tiers
    violation: float  # max predicted/target over the SLO: <= 1 meets it
    ttft_violation: float
    itl_violation: float
    summary: dict  # the whole replay's figures

    @property
    def replicas(self) -> int:
        return self.prefill + self.decode

    @property
    def ratio(self) -> str:
        return f"{self.prefill}:{self.decode}"

    @property
    def meets(self) -> bool:
        return self.violation <= 1.0


@dataclass
class Evaluator:
    trace: Trace
    profile: ReplicaProfile
    slo: SLO
    fleet: FleetConfig  # router, cache, batch limits; its replica counts are replaced
    priorities: np.ndarray | None = None
    slo_tiers: list[int] | None = None  # None: every request counts
    colocation: Colocation | None = None  # replicas sharing hosts slow each other
    log: Log = _stderr
    cache: dict[tuple[int, int], Evaluation] = field(default_factory=dict)
    requests_simulated: int = 0
    wall_s: float = 0.0

    def __call__(self, prefill: int, decode: int) -> Evaluation:
        key = (prefill, decode)
        if key in self.cache:
            return self.cache[key]
        fleet = replace(self.fleet, prefill_replicas=prefill, decode_replicas=decode)
        progress = self._progress(fleet.ratio)
        if self.colocation is None:
            result = simulate(self.trace, self.profile, fleet, self.priorities, progress)
        else:
            result, _ = simulate_colocated(
                self.trace, self.profile, fleet, self.colocation, self.priorities, progress
            )
        self.requests_simulated += result.requests
        self.wall_s += result.wall_s
        latency = result.latency(self.slo_tiers)
        slo = self.slo
        ev = Evaluation(
            prefill,
            decode,
            latency,
            slo.violation(latency),
            slo.violation(latency, slo.ttft_keys),
            slo.violation(latency, slo.itl_keys),
            result.summary(),
        )
        self.cache[key] = ev
        self.log(
            f"{ev.ratio:>7}: ttft_p99 {_ms(latency['ttft_p99_ms'])}, itl_p99 "
            f"{_ms(latency['itl_p99_ms'])} -> {'meets' if ev.meets else 'misses'} the SLO "
            f"({result.requests} requests in {result.wall_s:.2f} s, "
            f"{result.requests_per_s_simulated:,.0f}/s)"
        )
        return ev

    def _progress(self, ratio: str) -> Callable[[int, int], None]:
        """Within one replay, a line every few seconds (most replays take less than one)."""
        started = time.perf_counter()
        last = [started]

        def report(done: int, total: int) -> None:
            now = time.perf_counter()
            if now - last[0] >= 3.0:
                last[0] = now
                rate = done / (now - started)
                self.log(f"{ratio:>7}: {done:,}/{total:,} requests ({rate:,.0f}/s)")

        return report


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f} ms"


def smallest_passing(passes: Callable[[int], bool], lo: int, hi: int) -> int | None:
    """The smallest n in [lo, hi] with passes(n), assuming passing is monotone in n."""
    if lo > hi:
        return None
    if passes(lo):
        return lo
    failed, step = lo, 1
    while failed < hi:
        probe = min(hi, failed + step)
        if passes(probe):
            while probe - failed > 1:  # failed fails, probe passes
                mid = (failed + probe) // 2
                if passes(mid):
                    probe = mid
                else:
                    failed = mid
            return probe
        failed, step = probe, step * 2
    return None


@dataclass
class TuneResult:
    slo: SLO
    best: Evaluation  # the recommendation, or the closest found when none meets the SLO
    meets_slo: bool
    evaluations: list[Evaluation]
    requests_simulated: int
    sim_wall_s: float
    max_replicas: int
    message: str

    @property
    def requests_per_s_simulated(self) -> float:
        return self.requests_simulated / self.sim_wall_s if self.sim_wall_s > 0 else 0.0


def tune(evaluate: Evaluator, max_replicas: int) -> TuneResult:
    if max_replicas < 2:
        raise ValueError("max_replicas must be at least 2 (one prefill and one decode)")
    slo = evaluate.slo
    prefill = smallest_passing(lambda p: evaluate(p, 1).ttft_violation <= 1.0, 1, max_replicas - 1)
    decode = None
    if prefill is not None:
        decode = smallest_passing(
            lambda d: evaluate(prefill, d).itl_violation <= 1.0, 1, max_replicas - prefill
        )
    if prefill is not None and decode is not None:
        # Joint check, and a step up on whichever side still misses (their coupling is weak).
        best = evaluate(prefill, decode)
        while not best.meets and best.replicas < max_replicas:
            if best.ttft_violation > 1.0:
                best = evaluate(best.prefill + 1, best.decode)
            else:
                best = evaluate(best.prefill, best.decode + 1)
    else:
        # Nothing met the SLO: also try splits of the whole replica budget, then report the
        # configuration that came closest (ties to fewer replicas).
        for p in _spread(max_replicas - 1):
            evaluate(p, max_replicas - p)
        best = min(evaluate.cache.values(), key=lambda e: (e.violation, e.replicas))
    meets = best.meets
    if meets:
        message = (
            f"{best.ratio} ({best.replicas} replicas) is the smallest fleet meeting "
            f"{slo.describe()}"
        )
    else:
        message = (
            f"no prefill:decode split of up to {max_replicas} replicas meets {slo.describe()}; "
            f"the closest found is {best.ratio} at {best.violation:.2f}x the targets"
        )
    evaluations = sorted(evaluate.cache.values(), key=lambda e: (e.replicas, e.prefill))
    return TuneResult(
        slo,
        best,
        meets,
        evaluations,
        evaluate.requests_simulated,
        evaluate.wall_s,
        max_replicas,
        message,
    )


def _spread(limit: int, count: int = 7) -> list[int]:
    """Up to `count` prefill counts spread over 1..limit."""
    if limit <= count:
        return list(range(1, limit + 1))
    return sorted({round(1 + i * (limit - 1) / (count - 1)) for i in range(count)})
