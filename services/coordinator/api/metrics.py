"""Prometheus metrics of one app instance (its own registry: several apps can share a process)."""

from __future__ import annotations

import json
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

# Latency buckets in seconds: TTFT spans queueing behind long prefills; ITL is per token.
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

# Label values for requests whose model or tier never validated: the client chose those
# strings, and a label per typo would grow the registry without bound.
UNKNOWN = "unknown"

# Routing attempts beyond this share one label value (bounded label cardinality).
_MAX_ATTEMPT_LABEL = 5


class APIMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        labels = ("model", "tier")
        self.requests = Counter(
            "splitserve_requests",
            "API requests by model, tier, endpoint and outcome (HTTP status; 499 = client "
            "disconnected, stream_error = failed after the stream began)",
            (*labels, "endpoint", "status"),
            registry=self.registry,
        )
        self.ttft = Histogram(
            "splitserve_time_to_first_token_seconds",
            "Time from receiving a request to its first generated token",
            labels,
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "splitserve_inter_token_latency_seconds",
            "Time between consecutive generated tokens of a request",
            labels,
            buckets=_ITL_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "splitserve_e2e_request_latency_seconds",
            "Time from receiving a request to its last token",
            labels,
            buckets=_E2E_BUCKETS,
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "splitserve_prompt_tokens", "Prompt tokens processed", labels, registry=self.registry
        )
        self.cached_tokens = Counter(
            "splitserve_cached_prompt_tokens",
            "Prompt tokens served from a prefix cache instead of being computed",
            labels,
            registry=self.registry,
        )
        self.completion_tokens = Counter(
            "splitserve_completion_tokens",
            "Tokens generated",
            labels,
            registry=self.registry,
        )

        self.outcomes = Counter(
            "splitserve_request_outcomes",
            "Finished API requests by outcome (success, client_error, unavailable, "
            "server_error, client_closed, stream_error) and the routing attempt that served "
            "them (1 = first choice, higher = after fallbacks)",
            (*labels, "outcome", "attempt"),
            registry=self.registry,
        )
        self.migrations = Counter(
            "splitserve_request_migrations",
            "Requests whose decoding moved to another replica mid-stream",
            labels,
            registry=self.registry,
        )

    def count_request(self, model: str, tier: str, endpoint: str, status: int | str) -> None:
        self.requests.labels(model, tier, endpoint, str(status)).inc()

    def count_tokens(
        self, model: str, tier: str, prompt: int, cached: int, completion: int
    ) -> None:
        self.prompt_tokens.labels(model, tier).inc(prompt)
        self.cached_tokens.labels(model, tier).inc(cached)
        self.completion_tokens.labels(model, tier).inc(completion)

    def count_outcome(
        self, model: str, tier: str, status: int | str, metadata: dict[str, Any]
    ) -> None:
        """`metadata` is the response's: `attempts` (one entry per attempt; those with reason
        `fallback` moved on to another model, `migration` to another pair; entries without
        a reason count as fallbacks), or the counts `fallback_attempts` and `migrations`
        (a list of moves or a count); absent means none."""
        fallbacks, migrations = _attempt_counts(metadata.get("attempts"))
        fallbacks = max(fallbacks, _count_value(metadata.get("fallback_attempts")))
        migrations = max(migrations, _count_value(metadata.get("migrations")))
        attempt = min(1 + fallbacks, _MAX_ATTEMPT_LABEL)
        attempt_label = f"{attempt}+" if attempt == _MAX_ATTEMPT_LABEL else str(attempt)
        self.outcomes.labels(model, tier, outcome_of(status), attempt_label).inc()
        if migrations:
            self.migrations.labels(model, tier).inc(migrations)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def outcome_of(status: int | str) -> str:
    if status == 200:
        return "success"
    if status == 499:
        return "client_closed"
    if status in (429, 503):
        return "unavailable"
    if isinstance(status, int):
        return "client_error" if status < 500 else "server_error"
    return str(status)  # stream_error


def _attempt_counts(value: Any) -> tuple[int, int]:
    """(fallbacks, migrations) among a response's `attempts`; a drain's hand-over is a
    migration too."""
    attempts = _as_list(value)
    if not attempts:
        return 0, 0
    reasons = [a.get("reason") if isinstance(a, dict) else None for a in attempts]
    migrations = reasons.count("migration") + reasons.count("drain")
    return len(attempts) - 1 - migrations, migrations


def _as_list(value: Any) -> list | None:
    if isinstance(value, str) and value.startswith("["):  # metadata values are strings
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return list(value) if isinstance(value, list | tuple) else None


def _count_value(value: Any) -> int:
    if isinstance(value, str) and value.startswith("["):
        listed = _as_list(value)
        return 0 if listed is None else len(listed)
    if isinstance(value, list | tuple):
        return len(value)
    try:
        return max(0, int(value)) if value is not None else 0
    except (TypeError, ValueError):
        return 0
