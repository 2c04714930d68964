"""`bench ttft`'s arithmetic: one request's trace plus the client's clock give each part of
its time to first token; a trace missing a span leaves that part out instead of guessing."""

from __future__ import annotations

import argparse

import pytest

from shared.telemetry.records import EventRecord, SpanRecord
from tools.bench.ttft_bench import PARTS, ClientSide, _prompt_messages, breakdown

MS = 1_000_000  # ns


def span(service, name, start_ms, end_ms, kind="INTERNAL", parent="p", events=()):
    return SpanRecord(
        trace_id="t" * 32,
        span_id=f"{service}-{name}-{start_ms}",
        parent_span_id=parent,
        name=name,
        kind=kind,
        service=f"splitserve-{service}",
        start_ns=start_ms * MS,
        end_ns=end_ms * MS,
        events=[EventRecord(n, t * MS) for n, t in events],
    )


def trace() -> list[SpanRecord]:
    first = "splitserve.first_token"
    return [
        span("coordinator", "chat m", 0, 200, "SERVER", parent=None, events=[(first, 112)]),
        span("coordinator", "splitserve.prefill", 2, 130, "CLIENT", events=[(first, 111)]),
        span("prefill", "splitserve.prefill", 3, 129, "SERVER", events=[(first, 110)]),
        span("prefill", "splitserve.prefill.chunk", 5, 60),
        span("prefill", "splitserve.prefill.chunk", 60, 109),
        span("prefill", "splitserve.kv_transfer", 110, 128),
        span("coordinator", "splitserve.decode", 111, 200, "CLIENT"),
        span("decode", "splitserve.decode", 112, 199, "SERVER", events=[(first, 150)]),
        span("decode", "splitserve.decode.kv_wait", 112, 130),
    ]


def test_breakdown_of_one_request():
    client = ClientSide("t" * 32, sent_ns=-1 * MS, token_ns=[113 * MS, 170 * MS])
    parts = breakdown(client, trace())
    assert set(parts) == set(PARTS)
    assert parts == pytest.approx(
        {
            "ttft": 114,
            "coordinator_overhead": 2,  # HTTP in (0) to the Prefill RPC out (2)
            "prefill_queue": 2,  # server span (3) to the first chunk (5)
            "prefill_compute": 104,  # first chunk (5) to the sampling step's end (109)
            "first_token_after_sample": 4,  # sampled (109) to the client (113)
            "prefill_send": 1,  # sampled (109) to the token leaving the prefill replica (110)
            "rpc_to_coordinator": 1,  # left the prefill replica (110) to the coordinator (111)
            "coordinator_relay": 1,  # Prefill message in (111) to the client's chunk out (112)
            "client_delivery": 1,  # written (112) to the client reading it (113)
            "transfer": 18,
            "transfer_end_after_first_token": 15,  # the push ended (128) after the client (113)
            "decode_kv_wait": 18,
            "decode_first_step": 20,  # KV in (112 + 18) to the decode's first token (150)
            "second_token_gap": 57,
        }
    )


def test_a_trace_without_spans_leaves_the_parts_out():
    client = ClientSide("x" * 32, sent_ns=0, token_ns=[50 * MS])
    parts = breakdown(client, [])
    assert parts["ttft"] == pytest.approx(50)
    assert {k for k, v in parts.items() if v is None} == set(PARTS) - {"ttft"}


def test_prompts_are_fresh_and_about_the_size_asked(real_tokenizer):
    a, b = (_prompt_messages(i, real_tokenizer, 300) for i in range(2))
    sizes = [len(real_tokenizer.encode(real_tokenizer.apply_chat_template(m))) for m in (a, b)]
    assert all(250 <= n <= 300 for n in sizes)
    assert a[0]["content"][:40] != b[0]["content"][:40]  # no shared first block


def test_the_command_is_registered_with_plot():
    from tools.commands import bench_cmd

    parser = argparse.ArgumentParser()
    bench_cmd.add_command(parser.add_subparsers())
    args = parser.parse_args(["bench", "ttft", "--json", "out.json", "--plot", "figs"])
    assert (args.json, args.plot, args.requests, args.prompt_tokens) == (
        "out.json",
        "figs",
        30,
        300,
    )
