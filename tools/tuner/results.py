"""What one simulated replay produced: per-request latencies and the fleet's busy time."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from tools.tuner.fleet import TIER_NAMES, FleetConfig


def weighted_percentile(values: np.ndarray, weights: np.ndarray, q: float) -> float | None:
    """The value below which a fraction q of the total weight lies (None if no weight)."""
    keep = weights > 0
    values, weights = values[keep], weights[keep]
    if len(values) == 0:
        return None
    order = np.argsort(values, kind="stable")
    cumulative = np.cumsum(weights[order])
    index = int(np.searchsorted(cumulative, q * cumulative[-1], side="left"))
    return float(values[order][min(index, len(values) - 1)])


def _pct(values: np.ndarray, q: float) -> float | None:
    return float(np.percentile(values, q * 100)) if len(values) else None


@dataclass
class SimResult:
    fleet: FleetConfig
    arrival_ms: np.ndarray
    ttft_ms: np.ndarray  # first token out - arrival
    e2e_ms: np.ndarray  # last token out - arrival
    input_tokens: np.ndarray
    cached_tokens: np.ndarray
    output_tokens: np.ndarray
    priority: np.ndarray
    prefill_replica: np.ndarray  # which replica prefilled each request (-1: its decode replica)
    decode_replica: np.ndarray
    itl_ms: np.ndarray  # inter-token gaps ...
    itl_weight: np.ndarray  # ... each standing for this many tokens
    itl_priority: np.ndarray
    prefill_busy_ms: list[float]
    decode_busy_ms: list[float]
    decode_tokens: list[int]
    decode_steps: list[int]
    wall_s: float
    decode_preemptions: int = 0  # sequences whose KV a full decode replica freed
    local_prefills: int = 0  # requests a decode replica prefilled itself (no transfer)

    @property
    def requests(self) -> int:
        return len(self.ttft_ms)

    @property
    def completed(self) -> int:
        return int(np.count_nonzero(np.isfinite(self.e2e_ms)))

    @property
    def requests_per_s_simulated(self) -> float:
        return self.requests / self.wall_s if self.wall_s > 0 else float("inf")

    def latency(self, tiers: Iterable[int] | None = None) -> dict[str, float | None]:
        """TTFT percentiles over requests and ITL percentiles over tokens, for some tiers."""
        if tiers is None:
            ttft, itl, weight = self.ttft_ms, self.itl_ms, self.itl_weight
        else:
            tiers = list(tiers)
            ttft = self.ttft_ms[np.isin(self.priority, tiers)]
            keep = np.isin(self.itl_priority, tiers)
            itl, weight = self.itl_ms[keep], self.itl_weight[keep]
        return {
            "ttft_p50_ms": _pct(ttft, 0.5),
            "ttft_p90_ms": _pct(ttft, 0.9),
            "ttft_p99_ms": _pct(ttft, 0.99),
            "itl_p50_ms": weighted_percentile(itl, weight, 0.5),
            "itl_p90_ms": weighted_percentile(itl, weight, 0.9),
            "itl_p99_ms": weighted_percentile(itl, weight, 0.99),
            "itl_mean_ms": float(np.average(itl, weights=weight)) if weight.sum() else None,
        }

    def summary(self) -> dict:
        busy = np.asarray(self.prefill_busy_ms)
        dbusy = np.asarray(self.decode_busy_ms)
        span = float(np.nanmax(self.arrival_ms + self.e2e_ms)) if self.requests else 0.0
        out = {
            "ratio": self.fleet.ratio,
            "prefill_replicas": self.fleet.prefill_replicas,
            "decode_replicas": self.fleet.decode_replicas,
            "router": self.fleet.router,
            "requests": self.requests,
            "completed": self.completed,
            **self.latency(),
            "e2e_p50_ms": _pct(self.e2e_ms, 0.5),
            "prefix_hit_rate": float(self.cached_tokens.sum() / max(1, self.input_tokens.sum())),
            "prefill_utilization": float(busy.mean() / span) if span else 0.0,
            "decode_utilization": float(dbusy.mean() / span) if span else 0.0,
            "prefill_imbalance": float(busy.max() / busy.mean()) if busy.mean() > 0 else 1.0,
            "mean_decode_batch": sum(self.decode_tokens) / max(1, sum(self.decode_steps)),
            "decode_preemptions": self.decode_preemptions,
            "local_prefills": self.local_prefills,
            "sim_wall_s": self.wall_s,
            "requests_per_s_simulated": self.requests_per_s_simulated,
        }
        present = sorted(set(self.priority.tolist()))
        if len(present) > 1:
            out["per_tier"] = {TIER_NAMES[p]: self.latency([p]) for p in present}
        return out
