"""The planner's control loop: scrape, read the live counts, decide, apply (or just log).

Every failure holds the pools where they are and says why in the log: metrics missing
(no decision without data), the Kubernetes API unreachable (the counts cannot even be
read, let alone set), a patch refused (the other pool may still be set).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import httpx

from services.planner.cooldown import apply_cooldown
from services.planner.decide import ROLES, Decision, Policy, PoolSizes, decide
from services.planner.kube import ScaleAPIError
from services.planner.metrics import MetricSample, parse_metrics

log = logging.getLogger("splitserve.planner")


class Scaler(Protocol):
    def get_replicas(self, deployment: str) -> int: ...

    def set_replicas(self, deployment: str, replicas: int) -> None: ...


class MetricsUnavailable(RuntimeError):
    pass


@dataclass(frozen=True)
class PlannerConfig:
    prefill_deployment: str
    decode_deployment: str
    policy: Policy = field(default_factory=Policy)
    interval_s: float = 15.0
    cooldown_s: float = 60.0
    scale_down_cooldown_s: float = 300.0
    dry_run: bool = False

    def deployment(self, role: str) -> str:
        return self.prefill_deployment if role == "prefill" else self.decode_deployment


@dataclass(frozen=True)
class StepResult:
    action: str  # "scaled", "dry-run", "hold", "no-metrics", "api-error"
    message: str
    decision: Decision | None = None


def http_metrics(
    coordinator_url: str,
    model: str | None,
    timeout_s: float = 5.0,
    clock: Callable[[], float] = time.monotonic,
) -> Callable[[], MetricSample]:
    url = coordinator_url.rstrip("/") + "/metrics"

    def scrape() -> MetricSample:
        try:
            response = httpx.get(url, timeout=timeout_s)
            response.raise_for_status()
        except httpx.HTTPError as exc:
            raise MetricsUnavailable(f"GET {url}: {type(exc).__name__}: {exc}") from exc
        try:
            return parse_metrics(response.text, clock(), model)
        except ValueError as exc:
            raise MetricsUnavailable(f"GET {url}: not Prometheus text: {exc}") from exc

    return scrape


class Planner:
    def __init__(
        self,
        config: PlannerConfig,
        metrics: Callable[[], MetricSample],
        scaler: Scaler,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = config
        self.metrics = metrics
        self.scaler = scaler
        self.clock = clock
        self.window: deque[MetricSample] = deque()
        self.last_change: dict[str, float] = {}

    def step(self) -> StepResult:
        cfg = self.config
        try:
            self._remember(self.metrics())
        except MetricsUnavailable as exc:
            return self._report("no-metrics", f"metrics unavailable, keeping current counts: {exc}")
        try:
            current = PoolSizes(
                self.scaler.get_replicas(cfg.prefill_deployment),
                self.scaler.get_replicas(cfg.decode_deployment),
            )
        except ScaleAPIError as exc:
            return self._report(
                "api-error", f"Kubernetes API unavailable, keeping current counts: {exc}"
            )
        now = self.clock()
        decision = decide(list(self.window), current, cfg.policy)
        decision = apply_cooldown(
            decision,
            current,
            self.last_change,
            now,
            cfg.policy,
            cfg.cooldown_s,
            cfg.scale_down_cooldown_s,
        )
        if decision.sizes == current:
            return self._report("hold", decision.reason, decision)
        if cfg.dry_run:
            return self._report("dry-run", f"dry run, not applied: {decision.reason}", decision)
        failures = []
        for role in ROLES:
            want = decision.sizes.get(role)
            if want == current.get(role):
                continue
            try:
                self.scaler.set_replicas(cfg.deployment(role), want)
            except ScaleAPIError as exc:
                failures.append(f"{role} kept at {current.get(role)}: {exc}")
                continue
            self.last_change[role] = now
        if failures:
            return self._report("api-error", f"{decision.reason}; " + "; ".join(failures), decision)
        return self._report("scaled", decision.reason, decision)

    def run(self, stop: threading.Event | None = None) -> None:
        stop = stop or threading.Event()
        while not stop.is_set():
            started = self.clock()
            self.step()
            stop.wait(max(0.0, self.config.interval_s - (self.clock() - started)))

    def _remember(self, sample: MetricSample) -> None:
        self.window.append(sample)
        start = sample.t - self.config.policy.window_s
        while self.window and self.window[0].t < start:
            self.window.popleft()

    def _report(self, action: str, message: str, decision: Decision | None = None) -> StepResult:
        level = logging.WARNING if action in ("no-metrics", "api-error") else logging.INFO
        log.log(level, "%s: %s", action, message)
        return StepResult(action, message, decision)
