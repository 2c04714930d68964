"""The planner reads what the coordinator's metrics code actually exposes."""

from __future__ import annotations

import pytest

from services.coordinator.api.metrics import APIMetrics
from services.planner.metrics import MetricSample, parse_metrics, window_quantile


def exposition() -> str:
    m = APIMetrics()
    for model, prompt, cached, completion in (("a", 1000, 400, 50), ("b", 300, 0, 20)):
        m.count_request(model, "default", "chat", 200)
        m.count_tokens(model, "default", prompt, cached, completion)
        m.ttft.labels(model, "default").observe(0.2)
        m.itl.labels(model, "default").observe(0.02)
        m.e2e.labels(model, "default").observe(1.5)
    m.count_request("a", "premium", "completion", 503)
    m.count_tokens("a", "premium", 10, 0, 0)
    return m.render().decode()


def test_one_models_counters_are_summed_over_tiers_endpoints_and_outcomes():
    s = parse_metrics(exposition(), t=5.0, model="a")
    assert (s.t, s.requests, s.prompt_tokens, s.cached_tokens) == (5.0, 2, 1010, 400)
    assert (s.completion_tokens, s.e2e_seconds, s.computed_prompt_tokens) == (50, 1.5, 610)
    assert dict(s.ttft_buckets)[0.25] == 1 and dict(s.ttft_buckets)[0.1] == 0
    assert dict(s.itl_buckets)[float("inf")] == 1


def test_no_model_means_all_traffic():
    s = parse_metrics(exposition(), t=0.0)
    assert (s.requests, s.prompt_tokens, s.completion_tokens) == (3, 1310, 70)
    assert window_quantile((), s.ttft_buckets, 0.5) == pytest.approx(0.175)


def test_a_model_without_traffic_reads_as_zeros():
    s = parse_metrics(exposition(), t=1.0, model="never-seen")
    assert s == MetricSample(t=1.0)


def test_samples_round_trip_through_json():
    s = parse_metrics(exposition(), t=2.0, model="b")
    assert MetricSample.from_json(s.to_json()) == s
