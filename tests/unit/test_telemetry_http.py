"""The coordinator's request span through the real HTTP app (a scripted backend behind it):
trace headers on every response, GenAI attributes, content only when asked for, the span
ending with the stream, errors marked, and backend-reported fallbacks counted."""

from __future__ import annotations

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from prometheus_client.parser import text_string_to_metric_families

from services.coordinator.api.app import create_app
from services.coordinator.api.server import ServerThread
from services.coordinator.generation_backend import BackendError, GenerationChunk, ModelInfo
from services.coordinator.settings import APISettings
from shared.telemetry.tracing import Tracing

MODEL = "scripted"
SECRET = "Quetzalcoatlus"


class ScriptedBackend:
    """Says "Hello there" in two chunks, the second ending on the end-of-turn token (like a
    real replica, token ids only: the coordinator makes the text); fails mid-stream when
    the prompt asks it to."""

    def __init__(self, tokenizer):
        self.info = ModelInfo(id=MODEL, context_length=2048, tokenizer=tokenizer)
        self.hello, self.there = tokenizer.encode("Hello"), tokenizer.encode(" there")
        self.end = min(tokenizer.stop_token_ids)

    def models(self):
        return [self.info]

    async def health(self):
        return {"ready": True}

    async def generate(self, req):
        n = len(req.prompt_token_ids)
        yield GenerationChunk(self.hello, num_prompt_tokens=n, num_output_tokens=1, replica="r0")
        if req.params.max_tokens == 13:
            raise BackendError("decode replica vanished")
        yield GenerationChunk(
            [*self.there, self.end],
            finished=True,
            finish_reason="stop",
            num_prompt_tokens=n,
            num_cached_tokens=16,
            num_output_tokens=3,
            replica="r0",
            metadata={"fallback_attempts": 1},
        )


@pytest.fixture(params=[False, True], ids=["default", "capture_content"])
def served(request, real_tokenizer):
    exporter = InMemorySpanExporter()
    tracing = Tracing.with_exporter(
        exporter, "splitserve-coordinator", capture_content=request.param
    )
    app = create_app(ScriptedBackend(real_tokenizer), APISettings(model_id=MODEL), tracing)
    with ServerThread(app) as server:
        yield server, tracing, exporter, request.param
    tracing.shutdown()


def _post(server, max_tokens=8, stream=False, model=MODEL, headers=None) -> httpx.Response:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"Tell me about {SECRET}."}],
        "max_tokens": max_tokens,
        "stream": stream,
    }
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=headers, timeout=30)


def _finished(tracing, exporter):
    tracing.force_flush()
    return exporter.get_finished_spans()


def test_request_span_attributes_and_headers(served):
    server, tracing, exporter, capture = served
    resp = _post(server)
    assert resp.status_code == 200
    (span,) = _finished(tracing, exporter)
    trace_id = f"{span.context.trace_id:032x}"
    assert resp.headers["x-trace-id"] == trace_id
    version, header_trace, parent, flags = resp.headers["traceparent"].split("-")
    assert (version, header_trace, parent) == ("00", trace_id, f"{span.context.span_id:016x}")
    assert int(flags, 16) & 1  # sampled
    a = span.attributes
    assert span.name == f"chat {MODEL}"
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.request.model"] == MODEL
    assert a["gen_ai.request.max_tokens"] == 8
    assert a["gen_ai.usage.input_tokens"] == resp.json()["usage"]["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == 3
    assert a["gen_ai.response.finish_reasons"] == ("stop",)
    assert a["splitserve.cached_tokens"] == 16
    assert a["splitserve.fallback_attempts"] == 1
    assert a["splitserve.tier"] == "default"
    assert a["http.response.status_code"] == 200
    dumped = repr(dict(a))
    assert (SECRET in dumped) is capture
    assert ("Hello there" in dumped) is capture


def test_streamed_span_ends_with_the_stream(served):
    server, tracing, exporter, _ = served
    resp = _post(server, stream=True)
    assert "[DONE]" in resp.text
    (span,) = _finished(tracing, exporter)
    assert [e.name for e in span.events] == ["splitserve.first_token", "splitserve.stream_end"]
    assert span.attributes["splitserve.stream"] is True


def test_errors_are_marked_and_still_carry_the_trace_id(served):
    server, tracing, exporter, _ = served
    missing = _post(server, model="no-such-model")
    assert missing.status_code == 404 and len(missing.headers["x-trace-id"]) == 32
    broken = _post(server, max_tokens=13, stream=True)
    assert "decode replica vanished" in broken.text
    spans = {s.attributes.get("http.response.status_code", "stream"): s for s in _finished(
        tracing, exporter)}  # fmt: skip
    assert spans[404].status.status_code is StatusCode.UNSET  # the client's mistake
    assert spans["stream"].status.status_code is StatusCode.ERROR
    assert spans["stream"].attributes["error.type"] == "stream_error"


def test_fallbacks_reach_the_outcome_counter(served):
    server, *_ = served
    _post(server)
    text = httpx.get(f"{server.url}/metrics").text
    outcomes = [
        s
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "splitserve_request_outcomes_total"
    ]
    assert [(s.labels["outcome"], s.labels["attempt"], s.value) for s in outcomes] == [
        ("success", "2", 1.0)
    ]
    assert "splitserve_trace_spans_dropped_total" in text
