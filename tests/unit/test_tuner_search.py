"""The tuner recovers pool sizes that can be worked out by hand, says so when no size meets
the SLO, and the `splitserve tune` command writes the promised JSON and names bad lines."""

from __future__ import annotations

import argparse
import json

import pytest

from services.planner.replica_profile import (
    DecodeModel,
    PrefillModel,
    ReplicaProfile,
    TransferModel,
)
from tools.tuner.fleet import FleetConfig
from tools.tuner.search import Evaluator, smallest_passing, tune
from tools.tuner.slo import parse_slo
from tools.tuner.synthetic import uniform_trace

# Prefill costs 1 ms a token (no step overhead, no chunking at these lengths); a KV push is
# free; a decode step costs `seq_ms` per sequence in the batch.
PREFILL = PrefillModel(step_ms=0.0, token_ms=1.0, attn_ms=0.0)
FREE_PUSH = TransferModel(latency_ms=0.0, gb_s=1e9)


def _profile(decode: DecodeModel) -> ReplicaProfile:
    return ReplicaProfile(
        prefill=PREFILL,
        decode=decode,
        transfer=FREE_PUSH,
        chunk_tokens=10_000,
        kv_bytes_per_token=1,
        max_context=100_000,
        kv_capacity_tokens=100_000,
    )


def _quiet(_: str) -> None:
    pass


def _tune(trace, profile, slo: str, max_replicas: int = 12):
    evaluator = Evaluator(trace, profile, parse_slo(slo), FleetConfig(1, 1), log=_quiet)
    return tune(evaluator, max_replicas)


def test_prefill_heavy_work_needs_four_prefill_replicas_and_one_decode():
    # A 350 ms prompt every 100 ms: 3 replicas fall behind without end (TTFT grows), 4 keep
    # up with no queueing at all (TTFT = 350 ms). One decode step (10 ms) per request.
    trace = uniform_trace(200, every_ms=100, input_tokens=350, output_tokens=2)
    result = _tune(trace, _profile(DecodeModel(10.0, 0.0, 0.0)), "ttft_p99_ms=500,itl_p99_ms=50")
    assert result.meets_slo
    assert (result.best.prefill, result.best.decode) == (4, 1)
    assert result.best.latency["ttft_p99_ms"] == pytest.approx(350.0)
    three = next(e for e in result.evaluations if e.prefill == 3)
    assert not three.meets


def test_decode_heavy_work_needs_one_prefill_replica_and_five_decode():
    # A 10-token prompt every 100 ms, then 45 decode steps costing 10 ms per sequence in the
    # batch: alone a request decodes for 450 ms, so 5 replicas (one request each 500 ms)
    # never batch (ITL 10 ms) while 4 fall behind and their batches, and ITL, keep growing.
    trace = uniform_trace(400, every_ms=100, input_tokens=10, output_tokens=46)
    result = _tune(trace, _profile(DecodeModel(0.0, 10.0, 0.0)), "ttft_p99_ms=500,itl_p99_ms=30")
    assert result.meets_slo
    assert result.best.ratio == "1:5"
    assert result.best.latency["itl_p99_ms"] == pytest.approx(10.0)
    four = next(e for e in result.evaluations if (e.prefill, e.decode) == (1, 4))
    assert four.latency["itl_p99_ms"] > 30


def test_an_slo_no_fleet_can_meet_is_reported_with_the_closest_found():
    trace = uniform_trace(60, every_ms=100, input_tokens=350, output_tokens=2)
    result = _tune(trace, _profile(DecodeModel(10.0, 0.0, 0.0)), "ttft_p99_ms=200", 6)
    assert not result.meets_slo
    assert "no prefill:decode split of up to 6 replicas meets ttft_p99_ms=200" in result.message
    # Nothing beats a prompt's own 350 ms; the closest is the first fleet without queueing.
    assert result.best.latency["ttft_p99_ms"] == pytest.approx(350.0)
    assert result.best.violation == pytest.approx(350 / 200)


def test_smallest_passing_gallops_then_bisects():
    probes: list[int] = []

    def passes(n: int) -> bool:
        probes.append(n)
        return n >= 11

    assert smallest_passing(passes, 1, 40) == 11
    assert len(probes) <= 9
    assert smallest_passing(lambda n: False, 1, 5) is None


def test_slo_parsing_refuses_unknown_keys_and_bad_numbers():
    assert parse_slo("ttft_p99_ms=2000,itl_p99_ms=150").targets == {
        "ttft_p99_ms": 2000.0,
        "itl_p99_ms": 150.0,
    }
    with pytest.raises(ValueError, match="unknown SLO key 'ttft_p95_ms'"):
        parse_slo("ttft_p95_ms=3")
    with pytest.raises(ValueError, match="not a number"):
        parse_slo("itl_p99_ms=fast")
    with pytest.raises(ValueError, match="must be a positive"):
        parse_slo("itl_p99_ms=0")


def _cli(argv: list[str]) -> int:
    from tools.commands.tune_cmd import add_commands

    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.handler(args)


def _write_inputs(tmp_path, rows: list[dict]):
    profile = _profile(DecodeModel(10.0, 0.0, 0.0))
    profile.save(tmp_path / "profile.json")
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path / "profile.json", trace


def test_tune_command_writes_the_recommendation_and_the_values(tmp_path, capsys):
    rows = [
        {"timestamp": 100 * i, "input_length": 350, "output_length": 2, "hash_ids": [i]}
        for i in range(100)
    ]
    profile, trace = _write_inputs(tmp_path, rows)
    out = tmp_path / "tune.json"
    argv = ["tune", "--trace", str(trace), "--profile", str(profile), "--json", str(out)]
    assert _cli(argv + ["--slo", "ttft_p99_ms=500,itl_p99_ms=50", "--max-replicas", "8"]) == 0
    report = json.loads(out.read_text())
    assert report["recommended_ratio"] == "4:1"
    assert (report["prefill_replicas"], report["decode_replicas"]) == (4, 1)
    assert report["meets_slo"] is True
    assert report["predicted"]["ttft_p99_ms"] == pytest.approx(350.0)
    assert report["predicted"]["itl_p99_ms"] == pytest.approx(10.0)
    assert report["requests_per_s_simulated"] > 0
    printed = capsys.readouterr().out
    assert 'total: 5\n    ratio: "4:1"' in printed and "pools:" in printed


def test_tune_command_names_the_bad_line_of_a_trace(tmp_path, capsys):
    rows = [{"timestamp": 0, "input_length": 5, "output_length": 2, "hash_ids": []}]
    profile, trace = _write_inputs(tmp_path, rows)
    with trace.open("a") as f:
        f.write('{"timestamp": 1, "input_length": "many", "output_length": 2}\n')
    argv = ["tune", "--trace", str(trace), "--profile", str(profile), "--slo", "ttft_p99_ms=9"]
    assert _cli(argv) == 2
    assert f"{trace}:2: input_length must be an integer" in capsys.readouterr().err


def test_tune_command_says_when_the_slo_cannot_be_met(tmp_path, capsys):
    rows = [{"timestamp": 100 * i, "input_length": 350, "output_length": 2} for i in range(30)]
    profile, trace = _write_inputs(tmp_path, rows)
    out = tmp_path / "tune.json"
    argv = ["tune", "--trace", str(trace), "--profile", str(profile), "--json", str(out)]
    assert _cli(argv + ["--slo", "ttft_p99_ms=100", "--max-replicas", "4"]) == 0
    report = json.loads(out.read_text())
    assert report["meets_slo"] is False
    printed = capsys.readouterr().out
    assert "no prefill:decode split of up to 4 replicas meets" in printed
    assert "does NOT meet the SLO" in printed


def test_tier_mixes_parse_and_assign_priorities_in_proportion():
    from tools.tuner.fleet import assign_priorities, parse_tier_mix

    assert parse_tier_mix("batch") == {"batch": 1.0}
    mix = parse_tier_mix("priority=1,default=3")
    assert mix == {"priority": 0.25, "default": 0.75}
    priorities = assign_priorities(20_000, mix, seed=1)
    assert set(priorities.tolist()) == {0, 1}
    assert abs((priorities == 0).mean() - 0.25) < 0.02
    with pytest.raises(ValueError, match="TIER=FRACTION with TIER one of priority"):
        parse_tier_mix("gold=1")
    with pytest.raises(ValueError, match="sum to a positive"):
        parse_tier_mix("batch=0")


@pytest.mark.parametrize(
    "model, pool",
    [
        ("meta-llama/Llama-3.1-70B-Instruct", "Llama-3.1-70B-Instruct"),
        ("Qwen/Qwen3-30B-A3B", "Qwen3-30B-A3B"),
        ("SmolLM2-135M-Instruct.Q4_1", "SmolLM2-135M-Instruct"),
        ("SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
        ("", "SmolLM2-135M-Instruct"),
    ],
)
def test_the_values_name_the_pool_after_the_profiles_model(model, pool):
    from tools.tuner.cli_run import pool_model_id

    assert pool_model_id({"model": model}) == pool
