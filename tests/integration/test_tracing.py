"""Tracing and metrics through a real local stack (coordinator, prefill, decode processes),
exporting over OTLP/gRPC to a receiver in this test: one trace per request across the three
processes, correctly linked, with the GenAI and splitserve attributes and no prompt text;
every service's /metrics parses; a dead collector changes nothing a client can see."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.launcher import start_local_stack
from services.launcher.presets import LOOPBACK_COORDINATOR
from shared.config.schema import parse_config
from shared.modelfile.default import DEFAULT_MODEL_ID
from shared.telemetry.records import SpanRecord
from tools.bench.otlp_receiver import OtlpReceiver
from tools.commands.waterfall import render

pytestmark = pytest.mark.real_model

SECRET = "Zanzibarquux"  # a word that must never reach a span
PARENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def receiver():
    with OtlpReceiver() as r:  # started by `stack`, once its processes are forked
        yield r


@pytest.fixture(scope="module")
def stack(receiver):
    config = {
        "coordinator": dict(LOOPBACK_COORDINATOR),
        "transfer": {"backend": "shm"},
        # Every request takes the disaggregated path, so every trace spans three processes:
        # a repeated prompt would otherwise be prefilled on the decode replica holding it.
        "router": {"local_prefill_max_tokens": 0},
        "telemetry": {
            "exporter": "otlp_grpc",
            "endpoint": receiver.endpoint,
            "export_timeout_s": 1.0,
        },
        "models": [
            {
                "id": DEFAULT_MODEL_ID,
                "weights": "fp32",
                "pools": {"prefill": 1, "decode": 1},
                "worker": {"kv_cache_bytes": 64 << 20, "host_cache_bytes": 32 << 20, "threads": 1},
            }
        ],
    }
    with start_local_stack(parse_config(config), startup_timeout_s=240) as running:
        receiver.start()
        yield running


def chat(stack, content: str, headers=None, stream=False, max_tokens=6) -> httpx.Response:
    body = {
        "model": DEFAULT_MODEL_ID,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }
    resp = httpx.post(f"{stack.base_url}/chat/completions", json=body, headers=headers, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp


# What every complete request trace holds beyond the coordinator's own spans.
WORKER_SPANS = {
    ("splitserve-prefill", "splitserve.prefill", "SERVER"),
    ("splitserve-prefill", "splitserve.kv_transfer", "INTERNAL"),
    ("splitserve-decode", "splitserve.decode", "SERVER"),
}


def _is_complete(spans: list[SpanRecord], trace_id: str) -> bool:
    mine = [s for s in spans if s.trace_id == trace_id]
    root = any(s.service == "splitserve-coordinator" and s.kind == "SERVER" for s in mine)
    return root and WORKER_SPANS <= {(s.service, s.name, s.kind) for s in mine}


def complete_trace(
    receiver: OtlpReceiver, trace_id: str, timeout_s: float = 30
) -> list[SpanRecord]:
    """The trace once the coordinator's root span and the worker spans have arrived."""

    try:
        spans = receiver.wait_for(lambda spans: _is_complete(spans, trace_id), timeout_s)
    except TimeoutError:
        got = sorted((s.service, s.name, s.kind) for s in receiver.spans if s.trace_id == trace_id)
        pytest.fail(f"trace {trace_id} incomplete after {timeout_s} s; it has {got}")
    return [s for s in spans if s.trace_id == trace_id]


def one(spans: list[SpanRecord], service: str, name: str, kind: str | None = None) -> SpanRecord:
    found = [
        s
        for s in spans
        if s.service == f"splitserve-{service}"
        and s.name == name
        and (kind is None or s.kind == kind)
    ]
    assert len(found) == 1, (service, name, [(s.service, s.name, s.kind) for s in spans])
    return found[0]


def test_one_trace_across_three_processes(stack, receiver):
    resp = chat(stack, f"Tell me about {SECRET} in a few words.")
    body = resp.json()
    trace_id = resp.headers["x-trace-id"]
    assert resp.headers["traceparent"].split("-")[1] == trace_id
    assert body["metadata"]["trace_id"] == trace_id
    assert all(isinstance(v, str) for v in body["metadata"].values())
    spans = complete_trace(receiver, trace_id)

    assert {s.service for s in spans} == {
        "splitserve-coordinator",
        "splitserve-prefill",
        "splitserve-decode",
    }
    assert len({s.resource["process.pid"] for s in spans}) == 3
    roots = [s for s in spans if s.parent_span_id is None]
    assert len(roots) == 1
    root = roots[0]
    assert (root.service, root.kind, root.name) == (
        "splitserve-coordinator",
        "SERVER",
        f"chat {DEFAULT_MODEL_ID}",
    )
    by_id = {s.span_id: s for s in spans}
    assert all(s.parent_span_id in by_id for s in spans if s is not root)

    route = one(spans, "coordinator", "splitserve.route")
    prefill_call = one(spans, "coordinator", "splitserve.prefill", "CLIENT")
    decode_call = one(spans, "coordinator", "splitserve.decode", "CLIENT")
    prefill = one(spans, "prefill", "splitserve.prefill", "SERVER")
    decode = one(spans, "decode", "splitserve.decode", "SERVER")
    transfer = one(spans, "prefill", "splitserve.kv_transfer")
    queue = one(spans, "prefill", "splitserve.engine.queue")
    chunks = [s for s in spans if s.name == "splitserve.prefill.chunk"]
    for child, parent in [
        (route, root),
        (prefill_call, root),
        (decode_call, root),
        (prefill, prefill_call),
        (decode, decode_call),
        (transfer, prefill),
        (queue, prefill),
        *[(c, prefill) for c in chunks],
    ]:
        assert child.parent_span_id == parent.span_id, (child.name, parent.name)
        slack = 2_000_000  # 2 ms: spans from different processes, one clock
        assert parent.start_ns - slack <= child.start_ns <= child.end_ns <= parent.end_ns + slack
    assert chunks and sum(c.attributes["splitserve.prefill.chunk_tokens"] for c in chunks) > 0
    # Decode is opened on the prefill's streamed first token (the KV push goes on meanwhile),
    # which the prefill replica sent as soon as it had sampled it.
    (first_token,) = [e for e in prefill_call.events if e.name == "splitserve.first_token"]
    (sampled,) = [e for e in prefill.events if e.name == "splitserve.first_token"]
    assert sampled.time_ns <= first_token.time_ns + 2_000_000
    assert decode_call.start_ns >= first_token.time_ns - 2_000_000

    usage = body["usage"]
    a = root.attributes
    assert a["gen_ai.request.model"] == DEFAULT_MODEL_ID
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.system"] == "splitserve"
    assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert a["splitserve.tier"] == "default"
    assert a["splitserve.cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
    assert "->" in a["splitserve.replica"]
    assert a["http.response.status_code"] == 200
    assert transfer.attributes["splitserve.transfer.backend"] == "shm"
    assert transfer.attributes["splitserve.transfer.bytes"] > 0
    assert prefill.attributes["splitserve.replica"] in a["splitserve.replica"]
    assert decode.attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert decode.attributes["splitserve.kv_transferred"] is True

    # No prompt (or completion) text unless the operator asked for it.
    reply = body["choices"][0]["message"]["content"]
    for s in spans:
        dumped = json.dumps([s.name, s.attributes, [e.attributes for e in s.events]])
        assert SECRET not in dumped, s.name
        assert not reply.strip() or reply.strip() not in dumped, s.name

    drawn = render(spans, width=140)
    assert "splitserve.kv_transfer" in drawn and "decode" in drawn and "prefill" in drawn


def test_streaming_trace_ends_with_the_stream(stack, receiver):
    resp = chat(stack, "Count to three.", stream=True)
    assert "data: [DONE]" in resp.text
    spans = complete_trace(receiver, resp.headers["x-trace-id"])
    root = next(s for s in spans if s.parent_span_id is None)
    assert root.attributes["splitserve.stream"] is True
    assert [e.name for e in root.events] == ["splitserve.first_token", "splitserve.stream_end"]
    decode_call = one(spans, "coordinator", "splitserve.decode", "CLIENT")
    assert root.end_ns >= decode_call.end_ns


def test_incoming_traceparent_is_honoured_and_a_malformed_one_ignored(stack, receiver):
    parent = f"00-{PARENT_TRACE}-{PARENT_SPAN}-01"
    resp = chat(stack, "Hi.", headers={"traceparent": parent})
    assert resp.headers["x-trace-id"] == PARENT_TRACE
    spans = complete_trace(receiver, PARENT_TRACE)
    root = next(s for s in spans if s.service == "splitserve-coordinator" and s.kind == "SERVER")
    assert root.parent_span_id == PARENT_SPAN

    bad = chat(stack, "Hi.", headers={"traceparent": f"00-{PARENT_TRACE}-nothex-01"})
    fresh = bad.headers["x-trace-id"]
    assert fresh != PARENT_TRACE and len(fresh) == 32
    spans = complete_trace(receiver, fresh)
    assert [s.parent_span_id for s in spans if s.kind == "SERVER" and
            s.service == "splitserve-coordinator"] == [None]  # fmt: skip


def _scrape(address: str) -> dict:
    text = httpx.get(f"http://{address}/metrics", timeout=10).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def _total(families: dict, name: str, **labels) -> float:
    family = families[name]
    return sum(
        s.value
        for s in family.samples
        if s.name in (name, name + "_total", name + "_count") and labels.items() <= s.labels.items()
    )


def test_metrics_of_every_service_parse(stack):
    ready = httpx.get(f"{stack.url}/ready", timeout=10).json()
    workers = {w["role"]: w["metrics_address"] for w in ready["workers"].values()}
    assert set(workers) == {"prefill", "decode"} and all(workers.values())
    coordinator = _scrape(f"{stack.host}:{stack.config.coordinator.port}")
    prefill, decode = _scrape(workers["prefill"]), _scrape(workers["decode"])

    assert _total(coordinator, "splitserve_time_to_first_token_seconds") > 0
    assert _total(coordinator, "splitserve_inter_token_latency_seconds") > 0
    assert _total(coordinator, "splitserve_e2e_request_latency_seconds") > 0
    assert _total(coordinator, "splitserve_request_outcomes", outcome="success") > 0
    assert "splitserve_trace_spans_dropped" in coordinator
    assert _total(coordinator, "splitserve_trace_spans_exported") > 0

    assert _total(prefill, "splitserve_prefill_tokens", source="computed") > 0
    assert _total(prefill, "splitserve_request_queue_time_seconds", tier="default") > 0
    assert _total(prefill, "splitserve_kv_push", status="done") > 0
    assert _total(prefill, "splitserve_kvtransfer_transfers", role="send", state="done") > 0
    assert _total(prefill, "splitserve_prefix_cache_queries") > 0
    assert "splitserve_prefix_cache_hits" in prefill
    for families in (prefill, decode):
        assert _total(families, "splitserve_kv_cache_blocks_total") > 0
        for name in (
            "splitserve_kv_cache_blocks_used",
            "splitserve_kv_cache_blocks_free",
            "splitserve_kv_cache_usage_perc",
            "splitserve_iteration_batch_size",
            "splitserve_num_requests_running",
            "splitserve_spec_decode_acceptance_length",
        ):
            assert name in families, name
    assert _total(decode, "splitserve_kvtransfer_transfers", role="receive", state="done") > 0
    assert _total(decode, "splitserve_iteration_batch_size") > 0


def test_a_dead_collector_changes_nothing_a_client_sees(stack, receiver):
    question = "Name a fruit."
    before = chat(stack, question).json()["choices"][0]["message"]["content"]
    receiver.stop()
    after = chat(stack, question)  # answered although every export now fails
    assert after.json()["choices"][0]["message"]["content"] == before
    assert after.headers["x-trace-id"]
    address = f"{stack.host}:{stack.config.coordinator.port}"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        families = _scrape(address)
        if _total(families, "splitserve_trace_spans_dropped", reason="export_failed") > 0:
            break
        time.sleep(0.5)
    else:
        pytest.fail("the coordinator never counted spans it failed to export")
    receiver.start()  # the collector comes back: traces flow again, nothing restarted
    # A batch sent while an exporter is still reconnecting (at most 2 s) is dropped like any
    # failed batch; a request soon after the collector returns is traced whole.
    deadline = time.monotonic() + 60
    while True:
        again = chat(stack, question)
        assert again.json()["choices"][0]["message"]["content"] == before
        trace_id = again.headers["x-trace-id"]
        try:
            receiver.wait_for(lambda spans, t=trace_id: _is_complete(spans, t), timeout_s=10)
            return
        except TimeoutError:
            if time.monotonic() > deadline:
                complete_trace(receiver, trace_id, timeout_s=1)  # fails, naming what arrived
