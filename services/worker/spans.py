"""A worker's spans for one Prefill or Decode call, children of the coordinator's spans
(through the W3C context in the call's metadata).

The engine thread never creates spans: it fills a `RequestTimeline`, and when the call ends
its queueing, each prefill chunk and the decode admission become child spans with the
timestamps the engine recorded.
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from services.worker.engine_metrics import PRIORITY_TIERS
from services.worker.engine_steps import RequestTimeline, StepRecorder
from shared.proto_gen import worker_pb2 as pb
from shared.telemetry import attributes as A
from shared.telemetry.propagation import context_from_grpc
from shared.telemetry.tracing import Tracing

_RPC_SERVICE = "splitserve.worker.v1.Worker"


class WorkerTracing:
    def __init__(
        self, tracing: Tracing, recorder: StepRecorder, *, replica: str, role: str, model: str
    ):
        self.tracer = tracing.tracer
        self.recorder = recorder
        self.common = {A.REPLICA: replica, A.ROLE: role, A.REQUEST_MODEL: model}

    def prefill(self, request: pb.PrefillRequest, metadata) -> PrefillTrace:
        return PrefillTrace(self, request, metadata)

    def decode(self, request: pb.DecodeRequest, metadata) -> DecodeTrace:
        return DecodeTrace(self, request, metadata)


class _CallTrace(ABC):
    """A server span around one call, plus the request's engine timeline while it runs."""

    name = ""
    method = ""

    def __init__(self, owner: WorkerTracing, generation: pb.Generation, metadata: Iterable | None):
        self.owner = owner
        self.request_id = generation.request_id
        self.tier = PRIORITY_TIERS.get(generation.priority, str(generation.priority))
        self.span = owner.tracer.start_span(
            self.name,
            context=context_from_grpc(metadata),
            kind=SpanKind.SERVER,
            attributes={
                **owner.common,
                A.RPC_SYSTEM: "grpc",
                A.RPC_SERVICE: _RPC_SERVICE,
                A.RPC_METHOD: self.method,
                A.TIER: self.tier,
                A.USAGE_INPUT_TOKENS: len(generation.prompt_token_ids),
            },
        )
        self.recording = self.span.is_recording()
        self.timeline: RequestTimeline | None = None
        # When the call's last message was handed to gRPC: the call ends there for the
        # caller, who may close its own span before this handler's generator resumes.
        self.last_sent_ns: int | None = None
        # Whether the call's final message has left: a caller that hangs up after it (the
        # coordinator cancels a finished stream) did not cut this call short.
        self.completed = False

    def __enter__(self):
        if self.recording:
            self.timeline = self.owner.recorder.watch(self.request_id)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # The call ended when its last message left (or now, if it ended otherwise):
        # resuming this handler after that write, and building its engine spans below, is
        # bookkeeping after it and must not stretch the span past the caller's own span.
        ended_ns = time.time_ns()
        if self.completed and isinstance(exc, asyncio.CancelledError | GeneratorExit):
            exc = None
        if exc is None and self.last_sent_ns is not None:
            ended_ns = self.last_sent_ns
        self.owner.recorder.unwatch(self.request_id)
        if exc is not None:
            if isinstance(exc, asyncio.CancelledError | GeneratorExit):
                self.span.set_attribute("splitserve.cancelled", True)
            else:
                self.span.record_exception(exc)
                self.span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        if self.recording and self.timeline is not None:
            self._engine_spans(self.timeline)
        self._before_end()
        self.span.end(end_time=ended_ns)

    def _before_end(self) -> None:  # noqa: B027 - most calls keep nothing for the end
        """What a call kept off its hot path to put on its span at the end."""

    @abstractmethod
    def _engine_spans(self, timeline: RequestTimeline) -> None:
        """The spans of what the engine did for this call (prefill chunks or decode steps)."""

    def _child(self, name: str, start_ns: int, end_ns: int, attributes: dict[str, Any]) -> None:
        span = self.owner.tracer.start_span(
            name,
            context=trace.set_span_in_context(self.span),
            start_time=start_ns,
            attributes=attributes,
        )
        span.end(end_time=max(start_ns, end_ns))

    def _prefill_spans(self, timeline: RequestTimeline) -> None:
        """Queueing, then one span per prefill chunk (as the engine thread timed them)."""
        if timeline.first_step_ns is not None:
            self._child(
                A.SPAN_QUEUE, timeline.watched_ns, timeline.first_step_ns, {A.TIER: self.tier}
            )
        for index, chunk in enumerate(timeline.chunks):
            self._child(
                A.SPAN_CHUNK,
                chunk.start_ns,
                chunk.end_ns,
                {
                    A.CHUNK_INDEX: index,
                    A.CHUNK_TOKENS: chunk.num_tokens,
                    A.BATCH_SIZE: chunk.batch_size,
                    A.BATCH_TOKENS: chunk.batch_tokens,
                },
            )
        self.span.set_attribute("splitserve.prefill.chunks", timeline.num_chunks)
        if timeline.preemptions:
            self.span.set_attribute(A.PREEMPTIONS, timeline.preemptions)


class PrefillTrace(_CallTrace):
    name = A.SPAN_PREFILL
    method = "Prefill"

    def __init__(self, owner: WorkerTracing, request: pb.PrefillRequest, metadata):
        super().__init__(owner, request.generation, metadata)
        self._first: tuple[pb.PrefillFirstToken, int] | None = None

    def record_first_token(self, first: pb.PrefillFirstToken) -> None:
        """The first token, as it leaves for the coordinator (the push starts after): its
        time now, its attributes when the call ends (they would delay the token)."""
        self.last_sent_ns = time.time_ns()
        if self.recording:
            self._first = (first, self.last_sent_ns)

    def _before_end(self) -> None:
        if self._first is None:
            return
        first, sent_ns = self._first
        cached = first.num_cached_tokens
        self.span.set_attributes(
            {
                A.CACHED_TOKENS: cached,
                A.COMPUTED_TOKENS: max(0, first.num_prompt_tokens - cached),
                A.USAGE_OUTPUT_TOKENS: 1,
                A.RESPONSE_FINISH_REASONS: [first.finish_reason] if first.finished else [],
            }
        )
        self.span.add_event(A.EVENT_FIRST_TOKEN, timestamp=sent_ns)

    def record_transfer(self, t: pb.TransferOutcome) -> None:
        """The KV push's outcome: its span ends now (the push was the call's last part)."""
        now = time.time_ns()
        self.last_sent_ns = now
        self.completed = True
        if not self.recording or not t.status or t.status == "skipped":
            return
        attributes = {
            A.TRANSFER_BACKEND: t.backend,
            A.TRANSFER_BYTES: t.nbytes,
            A.TRANSFER_BLOCKS: t.num_blocks,
            A.TRANSFER_STATUS: t.status,
            A.TRANSFER_SECONDS: t.seconds,
        }
        self.span.set_attributes(attributes)
        span = self.owner.tracer.start_span(
            A.SPAN_TRANSFER,
            context=trace.set_span_in_context(self.span),
            start_time=now - int(t.seconds * 1e9),
            attributes=attributes,
        )
        if t.status != "done":
            span.set_attribute(A.TRANSFER_ERROR, t.error)
            span.set_status(Status(StatusCode.ERROR, f"KV transfer {t.status}: {t.error}"))
        span.end(end_time=now)

    def _engine_spans(self, timeline: RequestTimeline) -> None:
        self._prefill_spans(timeline)


class DecodeTrace(_CallTrace):
    name = A.SPAN_DECODE
    method = "Decode"

    def __init__(self, owner: WorkerTracing, request: pb.DecodeRequest, metadata):
        super().__init__(owner, request.generation, metadata)
        self.local_prefill = False
        self.chunks_seen = 0
        self.kv_wait_ns = 0
        if self.recording:
            self.span.set_attribute(A.KV_TRANSFERRED, request.kv_transferred)

    def observe(self, chunk: pb.DecodeChunk) -> None:
        if not self.recording:
            return
        if chunk.handed_over:  # no tokens: the stream goes on elsewhere
            self.last_sent_ns = time.time_ns()
            self.span.add_event(
                A.EVENT_HANDED_OVER, {"reason": chunk.handed_over}, timestamp=self.last_sent_ns
            )
            return
        self.chunks_seen += 1
        if self.chunks_seen == 1:
            self.local_prefill = chunk.local_prefill
            self.kv_wait_ns = int(chunk.kv_wait_ms * 1e6)
            if chunk.kv_wait_ms:
                self.span.set_attribute(A.KV_WAIT_MS, chunk.kv_wait_ms)
            self.span.add_event(A.EVENT_FIRST_TOKEN, timestamp=time.time_ns())
        if chunk.finished:
            self.completed = True
            self.span.set_attributes(
                {
                    A.LOCAL_PREFILL: chunk.local_prefill,
                    A.CACHED_TOKENS: chunk.num_cached_tokens,
                    A.USAGE_OUTPUT_TOKENS: chunk.num_output_tokens,
                    A.RESPONSE_FINISH_REASONS: [chunk.finish_reason],
                }
            )
            self.last_sent_ns = time.time_ns()
            self.span.add_event(A.EVENT_STREAM_END, timestamp=self.last_sent_ns)

    def _engine_spans(self, timeline: RequestTimeline) -> None:
        admitted_ns = timeline.watched_ns
        if self.kv_wait_ns:
            # The call came while the KV was still on its way and waited for it first.
            admitted_ns += self.kv_wait_ns
            self._child(A.SPAN_KV_WAIT, timeline.watched_ns, admitted_ns, {})
        if self.local_prefill or timeline.chunks:
            self._prefill_spans(timeline)
        elif timeline.first_step_ns is not None:
            # KV arrived from a prefill replica: admission is the wait to join the batch.
            self._child(A.SPAN_ADMISSION, admitted_ns, timeline.first_step_ns, {})
        steps: dict[str, int | float] = {A.DECODE_STEPS: timeline.decode_steps}
        if timeline.mean_decode_batch is not None:
            steps[A.DECODE_MEAN_BATCH] = round(timeline.mean_decode_batch, 2)
        self.span.set_attributes(steps)
        if timeline.first_decode_ns is not None and timeline.last_decode_ns is not None:
            # One span for all decode steps (a span per token would cost more than the token).
            self._child(
                A.SPAN_DECODE_STEPS, timeline.first_decode_ns, timeline.last_decode_ns, steps
            )
