"""`bench router` on a slice of the Mooncake trace: every key, sane figures, in seconds."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from tools.commands import router_cmd
from tools.tuner import router_bench
from tools.tuner.cli_run import load_profile_or_default
from tools.tuner.trace import load_trace

TRACE = Path(__file__).resolve().parents[2] / "traces" / "mooncake_conversation_trace.jsonl"


@pytest.fixture(scope="module")
def sliced():
    return load_trace(TRACE).window(0, 400)


def test_every_policy_reports_every_key(sliced):
    profile, _ = load_profile_or_default(None)
    result, samples = router_bench.run(sliced, profile, replicas=4)
    assert set(result["policies"]) == set(router_bench.POLICIES)
    for name, figures in result["policies"].items():
        assert set(figures) == {"hit_rate", "ttft_p50_ms", "ttft_p99_ms", "imbalance"}
        assert 0.0 <= figures["hit_rate"] <= result["oracle_hit_rate"] + 1e-9, name
        assert figures["imbalance"] >= 1.0
        assert figures["ttft_p50_ms"] <= figures["ttft_p99_ms"]
        assert len(samples[name]["ttft_ms"]) == 400
    kv = result["policies"]["kv_aware"]
    # No policy can beat each prompt alone on a replica; the floor is taken with kv_aware's hits.
    assert kv["ttft_p99_ms"] >= result["ttft_p99_unloaded_floor_ms"] * 0.999
    assert kv["hit_rate"] > result["policies"]["round_robin"]["hit_rate"]
    assert result["mapping"]["utilization"] == pytest.approx(0.65)
    assert set(result["targets"]) == {
        "hit_rate_vs_prefix_only",
        "imbalance_vs_least_loaded",
        "ttft_p99_vs_round_robin",
        "ttft_p99_lowest_of_four",
    }


def test_oracle_counts_every_earlier_prefix(sliced):
    trace = sliced.window(0, 3)
    # Requests 0..2 all start with block 0 and share nothing else: two blocks' worth reused.
    assert [ids[0] for ids in trace.hash_ids] == [0, 0, 0]
    expected = 2 * trace.block_tokens / trace.input_tokens.sum()
    assert router_bench.oracle_hit_rate(trace) == pytest.approx(expected)


def test_cli_writes_json_and_plot(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    router_cmd.add_bench(parser.add_subparsers(dest="bench"))
    out = tmp_path / "router.json"
    args = parser.parse_args(
        ["router", "--trace", str(TRACE), "--replicas", "2", "--requests", "150"]
        + ["--json", str(out), "--plot", str(tmp_path / "plots")]
    )
    assert args.handler(args) == 0
    data = json.loads(out.read_text())
    assert data["requests"] == 150 and data["replicas"] == 2
    assert (tmp_path / "plots" / "router_ttft_cdf.png").stat().st_size > 0
    assert "target ttft_p99_vs_round_robin" in capsys.readouterr().out


def test_a_trace_without_hash_ids_is_refused(tmp_path):
    parser = argparse.ArgumentParser()
    router_cmd.add_bench(parser.add_subparsers(dest="bench"))
    csv = tmp_path / "azure.csv"
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n0,100,10\n1,200,20\n")
    args = parser.parse_args(["router", "--trace", str(csv)])
    assert args.handler(args) == 2
