"""What the engine thread records (step metrics, per-request timelines) and the worker spans
built from it: queueing, one span per prefill chunk, the transfer, decode admission."""

from __future__ import annotations

import asyncio

import pytest
from opentelemetry import trace as otel_trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine.core.config import EngineConfig
from engine.core.engine import Engine
from services.worker.engine_metrics import EngineMetrics
from services.worker.engine_steps import StepRecorder
from services.worker.spans import WorkerTracing
from shared.proto_gen import worker_pb2 as pb
from shared.sampling.params import SamplingParams
from shared.telemetry.propagation import grpc_metadata
from shared.telemetry.tracing import Tracing

PROMPT = list(range(3, 43))  # 40 tokens: chunks of 16, 16, 8


@pytest.fixture
def engine(tiny_model):
    config = EngineConfig(num_blocks=32, max_model_len=256, max_num_batched_tokens=16)
    return Engine(config, model=tiny_model)


@pytest.fixture
def setup(engine):
    registry = CollectorRegistry()
    metrics = EngineMetrics(registry, engine, "tiny", "prefill")
    recorder = StepRecorder(metrics)
    engine.step_observers.append(recorder)
    exporter = InMemorySpanExporter()
    tracing = Tracing.with_exporter(exporter, "splitserve-prefill", "w0")
    spans = WorkerTracing(tracing, recorder, replica="w0", role="prefill", model="tiny")
    yield engine, registry, recorder, spans, tracing, exporter
    tracing.shutdown()


def _families(registry) -> dict:
    text = generate_latest(registry).decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def _value(families, name, **labels) -> float:
    return sum(
        s.value
        for s in families[name].samples
        if s.name in (name, name + "_total") and labels.items() <= s.labels.items()
    )


def _run(engine, request_id, max_tokens=4, priority=1):
    engine.add_request(
        PROMPT,
        SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0),
        request_id=request_id,
        priority=priority,
    )
    while engine.has_work:
        engine.step()


def test_timeline_records_chunks_and_counts_decode_steps(engine):
    recorder = StepRecorder()
    engine.step_observers.append(recorder)
    timeline = recorder.watch("a")
    _run(engine, "a", max_tokens=5)
    _run(engine, "unwatched")
    assert [c.num_tokens for c in timeline.chunks] == [16, 16, 8]
    assert timeline.num_chunks == 3
    assert timeline.decode_steps == 4  # the first token comes with the last chunk
    assert timeline.mean_decode_batch == 1.0
    starts = [c.start_ns for c in timeline.chunks]
    assert starts == sorted(starts) and timeline.first_step_ns == starts[0]
    assert all(c.end_ns >= c.start_ns for c in timeline.chunks)
    assert timeline.watched_ns <= timeline.first_step_ns
    assert timeline.first_decode_ns >= timeline.chunks[-1].end_ns
    recorder.unwatch("a")
    recorder.unwatch("never-watched")  # harmless


def test_a_failing_observer_does_not_fail_the_step(engine):
    def broken(batch, start, end):
        raise RuntimeError("metrics bug")

    engine.step_observers.append(StepRecorder(broken))
    _run(engine, "a")  # completes
    assert not engine.has_work


def test_step_metrics(setup):
    engine, registry, *_ = setup
    _run(engine, "a", priority=2)
    _run(engine, "b", priority=0)  # same prompt: its full blocks come from the prefix cache
    f = _families(registry)
    computed = _value(f, "splitserve_prefill_tokens", source="computed")
    cached = _value(f, "splitserve_prefill_tokens", source="cached")
    assert cached == 32  # two full 16-token blocks
    assert computed == 40 + 8
    queue = f["splitserve_request_queue_time_seconds"]
    counts = {s.labels["tier"]: s.value for s in queue.samples if s.name.endswith("_count")}
    assert counts == {"flex": 1.0, "priority": 1.0}
    steps = [s for s in f["splitserve_iteration_batch_size"].samples if s.name.endswith("_count")]
    assert steps[0].value == 3 + 3 + 1 + 3  # chunks + decodes, then 1 chunk + decodes
    assert _value(f, "splitserve_prefix_cache_queries") > 0
    assert _value(f, "splitserve_prefix_cache_hits", tier="device") == 2
    assert _value(f, "splitserve_kv_cache_blocks_total") == 32
    assert _value(f, "splitserve_num_requests_running") == 0
    assert "splitserve_spec_decode_acceptance_length" in f  # registered, fed later
    # What the engine computes with and holds (the choice behind `auto`, when there is one).
    assert (
        _value(f, "splitserve_weights_info", path="decode", format=engine.model.decode_weights) == 1
    )
    held = {s.labels["part"]: s.value for s in f["splitserve_model_memory_bytes"].samples}
    assert held["kv_pool"] == engine.pool.tensor.nbytes
    assert held["embedding+norms"] == engine.model.memory_bytes()["embedding+norms"]
    assert held["embedding+norms"] >= engine.model.embed_tokens.nbytes > 0


def test_the_measured_format_choice_is_in_the_metrics_and_the_report(setup):
    from engine.model.formats import FormatChoice

    engine, registry, *_ = setup
    timings = {"fp32": {"prefill_ms_per_token": 0.5, "decode_b1_ms": 9.0, "decode_b8_ms": 30.0}}
    engine.format_choice = FormatChoice("fp32", "fp32", timings, cached=True)
    report = engine.weights_report()
    assert report["choice"]["timings"] == timings and report["choice"]["cached"] is True
    f = _families(registry)
    assert (
        _value(f, "splitserve_weight_format_measured_ms", format="fp32", measure="decode_b1_ms")
        == 9.0
    )


def _spans(exporter, tracing) -> dict[str, list]:
    tracing.force_flush()
    out: dict[str, list] = {}
    for s in exporter.get_finished_spans():
        out.setdefault(s.name, []).append(s)
    return out


def test_prefill_spans_from_the_engine_timeline(setup):
    engine, _, _, spans, tracing, exporter = setup
    parent = tracing.tracer.start_span("coordinator client span")
    generation = pb.Generation(request_id="r1", prompt_token_ids=PROMPT, priority=2)
    with spans.prefill(pb.PrefillRequest(generation=generation), grpc_metadata(parent)) as call:
        _run(engine, "r1", max_tokens=1, priority=2)
        transfer = pb.TransferOutcome(
            status="done", nbytes=4096, seconds=0.002, backend="shm", num_blocks=3
        )
        call.record_first_token(pb.PrefillFirstToken(num_prompt_tokens=40))
        call.record_transfer(transfer)
    parent.end()
    got = _spans(exporter, tracing)
    (server,) = got["splitserve.prefill"]
    (sampled,) = [e for e in server.events if e.name == "splitserve.first_token"]
    assert server.parent.span_id == parent.get_span_context().span_id
    assert server.kind == otel_trace.SpanKind.SERVER
    assert server.attributes["splitserve.tier"] == "flex"
    assert server.attributes["splitserve.transfer.bytes"] == 4096
    assert server.attributes["gen_ai.usage.input_tokens"] == 40
    children = [s for name, group in got.items() for s in group if name.startswith("splitserve.")]
    children = [s for s in children if s.parent and s.parent.span_id == server.context.span_id]
    names = sorted(s.name for s in children)
    assert names == [
        "splitserve.engine.queue",
        "splitserve.kv_transfer",
        "splitserve.prefill.chunk",
        "splitserve.prefill.chunk",
        "splitserve.prefill.chunk",
    ]
    chunks = sorted(got["splitserve.prefill.chunk"], key=lambda s: s.start_time)
    assert [c.attributes["splitserve.prefill.chunk_tokens"] for c in chunks] == [16, 16, 8]
    assert all(server.start_time <= c.start_time <= c.end_time <= server.end_time for c in chunks)
    (transfer_span,) = got["splitserve.kv_transfer"]
    assert transfer_span.attributes["splitserve.transfer.backend"] == "shm"
    assert sampled.timestamp <= transfer_span.end_time  # the token left before the push ended
    assert transfer_span.end_time - transfer_span.start_time == pytest.approx(2e6, abs=1e3)


def test_failed_transfer_is_an_error_span(setup):
    _, _, _, spans, tracing, exporter = setup
    generation = pb.Generation(request_id="r2", prompt_token_ids=PROMPT)
    with spans.prefill(pb.PrefillRequest(generation=generation), ()) as call:
        failed = pb.TransferOutcome(status="failed", error="no room", backend="tcp", seconds=0.1)
        call.record_first_token(pb.PrefillFirstToken(num_prompt_tokens=40))
        call.record_transfer(failed)
    (span,) = _spans(exporter, tracing)["splitserve.kv_transfer"]
    assert span.status.status_code == otel_trace.StatusCode.ERROR
    assert "no room" in span.status.description


def test_decode_spans_local_prefill_and_outcomes(setup):
    engine, _, _, spans, tracing, exporter = setup
    generation = pb.Generation(request_id="d1", prompt_token_ids=PROMPT)
    with spans.decode(pb.DecodeRequest(generation=generation), ()) as call:
        _run(engine, "d1", max_tokens=3)
        call.observe(pb.DecodeChunk(token_ids=[5], local_prefill=True))
        call.observe(pb.DecodeChunk(token_ids=[6, 7], finished=True, num_output_tokens=3))
    got = _spans(exporter, tracing)
    (server,) = got["splitserve.decode"]
    assert [e.name for e in server.events] == ["splitserve.first_token", "splitserve.stream_end"]
    assert server.attributes["gen_ai.usage.output_tokens"] == 3
    assert server.attributes["splitserve.decode.steps"] == 2
    assert len(got["splitserve.prefill.chunk"]) == 3
    (steps,) = got["splitserve.decode.steps"]
    assert steps.attributes["splitserve.decode.steps"] == 2


def test_a_call_ends_when_its_last_message_leaves_not_when_its_handler_resumes(setup):
    """gRPC resumes a streaming handler only after its last message was written, and the
    caller may close its own span first: the server span must not outlast the caller's."""
    import time

    _, _, _, spans, tracing, exporter = setup
    generation = pb.Generation(request_id="late", prompt_token_ids=PROMPT)
    with spans.decode(pb.DecodeRequest(generation=generation), ()) as call:
        call.observe(pb.DecodeChunk(token_ids=[6], finished=True, num_output_tokens=1))
        sent_ns = time.time_ns()
        time.sleep(0.03)  # the handler resumes late
    with spans.prefill(pb.PrefillRequest(generation=generation), ()) as call:
        call.record_first_token(pb.PrefillFirstToken(num_prompt_tokens=40))
        call.record_transfer(pb.TransferOutcome(status="done", backend="shm", seconds=0.001))
        pushed_ns = time.time_ns()
        time.sleep(0.03)
    with (
        pytest.raises(RuntimeError),
        spans.decode(pb.DecodeRequest(generation=generation), ()) as call,
    ):
        call.observe(pb.DecodeChunk(token_ids=[6], finished=True, num_output_tokens=1))
        time.sleep(0.03)
        failed_ns = time.time_ns()
        raise RuntimeError("failed after its last message")
    got = _spans(exporter, tracing)
    decoded, broken = sorted(got["splitserve.decode"], key=lambda s: s.start_time)
    (stream_end,) = [e for e in decoded.events if e.name == "splitserve.stream_end"]
    assert decoded.end_time == stream_end.timestamp <= sent_ns
    (prefilled,) = got["splitserve.prefill"]
    assert prefilled.end_time <= pushed_ns
    assert broken.end_time >= failed_ns  # an error ends the call when it is raised


def test_decode_admission_when_kv_arrived(setup):
    engine, _, _, spans, tracing, exporter = setup
    generation = pb.Generation(request_id="d2", prompt_token_ids=PROMPT)
    _run(engine, "warm", max_tokens=1)  # not watched
    with spans.decode(pb.DecodeRequest(generation=generation, kv_transferred=True), ()) as call:
        table = engine.reserve_blocks(len(PROMPT))
        params = SamplingParams(max_tokens=3, ignore_eos=True)
        engine.add_prefilled("d2", PROMPT, 9, table, params)
        while engine.has_work:
            engine.step()
        call.observe(pb.DecodeChunk(token_ids=[1, 2], finished=True, num_output_tokens=3))
    got = _spans(exporter, tracing)
    assert "splitserve.prefill.chunk" not in got
    (admission,) = got["splitserve.decode.admission"]
    (server,) = got["splitserve.decode"]
    assert admission.parent.span_id == server.context.span_id
    assert server.attributes["splitserve.kv_transferred"] is True


def test_decode_call_waiting_for_kv_in_flight_has_its_own_span(setup):
    engine, _, _, spans, tracing, exporter = setup
    generation = pb.Generation(request_id="d3", prompt_token_ids=PROMPT)
    with spans.decode(pb.DecodeRequest(generation=generation, kv_transferred=True), ()) as call:
        table = engine.reserve_blocks(len(PROMPT))
        engine.add_prefilled("d3", PROMPT, 9, table, SamplingParams(max_tokens=2, ignore_eos=True))
        while engine.has_work:
            engine.step()
        call.observe(pb.DecodeChunk(token_ids=[1], kv_wait_ms=3.0))
        call.observe(pb.DecodeChunk(token_ids=[2], finished=True, num_output_tokens=2))
    got = _spans(exporter, tracing)
    (server,) = got["splitserve.decode"]
    (wait,) = got["splitserve.decode.kv_wait"]
    (admission,) = got["splitserve.decode.admission"]
    assert wait.parent.span_id == server.context.span_id
    assert wait.start_time >= server.start_time
    assert wait.end_time - wait.start_time == 3_000_000
    assert admission.start_time == wait.end_time  # joining the batch starts once the KV is in
    assert server.attributes["splitserve.decode.kv_wait_ms"] == 3.0


def test_errors_and_cancellation(setup):
    _, _, _, spans, tracing, exporter = setup
    generation = pb.Generation(request_id="e1", prompt_token_ids=PROMPT)
    with pytest.raises(ValueError), spans.prefill(pb.PrefillRequest(generation=generation), ()):
        raise ValueError("bad prompt")
    with (
        pytest.raises(asyncio.CancelledError),
        spans.decode(pb.DecodeRequest(generation=generation), ()),
    ):
        raise asyncio.CancelledError()
    got = _spans(exporter, tracing)
    (failed,) = got["splitserve.prefill"]
    assert failed.status.status_code == otel_trace.StatusCode.ERROR
    (cancelled,) = got["splitserve.decode"]
    assert cancelled.status.status_code == otel_trace.StatusCode.UNSET
    assert cancelled.attributes["splitserve.cancelled"] is True


def test_a_caller_hanging_up_after_the_final_message_did_not_cancel_the_call(setup):
    """The coordinator cancels a stream once it has read the finished chunk; the handler
    then resumes into that cancellation, which must not stretch or mark the span."""
    import time

    _, _, _, spans, tracing, exporter = setup
    generation = pb.Generation(request_id="hung-up", prompt_token_ids=PROMPT)
    with (
        pytest.raises(asyncio.CancelledError),
        spans.decode(pb.DecodeRequest(generation=generation), ()) as call,
    ):
        call.observe(pb.DecodeChunk(token_ids=[6], finished=True, num_output_tokens=1))
        sent_ns = time.time_ns()
        time.sleep(0.03)
        raise asyncio.CancelledError()
    (server,) = _spans(exporter, tracing)["splitserve.decode"]
    assert server.end_time <= sent_ns
    assert "splitserve.cancelled" not in server.attributes
