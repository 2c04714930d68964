"""The CPU a request's spans cost, measured in one process without noise from the model:
every span a disaggregated request makes (coordinator, prefill and decode side), built with
the same helpers the services use and exported to a JSON-lines file. Beside the end-to-end
comparison in `bench overhead`, it says what overhead to expect."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from services.coordinator.api.http_span import RequestTrace
from services.coordinator.attempt.rpc_spans import RpcSpan, describe_route
from services.worker.engine_steps import ChunkRecord, StepRecorder
from services.worker.spans import WorkerTracing
from shared.config.schema import TelemetryConfig
from shared.proto_gen import worker_pb2 as pb
from shared.telemetry import attributes as A
from shared.telemetry.tracing import Tracing


def _one_request(tracing: Tracing, workers: WorkerTracing, i: int) -> None:
    now = time.time_ns()
    request = RequestTrace(tracing, {}, "chat", "POST", "/v1/chat/completions")
    with request.active():
        request.describe(
            model="m", tier="default", stream=True, response_id=f"r{i}", choices=1,
            max_tokens=64, temperature=0.7, top_p=1.0, seed=None,
        )  # fmt: skip
        with tracing.tracer.start_as_current_span(A.SPAN_ROUTE) as route:
            describe_route(route, "p0", "d0", ["least loaded"])
        call = RpcSpan(tracing.tracer, A.SPAN_PREFILL, "Prefill", "p0", "127.0.0.1:1")
        generation = pb.Generation(request_id=f"req-{i}", prompt_token_ids=[1] * 64)
        with workers.prefill(pb.PrefillRequest(generation=generation), call.metadata) as prefill:
            timeline = prefill.timeline
            if timeline is not None:
                timeline.first_step_ns = now
                timeline.chunks.append(ChunkRecord(now, now + 1000, 64, 1, 64))
            first = pb.PrefillFirstToken(num_prompt_tokens=64)
            prefill.record_first_token(first)
            call.record_first_token(first)
            request.first_token()
            transfer = pb.TransferOutcome(status="done", nbytes=1 << 20, backend="shm")
            prefill.record_transfer(transfer)
        call.record_transfer(transfer)
        call.end()
        call = RpcSpan(tracing.tracer, A.SPAN_DECODE, "Decode", "d0", "127.0.0.1:2")
        generation = pb.Generation(request_id=f"req-{i}-d", prompt_token_ids=[1] * 64)
        with workers.decode(
            pb.DecodeRequest(generation=generation, kv_transferred=True), call.metadata
        ) as d:
            if d.timeline is not None:
                d.timeline.first_step_ns = d.timeline.first_decode_ns = now
                d.timeline.last_decode_ns, d.timeline.decode_steps = now + 10**6, 63
            for n in range(64):
                chunk = pb.DecodeChunk(token_ids=[n], finished=n == 63, num_output_tokens=n + 1)
                d.observe(chunk)
                call.record_chunk(1, chunk.finished, n + 1)
        request.record_result(
            input_tokens=64, output_tokens=64, cached_tokens=0, finish_reasons=["length"],
            metadata={"replica": "p0->d0"}, outputs=[""],
        )  # fmt: skip
        request.end(200)


def span_cost_ms(requests: int = 300) -> dict:
    """Milliseconds of CPU per request for its spans, creation and export together."""
    with tempfile.TemporaryDirectory() as tmp:
        config = TelemetryConfig(exporter="file", file=str(Path(tmp) / "t.jsonl"))
        tracing = Tracing.from_config(config, "splitserve-bench")
        workers = WorkerTracing(tracing, StepRecorder(), replica="w", role="both", model="m")
        _one_request(tracing, workers, -1)  # imports, first-call caches
        tracing.force_flush()
        start_cpu, start = time.process_time(), time.perf_counter()
        for i in range(requests):
            _one_request(tracing, workers, i)
        tracing.force_flush()
        cpu, wall = time.process_time() - start_cpu, time.perf_counter() - start
        spans = sum(1 for _ in open(config.file))
        tracing.shutdown()
    return {
        "span_cpu_ms_per_request": cpu / requests * 1e3,
        "span_wall_ms_per_request": wall / requests * 1e3,
        "spans_per_request": spans / (requests + 1),
    }
