"""The coordinator's Prometheus counters, reduced to what sizing the pools needs.

One scrape becomes one `MetricSample` of cumulative values for one model (summed over tiers,
endpoints and outcomes). Rates come later, from differences between samples, so a scrape
that fails only leaves a wider gap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

# Metric names as services/coordinator/api/metrics.py registers them (the parser reports
# counters without their _total suffix).
REQUESTS = "splitserve_requests"
PROMPT_TOKENS = "splitserve_prompt_tokens"
CACHED_TOKENS = "splitserve_cached_prompt_tokens"
COMPLETION_TOKENS = "splitserve_completion_tokens"
TTFT = "splitserve_time_to_first_token_seconds"
ITL = "splitserve_inter_token_latency_seconds"
E2E = "splitserve_e2e_request_latency_seconds"

Buckets = tuple[tuple[float, float], ...]  # (upper bound, cumulative count), ascending


@dataclass(frozen=True)
class MetricSample:
    """Cumulative counters of one model at time `t` (seconds, any monotonic origin)."""

    t: float
    requests: float = 0.0
    prompt_tokens: float = 0.0
    cached_tokens: float = 0.0
    completion_tokens: float = 0.0
    # Sum of request durations: its rate is the mean number of requests in flight
    # (Little's law), which is what occupies decode slots.
    e2e_seconds: float = 0.0
    ttft_buckets: Buckets = field(default_factory=tuple)
    itl_buckets: Buckets = field(default_factory=tuple)

    @property
    def computed_prompt_tokens(self) -> float:
        """Prompt tokens prefill had to compute (prefix-cache hits cost nothing)."""
        return self.prompt_tokens - self.cached_tokens

    def to_json(self) -> dict:
        return {
            "t": self.t,
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "e2e_seconds": self.e2e_seconds,
            "ttft_buckets": [[_bound_json(le), n] for le, n in self.ttft_buckets],
            "itl_buckets": [[_bound_json(le), n] for le, n in self.itl_buckets],
        }

    @classmethod
    def from_json(cls, raw: dict) -> MetricSample:
        return cls(
            t=float(raw["t"]),
            requests=float(raw.get("requests", 0.0)),
            prompt_tokens=float(raw.get("prompt_tokens", 0.0)),
            cached_tokens=float(raw.get("cached_tokens", 0.0)),
            completion_tokens=float(raw.get("completion_tokens", 0.0)),
            e2e_seconds=float(raw.get("e2e_seconds", 0.0)),
            ttft_buckets=tuple((float(le), float(n)) for le, n in raw.get("ttft_buckets", ())),
            itl_buckets=tuple((float(le), float(n)) for le, n in raw.get("itl_buckets", ())),
        )


def _bound_json(le: float) -> float | str:
    return "+Inf" if math.isinf(le) else le


def parse_metrics(text: str, t: float, model: str | None = None) -> MetricSample:
    """One scrape of /metrics as a sample; `model` None sums over every model."""
    counters: dict[str, float] = {}
    buckets: dict[str, dict[float, float]] = {TTFT: {}, ITL: {}}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if model is not None and s.labels.get("model") != model:
                continue
            if s.name.endswith("_total"):
                name = s.name.removesuffix("_total")
                counters[name] = counters.get(name, 0.0) + s.value
            elif s.name == f"{E2E}_sum":
                counters[E2E] = counters.get(E2E, 0.0) + s.value
            elif s.name.endswith("_bucket") and family.name in buckets:
                le = float(s.labels["le"])
                per_le = buckets[family.name]
                per_le[le] = per_le.get(le, 0.0) + s.value
    return MetricSample(
        t=t,
        requests=counters.get(REQUESTS, 0.0),
        prompt_tokens=counters.get(PROMPT_TOKENS, 0.0),
        cached_tokens=counters.get(CACHED_TOKENS, 0.0),
        completion_tokens=counters.get(COMPLETION_TOKENS, 0.0),
        e2e_seconds=counters.get(E2E, 0.0),
        ttft_buckets=tuple(sorted(buckets[TTFT].items())),
        itl_buckets=tuple(sorted(buckets[ITL].items())),
    )


def counter_delta(before: float, after: float) -> float:
    """Increase of a counter; a drop means the coordinator restarted and began again at 0."""
    return after - before if after >= before else after


def window_quantile(first: Buckets, last: Buckets, q: float) -> float | None:
    """The q-quantile of what was observed between two cumulative histograms, interpolated
    inside its bucket (as PromQL's histogram_quantile does); None when nothing was observed.
    A quantile in the +Inf bucket reports the highest finite bound."""
    before = dict(first)
    reset = any(n < before.get(le, 0.0) for le, n in last)
    deltas = [(le, n if reset else n - before.get(le, 0.0)) for le, n in last]
    if not deltas or deltas[-1][1] <= 0:
        return None
    rank = q * deltas[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for le, count in deltas:
        if count >= rank:
            if math.isinf(le):
                return lower_bound
            if count == lower_count:
                return le
            return lower_bound + (le - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = le, count
    return lower_bound
