"""Writes the planner's metric-series fixtures (run from the repo root; deterministic).

Each scenario drives the coordinator's own metrics code (services.coordinator.api.metrics) with
simulated traffic: Poisson arrivals at a rate that follows the scenario, conversation-shaped
requests (long prompts, much of them a cached prefix, short replies) and latencies drawn
around the scenario's medians. Every `interval_s` the registry is rendered as /metrics
text and parsed by the planner's parser, exactly as a live scrape would be.

    python tests/unit/data/planner_series/make_series.py
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from services.coordinator.api.metrics import APIMetrics
from services.planner.metrics import parse_metrics

MODEL = "SmolLM2-135M-Instruct"
HERE = Path(__file__).parent


@dataclass
class Scenario:
    name: str
    description: str
    rate: Callable[[float], float]  # requests per second at time t
    ttft_median_s: Callable[[float], float]
    itl_median_s: Callable[[float], float]
    duration_s: float = 300.0
    interval_s: float = 15.0
    prompt_mean: int = 2400
    cached_fraction: float = 0.5
    completion_mean: int = 120
    restart_at: float | None = None  # the coordinator restarts: counters begin again


def simulate(sc: Scenario, seed: int) -> list[dict]:
    rng = random.Random(seed)
    metrics = APIMetrics()
    samples = []
    t = 0.0
    step = 1.0
    next_scrape = 0.0
    while t <= sc.duration_s + 1e-9:
        if sc.restart_at is not None and t - step < sc.restart_at <= t:
            metrics = APIMetrics()
        if t >= next_scrape - 1e-9:
            text = metrics.render().decode()
            samples.append(parse_metrics(text, round(t, 3), MODEL).to_json())
            next_scrape += sc.interval_s
        for _ in range(_poisson(rng, sc.rate(t) * step)):
            _one_request(rng, metrics, sc, t)
        t += step
    return samples


def _one_request(rng: random.Random, metrics: APIMetrics, sc: Scenario, t: float) -> None:
    prompt = max(16, int(rng.lognormvariate(math.log(sc.prompt_mean), 0.6)))
    cached = int(prompt * min(0.95, max(0.0, rng.gauss(sc.cached_fraction, 0.15))))
    completion = max(1, int(rng.expovariate(1 / sc.completion_mean)))
    ttft = rng.lognormvariate(math.log(sc.ttft_median_s(t)), 0.5)
    itl = sc.itl_median_s(t)
    labels = (MODEL, "default")
    metrics.count_request(MODEL, "default", "chat", 200)
    metrics.count_tokens(MODEL, "default", prompt, cached, completion)
    metrics.ttft.labels(*labels).observe(ttft)
    gaps = [rng.lognormvariate(math.log(itl), 0.3) for _ in range(completion - 1)]
    for gap in gaps:
        metrics.itl.labels(*labels).observe(gap)
    metrics.e2e.labels(*labels).observe(ttft + sum(gaps))


def _poisson(rng: random.Random, mean: float) -> int:
    # Knuth's method: fine for the small per-second means used here.
    limit, k, p = math.exp(-mean), 0, 1.0
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


SCENARIOS = [
    Scenario(
        "steady",
        "2 req/s all along, latencies well inside the SLOs",
        rate=lambda t: 2.0,
        ttft_median_s=lambda t: 0.25,
        itl_median_s=lambda t: 0.03,
    ),
    Scenario(
        "ramp",
        "traffic climbing from 1 to 6 req/s over five minutes, latencies still fine",
        rate=lambda t: 1.0 + 5.0 * t / 300.0,
        ttft_median_s=lambda t: 0.3,
        itl_median_s=lambda t: 0.035,
    ),
    Scenario(
        "ttft_breach",
        "steady 2 req/s, but TTFT p99 has drifted past 1 s (prefill queueing): "
        "throughput alone would not add a replica",
        rate=lambda t: 2.0,
        ttft_median_s=lambda t: 0.6 if t < 120 else 1.2,
        itl_median_s=lambda t: 0.03,
    ),
    Scenario(
        "decline",
        "the evening decline: from 3 req/s to almost nothing",
        rate=lambda t: max(0.05, 3.0 * (1 - t / 240.0)),
        ttft_median_s=lambda t: 0.2,
        itl_median_s=lambda t: 0.025,
    ),
    Scenario(
        "restart",
        "steady 2 req/s; the coordinator restarts at t=150 s and its counters begin again",
        rate=lambda t: 2.0,
        ttft_median_s=lambda t: 0.25,
        itl_median_s=lambda t: 0.03,
        restart_at=150.0,
    ),
]


def main() -> None:
    for seed, sc in enumerate(SCENARIOS):
        doc = {
            "description": sc.description,
            "source": "simulated traffic through services.coordinator.api.metrics.APIMetrics, "
            f"scraped every {sc.interval_s:g} s (make_series.py, seed {seed})",
            "model": MODEL,
            "samples": simulate(sc, seed),
        }
        (HERE / f"{sc.name}.json").write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
