"""The coordinator's ring buffer of finished traces: bounded in traces and in spans per trace,
the oldest trace goes first, a trace is listed once its request span has ended, workers'
spans tail in from a shared trace file, and the views are behind the API keys."""

from __future__ import annotations

import json
import os

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from services.coordinator.settings import APISettings
from shared.telemetry.recent_traces import RecentTraces, TraceFileTail
from shared.telemetry.records import SpanRecord
from shared.telemetry.tracing import Tracing
from tests.unit.coordinator_client import run_with_client
from tests.unit.scripted_backend import Script, ScriptedTestBackend

KEY = "sk-ring-test"


@pytest.fixture
def tracing():
    t = Tracing.with_exporter(InMemorySpanExporter(), "splitserve-coordinator", recent_traces=3)
    yield t
    t.shutdown()


def request(tracing: Tracing, name: str, children: int = 1) -> str:
    with tracing.tracer.start_as_current_span(name, kind=SpanKind.SERVER) as root:
        for i in range(children):
            with tracing.tracer.start_as_current_span(f"{name}.child{i}"):
                pass
    return f"{root.get_span_context().trace_id:032x}"


def test_keeps_the_newest_traces_and_evicts_the_oldest(tracing):
    ids = [request(tracing, f"chat {i}") for i in range(5)]
    recent = tracing.recent
    assert len(recent) == 3
    assert recent.trace_ids() == ids[:1:-1]  # newest first: 4, 3, 2
    assert recent.evicted_traces == 2
    assert recent.trace(ids[0]) is None and recent.trace(ids[1]) is None
    spans = recent.trace(ids[4])
    assert [s.name for s in spans] == ["chat 4", "chat 4.child0"]  # by start time
    assert spans[1].parent_span_id == spans[0].span_id
    assert [s.name for s in recent.summaries()] == ["chat 4", "chat 3", "chat 2"]


def test_spans_per_trace_are_bounded():
    recent = RecentTraces(max_traces=2, max_spans_per_trace=4)
    tracing = Tracing.with_exporter(InMemorySpanExporter(), "svc")
    tracing.provider.add_span_processor(recent)
    trace_id = request(tracing, "big", children=10)
    tracing.shutdown()
    # The children end first; the root is the one past the cap and dropped with the rest.
    assert len(recent.trace(trace_id)) == 4
    assert recent.dropped_spans == 7
    assert recent.summaries() == []  # no request span kept: not listed as finished


def test_a_trace_is_listed_once_its_request_span_ended(tracing):
    with tracing.tracer.start_as_current_span("chat open", kind=SpanKind.SERVER):
        with tracing.tracer.start_as_current_span("route"):
            pass
        assert tracing.recent.summaries() == []  # the route span is in, the request is not
    (summary,) = tracing.recent.summaries()
    assert (summary.name, summary.num_spans, summary.services) == (
        "chat open",
        2,
        ("splitserve-coordinator",),
    )


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError):
        RecentTraces(max_traces=0)


def _record(trace_id: str, span_id: str, parent: str | None, service: str, pid: int) -> dict:
    return SpanRecord(
        trace_id=trace_id,
        span_id=span_id,
        parent_span_id=parent,
        name=f"{service} span",
        kind="SERVER",
        service=service,
        start_ns=1_000 + int(span_id, 16),
        end_ns=2_000 + int(span_id, 16),
        resource={"process.pid": pid},
    ).to_json()


def test_file_tail_reads_only_new_lines_of_other_processes(tmp_path):
    path = tmp_path / "traces.jsonl"
    old = _record("a" * 32, "1" * 16, None, "splitserve-prefill", 11)
    path.write_text(json.dumps(old) + "\n")  # an earlier run's span
    recent = RecentTraces(max_traces=10)
    tail = TraceFileTail(path, recent, skip_pid=os.getpid())
    tail.start_at_end()
    mine = _record("b" * 32, "2" * 16, None, "splitserve-coordinator", os.getpid())
    theirs = _record("b" * 32, "3" * 16, "2" * 16, "splitserve-decode", 12)
    partial = json.dumps(_record("b" * 32, "4" * 16, "2" * 16, "splitserve-prefill", 13))
    with open(path, "a") as f:
        f.write(json.dumps(mine) + "\n" + json.dumps(theirs) + "\n" + partial[:20])
    assert tail.poll() == 1  # ours skipped (in memory already), the partial line left
    with open(path, "a") as f:
        f.write(partial[20:] + "\n")
    assert tail.poll() == 1
    assert tail.poll() == 0
    assert recent.trace("a" * 32) is None
    assert [s.service for s in recent.trace("b" * 32)] == [
        "splitserve-decode",
        "splitserve-prefill",
    ]


def test_trace_views_need_the_api_key(tracing, real_tokenizer):
    trace_id = request(tracing, "chat keyed")
    backend = ScriptedTestBackend(real_tokenizer, {"m": Script()})
    settings = APISettings(model_id="m", api_keys=(KEY,))

    async def work(client: httpx.AsyncClient):
        anonymous = [
            await client.get("/playground/api/traces"),
            await client.get(f"/playground/api/traces/{trace_id}"),
            await client.get("/playground/api/fleet"),
        ]
        wrong = await client.get("/playground/api/traces", headers={"Authorization": "Bearer x"})
        auth = {"Authorization": f"Bearer {KEY}"}
        listed = await client.get("/playground/api/traces", headers=auth)
        one = await client.get(f"/playground/api/traces/{trace_id}", headers=auth)
        missing = await client.get(f"/playground/api/traces/{'0' * 32}", headers=auth)
        return anonymous, wrong, listed, one, missing

    anonymous, wrong, listed, one, missing = run_with_client(backend, settings, work, tracing)
    for resp in [*anonymous, wrong]:
        assert resp.status_code == 401
        assert resp.json()["error"]["code"] == "invalid_api_key"
    assert listed.status_code == 200
    assert [t["trace_id"] for t in listed.json()["data"]] == [trace_id]
    assert [s["name"] for s in one.json()["spans"]] == ["chat keyed", "chat keyed.child0"]
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "trace_not_found"
