"""The planner's pure decision on recorded metric series (tests/unit/data/planner_series/,
written by make_series.py there: simulated traffic through the coordinator's own metrics)."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from services.planner.cooldown import apply_cooldown
from services.planner.decide import Decision, Policy, PoolSizes, decide
from services.planner.forecast import holt_forecast
from services.planner.metrics import MetricSample, window_quantile

SERIES = Path(__file__).parent / "data" / "planner_series"

# Per-replica capacities chosen for these series: the steady load (about 2,900 computed
# prompt tokens/s and 250 generated tokens/s) needs 2 prefill and 2 decode replicas.
POLICY = Policy(
    prefill_tokens_per_s=3000,
    decode_tokens_per_s=250,
    decode_seqs=16,
    target_utilization=0.7,
    window_s=300,
    horizon_s=60,
    ttft_p99_s=2.5,
    itl_p99_s=0.1,
    max_prefill=8,
    max_decode=16,
)


def load(name: str) -> list[MetricSample]:
    doc = json.loads((SERIES / f"{name}.json").read_text())
    return [MetricSample.from_json(s) for s in doc["samples"]]


def test_steady_load_holds_a_pool_that_fits():
    d = decide(load("steady"), PoolSizes(2, 2), POLICY)
    assert (d.prefill, d.decode) == (2, 2)
    assert "prefill 2 held" in d.reason and "decode 2 held" in d.reason
    assert d.signals["ttft_p99_s"] < POLICY.ttft_p99_s


def test_steady_load_grows_an_undersized_pool_and_shrinks_an_oversized_one_step_by_step():
    assert decide(load("steady"), PoolSizes(1, 2), POLICY).sizes == PoolSizes(2, 2)
    # Five decode replicas for a load that needs two: one fewer per decision, not three.
    assert decide(load("steady"), PoolSizes(2, 5), POLICY).sizes == PoolSizes(2, 4)


def test_a_ramp_scales_both_pools_ahead_of_the_current_level():
    series = load("ramp")
    d = decide(series, PoolSizes(2, 2), POLICY)
    assert d.prefill > 2 and d.decode > 2
    assert d.signals["prefill_tokens_per_s_forecast"] > d.signals["prefill_tokens_per_s"]
    per_replica = POLICY.prefill_tokens_per_s * POLICY.target_utilization
    assert d.prefill == math.ceil(d.signals["prefill_tokens_per_s_forecast"] / per_replica)
    # Looking further ahead on a rising series never buys fewer replicas.
    now_only = decide(series, PoolSizes(2, 2), replace(POLICY, horizon_s=0))
    assert now_only.prefill <= d.prefill


def test_a_ttft_breach_adds_a_prefill_replica_that_throughput_alone_would_not():
    series = load("ttft_breach")
    d = decide(series, PoolSizes(2, 2), POLICY)
    assert d.signals["ttft_p99_s"] > POLICY.ttft_p99_s
    assert d.prefill == 3 and d.decode == 2
    assert "TTFT over target" in d.reason
    no_slo = decide(series, PoolSizes(2, 2), replace(POLICY, ttft_p99_s=None))
    assert no_slo.prefill == 2


def test_a_decline_steps_down_one_replica_at_a_time_and_never_below_the_minimum():
    series = load("decline")
    assert decide(series, PoolSizes(3, 5), POLICY).sizes == PoolSizes(2, 4)
    floor = replace(POLICY, min_prefill=2, min_decode=3)
    assert decide(series, PoolSizes(2, 3), floor).sizes == PoolSizes(2, 3)
    assert decide(series, PoolSizes(2, 4), floor).sizes == PoolSizes(2, 3)


def test_a_coordinator_restart_does_not_read_as_negative_or_huge_load():
    restart = decide(load("restart"), PoolSizes(2, 2), POLICY)
    steady = decide(load("steady"), PoolSizes(2, 2), POLICY)
    assert restart.sizes == steady.sizes == PoolSizes(2, 2)
    for name, value in restart.signals.items():
        assert value is None or value >= 0, name
    ratio = restart.signals["prefill_tokens_per_s"] / steady.signals["prefill_tokens_per_s"]
    assert 0.7 < ratio < 1.4


def test_bounds_win_over_everything():
    series = load("ramp")
    capped = replace(POLICY, max_prefill=3, max_decode=3)
    d = decide(series, PoolSizes(2, 2), capped)
    assert d.sizes == PoolSizes(3, 3) and "bounded to [1, 3]" in d.reason
    # Someone scaled a pool to zero by hand: back to the minimum even with no data yet.
    d = decide([], PoolSizes(0, 4), replace(POLICY, min_prefill=2))
    assert d.sizes == PoolSizes(2, 4) and d.reason.startswith("holding within bounds")


def test_too_few_samples_hold():
    series = load("steady")
    d = decide(series[:1], PoolSizes(5, 1), POLICY)
    assert d.sizes == PoolSizes(5, 1) and "1 sample(s)" in d.reason
    # Samples older than the window do not count.
    late = [MetricSample(t=series[-1].t + 10_000, requests=1)]
    assert "1 sample(s)" in decide(series + late, PoolSizes(2, 2), POLICY).reason


def test_policy_refuses_bounds_that_allow_an_empty_pool_or_cross():
    with pytest.raises(ValueError, match="min_prefill must be at least 1"):
        Policy(min_prefill=0)
    with pytest.raises(ValueError, match=r"min_decode \(5\) exceeds max_decode \(4\)"):
        Policy(min_decode=5, max_decode=4)


def test_cooldown_holds_a_recent_pool_and_lets_the_other_move():
    d = Decision(4, 1, "load")
    policy = Policy()
    last = {"prefill": 100.0, "decode": 100.0}
    held = apply_cooldown(d, PoolSizes(2, 3), last, now=130.0, policy=policy,
                          cooldown_s=60, scale_down_cooldown_s=300)  # fmt: skip
    assert held.sizes == PoolSizes(2, 3) and "cooldown 60s" in held.reason
    later = apply_cooldown(d, PoolSizes(2, 3), last, 170.0, policy, 60, 300)
    assert later.sizes == PoolSizes(4, 3)  # up after 60 s; down still waits for 300 s
    assert apply_cooldown(d, PoolSizes(2, 3), last, 401.0, policy, 60, 300).sizes == (
        PoolSizes(4, 1)
    )
    # A pool outside its bounds goes back inside at once.
    below = apply_cooldown(Decision(1, 3, "min"), PoolSizes(0, 3), last, 101.0, policy, 60, 300)
    assert below.sizes == PoolSizes(1, 3)


def test_holt_forecast_follows_a_line_and_stays_non_negative():
    line = [(t, 10.0 + 2.0 * t) for t in range(0, 60, 5)]
    f = holt_forecast(line, horizon_s=10, alpha=0.8, beta=0.8)
    assert f.trend_per_s == pytest.approx(2.0, rel=0.1)
    assert f.predicted == pytest.approx(10 + 2 * 65, rel=0.05)
    falling = holt_forecast([(t, 100.0 - 10 * t) for t in range(11)], horizon_s=100)
    assert falling.predicted == 0.0 and falling.level >= 0.0


def test_window_quantile_interpolates_inside_the_bucket():
    first = ((0.1, 0.0), (1.0, 0.0), (float("inf"), 0.0))
    last = ((0.1, 50.0), (1.0, 100.0), (float("inf"), 100.0))
    assert window_quantile(first, last, 0.5) == pytest.approx(0.1)
    assert window_quantile(first, last, 0.75) == pytest.approx(0.55)
    assert window_quantile(first, first, 0.99) is None
    beyond = ((0.1, 0.0), (1.0, 0.0), (float("inf"), 10.0))
    assert window_quantile(first, beyond, 0.99) == 1.0
