"""Tracing core: config at the edge, W3C context in and out, errors kept whatever the sampling,
a bounded export queue that drops (and counts) instead of slowing anyone, the JSON-lines file."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
from opentelemetry import trace as otel_trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import Status, StatusCode
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.coordinator.api.http_span import RequestTrace
from shared.config.schema import ConfigError, DeploymentConfig, TelemetryConfig, parse_config
from shared.telemetry.file_export import JsonLinesSpanExporter, read_span_file
from shared.telemetry.processor import BoundedSpanProcessor
from shared.telemetry.propagation import (
    context_from_grpc,
    current_trace_metadata,
    grpc_metadata,
)
from shared.telemetry.tracing import Tracing, create_exporter
from tools.bench.otlp_receiver import OtlpReceiver, ReceiverProcess

VALID_PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


class _Collecting(SpanExporter):
    def __init__(self, block: threading.Event | None = None):
        self.spans = []
        self.block = block

    def export(self, spans):
        if self.block is not None:
            self.block.wait(10)
        self.spans.extend(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self):
        pass


def _tracing(exporter, **kwargs) -> Tracing:
    return Tracing.with_exporter(exporter, "splitserve-test", **kwargs)


def test_unknown_exporter_is_refused_naming_the_valid_ones():
    with pytest.raises(ConfigError) as err:
        parse_config({"telemetry": {"exporter": "jaeger"}})
    message = str(err.value)
    assert "telemetry.exporter" in message
    for name in ("none", "file", "otlp_grpc", "otlp_http"):
        assert name in message


def test_default_config_changes_nothing():
    config = DeploymentConfig()
    assert config.telemetry.exporter == "none" and not config.telemetry.capture_content
    tracing = Tracing.from_config(config.telemetry, "splitserve-coordinator")
    assert not tracing.enabled
    span = tracing.tracer.start_span("x")
    assert not span.is_recording()
    with pytest.raises(ConfigError, match="sampling_ratio"):
        parse_config({"telemetry": {"sampling_ratio": 1.5}})


def test_incoming_traceparent_is_honoured_and_returned():
    exporter = _Collecting()
    tracing = _tracing(exporter)
    trace = RequestTrace(tracing, {"traceparent": VALID_PARENT}, "chat", "POST", "/v1/chat")
    headers = trace.headers()
    assert headers["x-trace-id"] == "0af7651916cd43dd8448eb211c80319c"
    assert headers["traceparent"].split("-")[1] == headers["x-trace-id"]
    trace.end(200)
    tracing.shutdown()
    (span,) = exporter.spans
    assert span.parent.span_id == 0xB7AD6B7169203331
    assert span.attributes["gen_ai.operation.name"] == "chat"


@pytest.mark.parametrize(
    "bad",
    [
        "garbage",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",  # no flags
        "00-00000000000000000000000000000000-b7ad6b7169203331-01",  # all-zero trace id
        "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",  # forbidden version
        "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",  # all-zero parent id
    ],
)
def test_malformed_traceparent_starts_a_new_trace(bad):
    exporter = _Collecting()
    tracing = _tracing(exporter)
    trace = RequestTrace(tracing, {"traceparent": bad}, "completion", "POST", "/v1/completions")
    trace.end(200)
    tracing.shutdown()
    (span,) = exporter.spans
    assert span.parent is None
    assert f"{span.context.trace_id:032x}" != "0af7651916cd43dd8448eb211c80319c"
    assert span.context.trace_flags.sampled


def test_grpc_metadata_round_trip_and_response_metadata():
    exporter = _Collecting()
    tracing = _tracing(exporter)
    trace = RequestTrace(tracing, {}, "chat", "POST", "/v1/chat/completions")
    metadata = grpc_metadata(trace.span)
    assert dict(metadata)["traceparent"].startswith("00-")
    child = tracing.tracer.start_span("server", context=context_from_grpc(metadata))
    assert child.parent.span_id == trace.span.get_span_context().span_id
    assert current_trace_metadata() == {}  # nothing is active here
    with trace.active():
        assert current_trace_metadata() == {"trace_id": trace.headers()["x-trace-id"]}
    # Binary metadata and junk values do not break extraction.
    assert context_from_grpc([("x-bin", b"\x00"), ("traceparent", "nope")]) is not None


def test_errors_are_kept_when_the_trace_is_not_sampled():
    exporter = _Collecting()
    tracing = _tracing(exporter, sampling_ratio=0.0)
    ok = tracing.tracer.start_span("fine")
    ok.end()
    bad = tracing.tracer.start_span("broken")
    bad.set_status(Status(StatusCode.ERROR, "boom"))
    bad.end()
    tracing.shutdown()
    assert [s.name for s in exporter.spans] == ["broken"]


def test_server_errors_mark_the_request_span_but_client_errors_do_not():
    exporter = _Collecting()
    tracing = _tracing(exporter, sampling_ratio=0.0)
    for status in (200, 400, 499, 503, "stream_error"):
        RequestTrace(tracing, {}, "chat", "POST", "/v1/chat/completions").end(status)
    tracing.shutdown()
    kept = sorted(
        str(s.attributes.get("http.response.status_code", "stream")) for s in exporter.spans
    )
    assert kept == ["503", "stream"]


def test_full_queue_drops_and_counts_without_blocking():
    release = threading.Event()
    exporter = _Collecting(block=release)
    processor = BoundedSpanProcessor(exporter, max_queue_size=10, max_batch_size=5, interval_s=0.01)
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(processor)
    tracer = provider.get_tracer("t")
    start = time.perf_counter()
    for i in range(200):
        tracer.start_span(f"s{i}").end()
    assert time.perf_counter() - start < 1.0  # the exporter is stuck; nobody waits for it
    assert processor.dropped_queue_full >= 200 - 10 - 5
    registry = CollectorRegistry()
    Tracing(provider.get_tracer("t"), provider=provider, processor=processor).register_metrics(
        registry
    )
    text = generate_latest(registry).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    dropped = {
        s.labels["reason"]: s.value for s in families["splitserve_trace_spans_dropped"].samples
    }
    assert dropped["queue_full"] == processor.dropped_queue_full
    release.set()
    assert processor.force_flush(5000)
    processor.shutdown()
    assert processor.exported + processor.dropped_queue_full == 200


def _processor_and_tracer(exporter, **kwargs):
    processor = BoundedSpanProcessor(exporter, **kwargs)
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(processor)
    return processor, provider.get_tracer("t")


def _wait_until(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_export_waits_while_a_request_is_served_here():
    exporter = _Collecting()
    processor, tracer = _processor_and_tracer(exporter, interval_s=0.01, max_defer_s=30.0)
    request = tracer.start_span("request", kind=otel_trace.SpanKind.SERVER)
    tracer.start_span("finished child").end()
    # Several export intervals pass with the request open: the child waits, queued.
    assert not _wait_until(lambda: exporter.spans, timeout_s=0.3)
    assert processor.queued == 1
    request.end()  # the process is quiet: both go out at once
    assert _wait_until(lambda: len(exporter.spans) == 2)
    processor.shutdown()


def test_a_request_that_never_ends_delays_export_at_most_max_defer():
    exporter = _Collecting()
    processor, tracer = _processor_and_tracer(exporter, interval_s=0.01, max_defer_s=0.2)
    tracer.start_span("stuck request", kind=otel_trace.SpanKind.SERVER)  # never ended
    tracer.start_span("child").end()
    assert _wait_until(lambda: [s.name for s in exporter.spans] == ["child"])
    processor.shutdown()


def test_flush_does_not_wait_for_open_requests():
    exporter = _Collecting()
    processor, tracer = _processor_and_tracer(exporter, interval_s=30.0, max_defer_s=60.0)
    tracer.start_span("open request", kind=otel_trace.SpanKind.SERVER)
    tracer.start_span("child").end()
    assert processor.force_flush(5000)
    assert [s.name for s in exporter.spans] == ["child"]
    processor.shutdown(timeout_s=5.0)
    assert not processor._thread.is_alive()


def test_unreachable_collector_costs_spans_not_time():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = TelemetryConfig(
        exporter="otlp_grpc", endpoint=f"127.0.0.1:{port}", export_timeout_s=0.5
    )
    tracing = Tracing.from_config(config, "splitserve-test")
    start = time.perf_counter()
    for i in range(50):
        tracing.tracer.start_span(f"s{i}").end()
    assert time.perf_counter() - start < 0.5
    tracing.force_flush(5.0)
    tracing.shutdown(timeout_s=2.0)
    assert tracing.processor.dropped_export_failed == 50
    assert tracing.processor.exported == 0


def test_file_exporter_round_trip(tmp_path):
    path = tmp_path / "traces.jsonl"
    tracing = Tracing.from_config(TelemetryConfig(exporter="file", file=str(path)), "svc")
    parent = tracing.tracer.start_span("parent", attributes={"gen_ai.request.model": "m"})
    with_child = tracing.tracer.start_span("child", context=otel_trace.set_span_in_context(parent))
    with_child.add_event("splitserve.first_token")
    with_child.end()
    parent.end()
    tracing.shutdown()
    with open(path, "a") as f:
        f.write("not json\n")
        f.write(json.dumps({"trace_id": "x"})[:10])  # a line still being written
    spans = {s.name: s for s in read_span_file(path)}
    assert set(spans) == {"parent", "child"}
    assert spans["child"].parent_span_id == spans["parent"].span_id
    assert spans["child"].trace_id == spans["parent"].trace_id
    assert spans["parent"].service == "svc"
    assert spans["parent"].attributes == {"gen_ai.request.model": "m"}
    assert spans["child"].events[0].name == "splitserve.first_token"


def test_file_export_failure_is_counted_not_raised(tmp_path):
    exporter = JsonLinesSpanExporter(tmp_path / "dir-as-file")
    (tmp_path / "dir-as-file").mkdir()
    tracing = _tracing(exporter)
    tracing.tracer.start_span("s").end()
    tracing.shutdown()
    assert tracing.processor.dropped_export_failed == 1


def test_otlp_grpc_export_reaches_a_receiver_with_attributes_intact():
    with OtlpReceiver() as receiver:
        receiver.start()
        config = TelemetryConfig(exporter="otlp_grpc", endpoint=receiver.endpoint)
        tracing = Tracing.from_config(config, "splitserve-test", "instance-1")
        parent = tracing.tracer.start_span("parent")
        child = tracing.tracer.start_span(
            "child",
            context=otel_trace.set_span_in_context(parent),
            attributes={"n": 3, "f": 0.5, "b": True, "l": ["a", "b"], "s": "x"},
        )
        child.add_event("e", {"k": 1})
        child.set_status(Status(StatusCode.ERROR, "why"))
        child.end()
        parent.end()
        tracing.shutdown()
        spans = {s.name: s for s in receiver.wait_for(lambda got: len(got) == 2)}
    child_rec = spans["child"]
    assert child_rec.parent_span_id == spans["parent"].span_id
    assert child_rec.attributes == {"n": 3, "f": 0.5, "b": True, "l": ["a", "b"], "s": "x"}
    assert (child_rec.status, child_rec.status_message) == ("ERROR", "why")
    assert child_rec.events[0].attributes == {"k": 1}
    assert child_rec.service == "splitserve-test"
    assert child_rec.resource["service.instance.id"] == "instance-1"


def test_a_restarted_collector_gets_the_next_batch():
    """After failed connects gRPC would wait, growing to minutes, before reconnecting, and
    every batch meanwhile would be dropped: each failed batch gets the next a fresh
    connection, so the first batch after the collector returns arrives."""
    tracer = TracerProvider().get_tracer("t")

    def batch() -> list:
        span = tracer.start_span("s")
        span.end()
        return [span]

    with OtlpReceiver() as receiver:
        receiver.start()
        # 0.5 s: no time for the exporter's own retry (its first backoff is ~1 s).
        config = TelemetryConfig(exporter="otlp_grpc", endpoint=receiver.endpoint)
        exporter = create_exporter(config.model_copy(update={"export_timeout_s": 0.5}))
        assert exporter.export(batch()) is SpanExportResult.SUCCESS
        receiver.stop()
        outage = [exporter.export(batch()) for _ in range(8) if time.sleep(0.5) is None]
        assert SpanExportResult.SUCCESS not in outage
        assert exporter.reconnects == len(outage)
        receiver.start()
        assert exporter.export(batch()) is SpanExportResult.SUCCESS
        exporter.shutdown()
        assert len(receiver.wait_for(lambda got: len(got) == 2)) == 2


def test_otlp_http_exporter_is_configured_from_the_deployment():
    exporter = create_exporter(
        TelemetryConfig(exporter="otlp_http", endpoint="http://collector:4318/v1/traces")
    )
    assert type(exporter).__module__.startswith("opentelemetry.exporter.otlp.proto.http")
    exporter.shutdown()


def test_receiver_in_its_own_process_counts_what_it_is_sent():
    with ReceiverProcess() as receiver:
        receiver.start()
        config = TelemetryConfig(exporter="otlp_grpc", endpoint=receiver.endpoint)
        tracing = Tracing.from_config(config, "splitserve-test")
        for i in range(7):
            tracing.tracer.start_span(f"s{i}").end()
        tracing.shutdown()
        assert receiver.span_count() == 7
    assert receiver._process is None  # stopped and reaped
