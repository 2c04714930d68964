"""`bench overhead`'s headline: the worse tracing mode against off; TTFT from the paired
unloaded phase, the closed loop's TTFT reported beside it; bad arguments refused."""

from __future__ import annotations

import argparse
import random

import pytest

from tools.bench.overhead_bench import _cpu_ms_per_request, _headline, p50_delta_ci95, table_rows
from tools.commands.trace_cmd import add_bench


def _mode(tok_s: float, loaded_ttft: float, unloaded_ttft: float, cpu_ms: float) -> dict:
    return {
        "cpu_ms_per_request": {"coordinator": 20.0, "decode": cpu_ms - 20.0, "total": cpu_ms},
        "throughput_tok_s": tok_s,
        "ttft_p50_ms": loaded_ttft,
        "unloaded_ttft_p50_ms": unloaded_ttft,
        "e2e_p50_ms": 1000.0,
        "errors": 0,
    }


def test_headline_takes_the_worse_mode_and_the_paired_ttft():
    result = {
        "off": _mode(100.0, 600.0, 200.0, 400.0),
        "file": _mode(97.0, 640.0, 200.5, 404.0),
        "otlp": _mode(99.0, 610.0, 201.5, 410.0),
        "span_cpu_ms_per_request": 0.7,
        "collector_cpu_ms_per_request": 3.0,
    }
    _headline(result)
    assert result["tracing_throughput_ratio"] == pytest.approx(0.97)
    assert result["tracing_ttft_p50_delta_ms"] == pytest.approx(1.5)  # otlp, paired
    assert result["tracing_ttft_p50_delta_ms_loaded"] == pytest.approx(40.0)  # file, loaded
    assert result["tracing_ttft_p50_delta_ms_file"] == pytest.approx(0.5)
    assert result["tracing_cpu_ratio"] == pytest.approx(1.025)  # otlp: 410 / 400
    assert result["tracing_cpu_ratio_file"] == pytest.approx(1.01)
    labels = [row[0] for row in table_rows(result)]
    assert "tracing_ttft_p50_delta_ms_loaded" in labels
    assert "TTFT p50 ms, paired unloaded (otlp vs off)" in labels
    assert "total CPU ms/request (otlp vs off)" in labels
    assert "coordinator CPU ms/request (otlp vs off)" in labels


@pytest.mark.parametrize("flag", ["--paired", "--rounds", "--requests", "--concurrency"])
def test_bench_overhead_refuses_zero_counts(flag, capsys):
    parser = argparse.ArgumentParser()
    add_bench(parser.add_subparsers(dest="kind"))
    with pytest.raises(SystemExit):
        parser.parse_args(["overhead", flag, "0"])
    assert f"argument {flag}: 0 is not a positive integer" in capsys.readouterr().err


def test_the_paired_delta_interval_brackets_the_estimate_and_narrows_with_pairs():
    rng = random.Random(1)
    off = [200 + rng.gauss(0, 15) for _ in range(400)]
    on = [t + 3.0 for t in off]  # a constant 3 ms on every prompt
    assert p50_delta_ci95(on, off) == pytest.approx([3.0, 3.0])
    noisy = [t + 3.0 + rng.gauss(0, 10) for t in off]
    lo, hi = p50_delta_ci95(noisy, off)
    few_lo, few_hi = p50_delta_ci95(noisy[:30], off[:30])
    assert lo < 3.0 < hi and hi - lo < few_hi - few_lo
    assert p50_delta_ci95(noisy, off) == [lo, hi]  # seeded: the same data, the same interval


def test_cpu_per_request_by_role_totals_only_when_every_role_was_read():
    before = {"coordinator": 1.0, "decode": 10.0}
    after = {"coordinator": 1.5, "decode": 30.0}
    assert _cpu_ms_per_request(before, after, 10) == {
        "coordinator": 50.0,
        "decode": 2000.0,
        "total": 2050.0,
    }
    assert _cpu_ms_per_request({**before, "prefill": None}, after, 10) == {
        "coordinator": 50.0,
        "decode": 2000.0,
    }
    assert _cpu_ms_per_request(before, after, 0) == {}
