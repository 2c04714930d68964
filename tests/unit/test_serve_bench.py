"""`bench serve`'s pure parts: prompts, conversations that resend their history, the keys and
ratios assembled from recorded timings, memory and KV readings, and the CLI's validation.
No stack and no peer: those are what the command itself drives."""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys

import pytest

from tools.bench import serve_bench as sb
from tools.bench.load import RequestTiming
from tools.commands import bench_cmd


def _ok(kind: str, ttft: float, itl: list[float], e2e: float) -> RequestTiming:
    return RequestTiming(kind, ttft_ms=ttft, itl_ms=itl, tokens=len(itl) + 1, e2e_ms=e2e)


def _words(text: str) -> int:
    return len(text.split())


# -- prompts -----------------------------------------------------------------------------


def test_corpus_is_plain_text_with_the_transcripts_user_turns():
    sentences = sb.corpus_sentences()
    assert len(sentences) > 50
    assert all("<|" not in s and "\n" not in s and s.strip() == s for s in sentences)
    assert "What is the difference between weather and climate?" in sentences
    assert not any("def average" in s for s in sentences)  # code is left out


def test_prompts_are_deterministic_sized_and_start_apart():
    sentences = sb.corpus_sentences()
    plan = sb.ServeBenchPlan(conversations=1)
    first = sb.make_prompts(plan, _words, sentences)
    assert first == sb.make_prompts(plan, _words, sentences)
    assert first != sb.make_prompts(sb.ServeBenchPlan(conversations=1, seed=1), _words, sentences)
    assert len(first.short) == 20 and len(first.first_turn) == 10
    assert len(first.conversation) == 1 and len(first.conversation[0]) == 12
    assert len(first.concurrency8) == 32
    for text in first.first_turn:  # cut at the last word within the budget
        assert 300 - 1 <= _words(text) <= 300

    # Every message starts at the next sentence of one shuffle (or within it, when the
    # budget is shorter than that sentence): no two start alike until the shuffle wraps.
    maker = sb.PromptMaker(sentences, _words, seed=0)
    made = [maker.message(n) for n in (5, 40, 300) * 10]
    assert sorted(maker.order) == list(range(len(sentences)))
    for text, index in zip(made, maker.order, strict=False):
        first_sentence = sentences[index]
        assert text.startswith(first_sentence) or first_sentence.startswith(text)


def test_prompt_sizes_in_the_models_tokens(real_tokenizer):
    def count(text: str) -> int:
        return len(real_tokenizer.encode(text))

    prompts = sb.make_prompts(sb.SMALL, count, sb.corpus_sentences())
    for texts, size in (
        (prompts.short, sb.SMALL.short_tokens),
        (prompts.first_turn, sb.SMALL.first_turn_tokens),
        (prompts.concurrency8, sb.SMALL.concurrent_tokens),
    ):
        assert [size - 4 <= count(t) <= size for t in texts] == [True] * len(texts)


def test_request_bodies_are_greedy_streams_our_api_accepts():
    from services.coordinator.prepare.schemas import ChatCompletionRequest

    plain = sb.chat_body("m", [{"role": "user", "content": "hi"}], 32)
    assert plain["messages"][0] == {"role": "system", "content": sb.SYSTEM_PROMPT}
    assert plain["temperature"] == 0 and plain["stream"] is True and plain["max_tokens"] == 32
    assert "ignore_eos" not in plain
    forced = sb.chat_body("m", [{"role": "user", "content": "hi"}], 64, ignore_eos=True)
    parsed = ChatCompletionRequest.model_validate(forced)
    assert parsed.ignore_eos is True and parsed.max_tokens == 64 and parsed.temperature == 0


def test_a_conversation_resends_its_history_with_the_servers_replies():
    sent: list[list[dict[str, str]]] = []

    async def send(messages):
        sent.append(messages)
        return _ok("conversation", 10.0, [1.0], 20.0), f"reply {len(sent)}"

    users = ["one", "two", "three"]
    timings = asyncio.run(sb.run_conversation(send, users))
    assert len(timings) == 3
    assert sent[0] == [{"role": "user", "content": "one"}]
    assert sent[2] == [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "reply 1"},
        {"role": "user", "content": "two"},
        {"role": "assistant", "content": "reply 2"},
        {"role": "user", "content": "three"},
    ]


def test_a_failed_turn_ends_its_conversation():
    async def send(messages):
        if len(messages) == 3:
            return RequestTiming("conversation", error="HTTP 500: x"), ""
        return _ok("conversation", 10.0, [], 20.0), "fine"

    timings = asyncio.run(sb.run_conversation(send, ["a", "b", "c", "d"]))
    assert [t.error for t in timings] == [None, "HTTP 500: x"]


def test_reply_text_keeps_the_streamed_content():
    reply = sb.ReplyText()
    chunks = [{"delta": {"role": "assistant"}}, {"delta": {"content": "Hel"}}, {"delta": None}]
    assert [reply(c) for c in [*chunks, {"delta": {"content": "lo"}}]] == [
        False,
        True,
        False,
        True,
    ]
    assert reply.text == "Hello"


def test_every_workload_through_our_api(real_tokenizer):
    """`drive` against the real coordinator app (scripted backend): each workload sends what
    it says, the server's usage counts are read, a conversation resends the replies."""
    from services.coordinator.settings import APISettings
    from tests.unit.coordinator_client import run_with_client
    from tests.unit.scripted_backend import Script, ScriptedTestBackend

    backend = ScriptedTestBackend(real_tokenizer, {"m": Script(num_tokens=3)})
    prompts = sb.make_prompts(sb.SMALL, _words, sb.corpus_sentences())

    async def work(client):
        return await sb.drive("/v1", prompts, sb.SMALL, client)

    served = run_with_client(backend, APISettings(model_id="m"), work)
    assert served["model"] == "m"
    result = sb.assemble(sb.SMALL, served, None, {})
    expected = {"short": 3, "first_turn": 2, "conversation": 2, "concurrency8": 8}
    for workload, requests in expected.items():
        stats = result["ours"][workload]
        assert (stats["requests"], stats["errors"]) == (requests, 0), workload
        assert stats["output_tokens"] == 3 * requests and stats["requests_without_usage"] == 0
    calls = backend.calls
    assert len(calls) == 2 + 3 + 2 + 3 + 8  # warm-up, short, first turns, 3 turns, concurrent
    assert all(c.request.params.temperature == 0.0 for c in calls)
    assert [c.request.params.ignore_eos for c in calls[-8:]] == [True] * 8
    assert not any(c.request.params.ignore_eos for c in calls[:-8])
    assert [c.request.params.max_tokens for c in calls[-9:-7]] == [32, 64]
    third_turn = real_tokenizer.decode(calls[9].request.prompt_token_ids)
    assert third_turn.count("t0 t1 t2") == 2 and sb.SYSTEM_PROMPT in third_turn
    for user in prompts.conversation[0]:
        assert user in third_turn


# -- figures -----------------------------------------------------------------------------


def _runs(scale: float) -> dict[str, sb.WorkloadRun]:
    """Four requests per workload; every latency times `scale`."""

    def run(kind: str) -> sb.WorkloadRun:
        timings = [
            _ok(kind, scale * t, [scale * 10.0, scale * 30.0], scale * 100.0)
            for t in (100.0, 200.0, 300.0, 400.0)
        ]
        return sb.WorkloadRun(timings, sum(t.e2e_ms for t in timings) / 1e3)

    return {w: run(w) for w in sb.WORKLOADS}


def test_workload_keys_from_recorded_timings():
    timings = [_ok("short", t, [10.0, 30.0], 100.0) for t in (100.0, 200.0, 300.0, 400.0)]
    timings.append(RequestTiming("short", error="HTTP 503: busy", e2e_ms=5.0))
    stats = sb.workload_stats(sb.WorkloadRun(timings, busy_s=0.5))
    assert stats["requests"] == 5 and stats["errors"] == 1
    assert stats["error_examples"] == ["HTTP 503: busy"]
    assert stats["ttft_p50_ms"] == pytest.approx(250.0)
    assert stats["ttft_p99_ms"] == pytest.approx(397.0)  # 99% of the way up the top gap
    assert stats["itl_p50_ms"] == pytest.approx(20.0)
    assert stats["output_tokens"] == 12 and stats["output_tok_s"] == pytest.approx(24.0)


def test_conversation_figures_leave_out_first_turns_but_count_their_errors():
    ok = [_ok("conversation", t, [5.0], 50.0) for t in (900.0, 40.0, 60.0)]
    failed_first = [RequestTiming("conversation", error="HTTP 500: x", e2e_ms=1.0)]
    run = sb.conversation_workload([ok, failed_first])
    stats = sb.workload_stats(run)
    assert stats["ttft_p50_ms"] == pytest.approx(50.0)  # turns 2 and 3 only
    assert stats["errors"] == 1 and stats["requests"] == 3
    assert run.busy_s == pytest.approx(0.1)


def test_ratios_are_ours_over_the_peer_per_workload():
    ours = {"model": "a", "runs": _runs(1.0), "rss_mb": 600.0, "kv_tokens": 11648}
    peer = {"model": "b", "runs": _runs(2.0), "rss_mb": 200.0, "kv_tokens": 16384}
    result = sb.assemble(sb.SMALL, ours, peer, {"short": 20.0})
    for workload in sb.WORKLOADS:
        assert result["ours"][workload]["ttft_p50_ms"] == pytest.approx(250.0)
        assert result["peer"][workload]["ttft_p50_ms"] == pytest.approx(500.0)
        ratios = result[workload]
        assert ratios["ttft_ratio"] == pytest.approx(0.5)
        assert ratios["ttft_p99_ratio"] == pytest.approx(0.5)
        assert ratios["itl_ratio"] == pytest.approx(0.5)
        assert ratios["itl_p99_ratio"] == pytest.approx(0.5)
        assert ratios["throughput_ratio"] == pytest.approx(2.0)  # same tokens in half the time
        assert set(result["samples"][workload]) == {"ours", "peer"}
    assert result["rss_ratio"] == pytest.approx(3.0)
    assert result["kv_tokens_ratio"] == pytest.approx(11648 / 16384)
    assert "runs" not in result["ours"] and result["peer"]["model"] == "b"
    rows = sb.table_rows(result)
    assert rows[0] == ("short ttft_p50_ms", 250.0, 500.0, 0.5)
    assert rows[-2] == ("rss_mb (every process)", 600.0, 200.0, 3.0)


def test_without_a_peer_there_are_no_ratios():
    ours = {"model": "a", "runs": _runs(1.0), "rss_mb": 600.0, "kv_tokens": None}
    result = sb.assemble(sb.SMALL, ours, None, {})
    assert "peer" not in result and "rss_ratio" not in result
    assert not any(w in result for w in sb.WORKLOADS)
    rows = sb.table_rows(result)
    assert all(peer is None and r is None for _, _, peer, r in rows)
    assert rows[0][1] == pytest.approx(250.0)


def test_ratio_needs_both_figures():
    assert sb.ratio(3.0, 2.0) == pytest.approx(1.5)
    assert sb.ratio(None, 2.0) is None
    assert sb.ratio(3.0, None) is None
    assert sb.ratio(3.0, 0.0) is None
    assert sb.ratio(0.0, 2.0) == 0.0


def test_figures_per_workload(tmp_path):
    ours = {"model": "a", "runs": _runs(1.0)}
    peer = {"model": "b", "runs": _runs(2.0)}
    result = sb.assemble(sb.SMALL, ours, peer, {})
    names = sorted(p.name for p in sb.write_figures(result, tmp_path))
    assert names == sorted(f"serve_{w}_{k}_cdf.png" for w in sb.WORKLOADS for k in ("ttft", "itl"))


# -- memory and KV capacity --------------------------------------------------------------


def test_memory_of_named_processes():
    # A process of our own with no children (the test runner itself may have some).
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "up\n"  # interpreter up
        memory = sb.process_memory({"worker": child.pid})
    finally:
        child.kill()
        child.wait()
    assert memory["rss_mb"] is not None and memory["rss_mb"] > 1
    assert list(memory["rss_mb_by_process"]) == ["worker"]
    assert memory["rss_mb_by_process"]["worker"] == pytest.approx(memory["rss_mb"])
    assert sb.peer_memory(None)["rss_mb"] is None
    assert "--peer-pid" in sb.peer_memory(None)["rss_note"]


def test_kv_capacity_readings(gguf_path):
    import torch

    from engine.kvcache.pool import KVLayout
    from shared.modelfile.gguf_meta import read_gguf_config

    page = (
        "# HELP splitserve_kv_cache_blocks_total KV blocks in the device pool\n"
        'splitserve_kv_cache_blocks_total{model="m",role="decode"} 364.0\n'
        'splitserve_kv_cache_blocks_used{model="m",role="decode"} 3.0\n'
    )
    assert sb.kv_blocks_from_metrics(page) == 364
    assert sb.kv_blocks_from_metrics("up 1\n") is None
    c = read_gguf_config(gguf_path)
    layout = KVLayout(c.num_layers, c.num_kv_heads, c.head_dim, 16, torch.float32)
    budget = 256 << 20
    assert sb.kv_tokens_from_config(budget, 16, gguf_path) == budget // layout.block_bytes * 16
    half = KVLayout(c.num_layers, c.num_kv_heads, c.head_dim, 16, torch.float16)
    fp16 = sb.kv_tokens_from_config(budget, 16, gguf_path, "float16")
    assert fp16 == budget // half.block_bytes * 16
    given = sb.peer_kv_capacity("http://127.0.0.1:9", 4096)
    assert given == {"kv_tokens": 4096, "kv_tokens_source": "--peer-kv-tokens"}


def test_api_base_takes_either_form():
    assert sb.api_base("http://127.0.0.1:8088") == "http://127.0.0.1:8088/v1"
    assert sb.api_base("http://127.0.0.1:8088/v1/") == "http://127.0.0.1:8088/v1"


# -- the command line --------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve")
    bench_cmd.add_command(parser.add_subparsers(dest="command"))
    return parser


def test_cli_options_and_request_scales():
    args = _parser().parse_args(["bench", "serve", "--requests", "small", "--plot", "d"])
    assert sb.plan_for(args.requests) == sb.SMALL and args.plot == "d"
    args = _parser().parse_args(
        ["bench", "serve", "--peer", "http://127.0.0.1:8088", "--peer-pid", "42"]
        + ["--peer-kv-tokens", "16384", "--threads", "2", "--weights", "int4"]
    )
    assert (args.peer, args.peer_pid, args.peer_kv_tokens) == ("http://127.0.0.1:8088", 42, 16384)
    assert sb.plan_for(args.requests) == sb.ServeBenchPlan()
    half = sb.plan_for(_parser().parse_args(["bench", "serve", "--requests", "0.5"]).requests)
    assert (half.short_requests, half.conversations, half.concurrent_requests) == (10, 1, 16)
    assert half.turns == 12 and half.concurrent_tokens == 256  # sizes stay
    assert sb.ServeBenchPlan().scaled(0.01).first_turn_requests == 1


@pytest.mark.parametrize(
    "bad",
    [
        ["--requests", "0"],
        ["--requests", "lots"],
        ["--peer-pid", "-1"],
        ["--peer-kv-tokens", "0"],
        ["--threads", "0"],
        ["--peer", "127.0.0.1:8088"],
        ["--weights", "fp8"],
    ],
)
def test_cli_refuses_bad_values(bad, capsys):
    with pytest.raises(SystemExit) as exc:
        _parser().parse_args(["bench", "serve", *bad])
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


def test_peer_details_without_a_peer_are_refused(capsys):
    args = _parser().parse_args(["bench", "serve", "--peer-pid", "42"])
    assert args.handler(args) == 2
    assert "--peer URL" in capsys.readouterr().err
