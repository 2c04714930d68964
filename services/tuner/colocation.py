"""Replicas that share a host slow each other down: prefill and decode replicas on the same
cores (or memory bandwidth) each run slower while the other kind is busy.

Measured on the local stack (`calibrate`: a prompt prefilled while a reply streams ran ~2x
slower, and the reply's steps slowed too), this is the coupling a fleet of separate
accelerators does not have and a CPU host, or GPUs sharing a host's memory bandwidth, does.
It is charged in mean field: each replica's step times are scaled by `1 + u * (s - 1)`,
with `s` its slowdown while the neighbour is busy and `u` the fraction of time the other
kind is busy in the simulation. Busier neighbours slow each other more, which keeps them busy
longer: a few rounds settle the factors.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from services.profiler.costmodel import ReplicaProfile
from services.tuner.fleet import FleetConfig
from services.tuner.results import SimResult
from services.tuner.simulator import ProgressFn, simulate
from services.tuner.trace import Trace
from shared.config.router import RouterConfig

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
        summary = result.summary()
        busy_p, busy_d = summary["prefill_utilization"], summary["decode_utilization"]
        factors = {
            "prefill_factor": 1.0 + busy_d * (colocation.prefill_slowdown - 1.0),
            "decode_factor": 1.0 + busy_p * (colocation.decode_slowdown - 1.0),
        }
    return result, used
