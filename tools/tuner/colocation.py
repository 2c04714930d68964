"""Replicas that share a host slow each other down: prefill and decode replicas on the same
cores (or memory bandwidth) each run slower while the other kind is busy.

Measured on the local stack (`calibrate`: a prompt prefilled while a reply streams ran ~2x
slower, and the reply's steps slowed too), this is the coupling a fleet of separate
accelerators does not have and a CPU host, or GPUs sharing a host's memory bandwidth, does.
Each replica's step times are scaled by `1 + o * (s - 1)`, with `s` its slowdown while the
neighbour is busy and `o` the fraction of *its own* busy time during which the other kind is
busy in the simulation (`busy_overlap`).

Why the overlap and not the neighbour's utilization: the two kinds are not busy
independently. A burst keeps prefill busy, and the same burst's replies keep decode busy
right after; a queue of long prompts keeps prefill busy for the whole time the first replies
stream. Measured on the Mooncake slice, prefill was busy 65% of the time but during nearly
all of decode's, so charging decode 65% of its slowdown made every simulated step too fast
(ITL p50 5-19% under the live one in three runs). Busier neighbours slow each other more,
which keeps them busy longer: a few rounds settle the factors.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from services.planner.replica_profile import ReplicaProfile
from shared.config.router import RouterConfig
from tools.tuner.fleet import FleetConfig
from tools.tuner.results import SimResult
from tools.tuner.simulator import ProgressFn, simulate
from tools.tuner.trace import Trace

ROUNDS = 4


@dataclass(frozen=True)
class Colocation:
    prefill_slowdown: float  # a prefill step with the decode neighbour busy / alone
    decode_slowdown: float  # a decode step with the prefill neighbour busy / alone

    def __post_init__(self) -> None:
        if self.prefill_slowdown < 1.0 or self.decode_slowdown < 1.0:
            raise ValueError("a busy neighbour cannot make a replica faster (slowdowns >= 1)")

    @property
    def none(self) -> bool:
        return self.prefill_slowdown == 1.0 and self.decode_slowdown == 1.0


def simulate_colocated(
    trace: Trace,
    profile: ReplicaProfile,
    fleet: FleetConfig,
    colocation: Colocation,
    priorities: np.ndarray | None = None,
    progress: ProgressFn | None = None,
    router_config: RouterConfig | None = None,
) -> tuple[SimResult, dict[str, float]]:
    """The replay with each replica slowed by its busy neighbours; returns the result and the
    factors it ran with (1.0 and one replay when nothing is shared)."""
    factors = {"prefill_factor": 1.0, "decode_factor": 1.0}
    rounds = 1 if colocation.none else ROUNDS
    for _ in range(rounds):
        slowed = profile.rescaled(
            factors["prefill_factor"], factors["decode_factor"], profile.serving_overhead_ms
        )
        result = simulate(trace, slowed, fleet, priorities, progress, router_config)
        used = factors
        overlap = busy_overlap(result)
        factors = {
            "prefill_factor": 1.0 + overlap["prefill"] * (colocation.prefill_slowdown - 1.0),
            "decode_factor": 1.0 + overlap["decode"] * (colocation.decode_slowdown - 1.0),
        }
    return result, used


def busy_intervals(result: SimResult) -> dict[str, list[np.ndarray]]:
    """Each replica's busy time as disjoint sorted [start, end) rows, read off the requests.

    Both engines are work-conserving, so a replica is busy exactly while it holds unfinished
    work: a prefill replica from a request's arrival (it is routed at once) to its first
    token, a decode replica from the first token (its KV follows within a transfer) to the
    last; a request its decode replica prefilled itself keeps that replica busy from its
    arrival."""
    arrival = result.arrival_ms
    first = arrival + result.ttft_ms
    last = arrival + result.e2e_ms
    out: dict[str, list[np.ndarray]] = {"prefill": [], "decode": []}
    for r in range(result.fleet.prefill_replicas):
        mine = result.prefill_replica == r
        out["prefill"].append(_union(arrival[mine], first[mine]))
    local = result.prefill_replica < 0
    for r in range(result.fleet.decode_replicas):
        mine = (result.decode_replica == r) & (result.output_tokens > 1)
        start = np.where(local, arrival, first)
        out["decode"].append(_union(start[mine], last[mine]))
    return out


def busy_overlap(result: SimResult) -> dict[str, float]:
    """For each kind, the mean over its busy time of the fraction of the other kind's
    replicas that are busy at that moment (0 where a kind was never busy)."""
    intervals = busy_intervals(result)
    return {
        "prefill": _overlap(intervals["prefill"], intervals["decode"]),
        "decode": _overlap(intervals["decode"], intervals["prefill"]),
    }


def _union(start: np.ndarray, end: np.ndarray) -> np.ndarray:
    keep = np.isfinite(start) & np.isfinite(end) & (end > start)
    start, end = start[keep], end[keep]
    if len(start) == 0:
        return np.zeros((0, 2))
    order = np.argsort(start, kind="stable")
    start, end = start[order], np.maximum.accumulate(end[order])
    # A new run starts where an interval begins after every earlier one has ended.
    new = np.ones(len(start), dtype=bool)
    new[1:] = start[1:] > end[:-1]
    first = np.flatnonzero(new)
    last = np.append(first[1:] - 1, len(start) - 1)
    return np.stack([start[first], end[last]], axis=1)


def _overlap(mine: list[np.ndarray], theirs: list[np.ndarray]) -> float:
    if not theirs:
        return 0.0
    # The busy fraction of the other kind is piecewise constant; its running integral is
    # piecewise linear between the event times, so interpolating it there is exact.
    events = np.concatenate([np.concatenate([iv[:, 0], iv[:, 1]]) for iv in theirs])
    steps = np.concatenate([np.concatenate([np.ones(len(iv)), -np.ones(len(iv))]) for iv in theirs])
    if len(events) == 0:
        return 0.0
    order = np.argsort(events, kind="stable")
    times, level = events[order], np.cumsum(steps[order]) / len(theirs)
    integral = np.concatenate([[0.0], np.cumsum(level[:-1] * np.diff(times))])
    busy = 0.0
    shared = 0.0
    for iv in mine:
        if len(iv) == 0:
            continue
        busy += float((iv[:, 1] - iv[:, 0]).sum())
        inside = np.interp(iv[:, 1], times, integral) - np.interp(iv[:, 0], times, integral)
        shared += float(inside.sum())
    return shared / busy if busy > 0 else 0.0
