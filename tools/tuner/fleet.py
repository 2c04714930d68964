"""What the simulator is asked to replay a trace on: the fleet, its router, and the tiers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

RouterPolicy = Literal["least_loaded", "round_robin", "prefix_only", "kv_aware"]
ROUTER_POLICIES: tuple[str, ...] = ("least_loaded", "round_robin", "prefix_only", "kv_aware")

# The engine's priorities (smaller runs first), as the coordinator maps service tiers.
TIER_PRIORITY: dict[str, int] = {"priority": 0, "default": 1, "flex": 2, "batch": 3}
TIER_NAMES: tuple[str, ...] = tuple(TIER_PRIORITY)


@dataclass(frozen=True)
class FleetConfig:
    prefill_replicas: int
    decode_replicas: int
    router: RouterPolicy = "least_loaded"
    chunk_tokens: int | None = None  # prefill token budget per step; None: the profile's
    cache_tokens: int | None = None  # prefix cache per prefill replica; None: the profile's KV
    unbounded_cache: bool = False  # the oracle: every prefix ever seen stays cached
    host_cache_tokens: int = 0  # per prefill replica: device evictions spill here
    decode_max_batch: int = 64  # sequences one decode replica runs at once (max_num_seqs)
    handoff_ms: float = 0.0  # first token out -> the sequence may join a decode step
    # Decode replicas hold the profile's `kv_capacity_tokens` of KV (joins wait for room,
    # growth preempts); True lifts the limit (the old model: only decode_max_batch caps).
    unbounded_decode_kv: bool = False

    def __post_init__(self) -> None:
        if self.prefill_replicas < 1 or self.decode_replicas < 1:
            raise ValueError("a fleet needs at least one prefill and one decode replica")
        if self.router not in ROUTER_POLICIES:
            raise ValueError(
                f"unknown router policy {self.router!r}; choose from {', '.join(ROUTER_POLICIES)}"
            )
        if self.decode_max_batch < 1:
            raise ValueError("decode_max_batch must be >= 1")
        if self.chunk_tokens is not None and self.chunk_tokens < 1:
            raise ValueError("chunk_tokens must be >= 1")

    @property
    def replicas(self) -> int:
        return self.prefill_replicas + self.decode_replicas

    @property
    def ratio(self) -> str:
        return f"{self.prefill_replicas}:{self.decode_replicas}"


def parse_tier_mix(text: str) -> dict[str, float]:
    """'priority=0.2,default=0.8' (or a single tier name) -> tier fractions summing to 1."""
    text = text.strip()
    if text in TIER_PRIORITY:
        return {text: 1.0}
    mix: dict[str, float] = {}
    for part in text.split(","):
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or name not in TIER_PRIORITY:
            raise ValueError(
                f"bad tier mix item {part!r}: expected TIER=FRACTION with TIER one of "
                f"{', '.join(TIER_NAMES)}"
            )
        try:
            fraction = float(value)
        except ValueError:
            raise ValueError(f"tier {name}: {value!r} is not a number") from None
        if fraction < 0:
            raise ValueError(f"tier {name}: fraction {fraction} is negative")
        mix[name] = mix.get(name, 0.0) + fraction
    total = sum(mix.values())
    if total <= 0:
        raise ValueError("tier fractions must sum to a positive number")
    return {name: f / total for name, f in mix.items()}


def assign_priorities(n: int, mix: dict[str, float] | None, seed: int = 0) -> np.ndarray:
    """Each request's engine priority, drawn from the tier mix (all `default` without one)."""
    if not mix:
        return np.full(n, TIER_PRIORITY["default"], dtype=np.int64)
    names = list(mix)
    rng = np.random.default_rng(seed)
    picks = rng.choice(len(names), size=n, p=[mix[name] for name in names])
    return np.array([TIER_PRIORITY[name] for name in names], dtype=np.int64)[picks]
