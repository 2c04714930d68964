"""The `bench tiers` report: its keys and figures from known per-request timings."""

from __future__ import annotations

import pytest

from shared.config.schema import parse_config
from tools.bench.load import RequestTiming
from tools.bench.tiers_bench import TiersBenchPlan, stack_config, summarize_tiers, table_rows


def _ok(kind: str, ttft: float) -> RequestTiming:
    return RequestTiming(kind, ttft_ms=ttft, tokens=4)


def test_summary_keys_and_ratios():
    runs = {
        "priority_alone": [_ok("priority", t) for t in (100, 100, 100, 200)],
        "priority": [_ok("priority", t) for t in (120, 130, 140, 240)],
        "batch": [_ok("batch", 5000)] * 3 + [RequestTiming("batch", error="HTTP 502: x")],
        "default": [RequestTiming("default", error="HTTP 429: busy")] * 2 + [_ok("default", 90)],
    }
    result = summarize_tiers(runs, TiersBenchPlan())
    assert result["priority_slowdown"] == pytest.approx(
        result["priority"]["ttft_p99_ms"] / result["priority_alone"]["ttft_p99_ms"]
    )
    assert result["priority_slowdown"] == pytest.approx(
        237.0 / 197.0
    )  # p99 interpolates 97% up the top gap
    assert result["batch"]["completed"] == 3 and result["batch"]["errors"] == 1
    assert result["default"] == {"sent": 3, "rejected_429": 2, "completed": 1, "other_errors": 0}
    assert result["targets"]["priority_slowdown_met"] is True
    assert set(result["samples"]) == {"priority_alone", "priority", "batch", "default"}
    assert len(table_rows(result)) == 10


def test_bench_stack_config_is_valid_and_limits_the_model():
    config = parse_config(stack_config(TiersBenchPlan(max_in_flight=3)))
    assert config.tiers.limit(config.models[0].id) == 3
    assert config.tiers.default.max_queue == 0 and config.tiers.priority.burst == 4
