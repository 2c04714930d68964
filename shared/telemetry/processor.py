"""Export spans off the request path, within a fixed memory bound, and say what was lost.

`on_end` runs on whatever thread ends a span (the event loop, the engine thread): it only
appends to a bounded queue, never waits on the exporter. A background thread exports in
batches. When the collector is slow or gone the queue fills and new spans are dropped and
counted, so an outage costs trace data, never request latency.

Kept: every sampled span, and every span that ended in error even when its trace was not
sampled (the sampler records unsampled spans so that their status is known at the end).

Exporting is Python work (encoding spans) on a thread of the serving process, and Python
runs one thread at a time: a batch encoded while a request is being served delays that
request by the encoding time (measured here: about 1 ms of TTFT per request with OTLP). So
the export thread waits until no request (SERVER span) is open in this process, which in
unloaded gaps is almost always soon, but never longer than `max_defer_s`: under steady load
batches go out at that pace instead, and nothing is lost or reordered.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator

from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector


class BoundedSpanProcessor(SpanProcessor):
    def __init__(
        self,
        exporter: SpanExporter,
        max_queue_size: int = 2048,
        max_batch_size: int = 256,
        interval_s: float = 0.5,
        max_defer_s: float = 2.0,
    ):
        self.exporter = exporter
        self.max_queue_size = max_queue_size
        self.max_batch_size = max_batch_size
        self.interval_s = interval_s
        self.max_defer_s = max_defer_s
        self._queue: deque[ReadableSpan] = deque()
        self._lock = threading.Lock()
        # Notified when the last open request span ends (or a flush or stop is asked for).
        self._quiet = threading.Condition(self._lock)
        self._open_requests: set[int] = set()  # span ids of SERVER spans not yet ended
        self._wake = threading.Event()
        self._stopping = False
        self._flushes: list[threading.Event] = []
        # Plain ints, read by the Prometheus collector; only this object writes them.
        self.dropped_queue_full = 0
        self.dropped_export_failed = 0
        self.exported = 0
        self._thread = threading.Thread(target=self._run, name="span-export", daemon=True)
        self._thread.start()

    # -- the request path --------------------------------------------------------------

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        if span.kind is SpanKind.SERVER and span.context is not None:
            with self._lock:
                self._open_requests.add(span.context.span_id)

    def on_end(self, span: ReadableSpan) -> None:
        if span.kind is SpanKind.SERVER and span.context is not None:
            with self._lock:
                self._open_requests.discard(span.context.span_id)
                if not self._open_requests:
                    self._quiet.notify_all()
        sampled = span.context is not None and span.context.trace_flags.sampled
        if not sampled and span.status.status_code is not StatusCode.ERROR:
            return
        with self._lock:
            if self._stopping or len(self._queue) >= self.max_queue_size:
                self.dropped_queue_full += 1
                return
            self._queue.append(span)
            full_batch = len(self._queue) >= self.max_batch_size
        if full_batch:
            self._wake.set()

    # -- the export thread -------------------------------------------------------------

    def _run(self) -> None:
        while True:
            self._wake.wait(self.interval_s)
            self._wake.clear()
            self._wait_for_quiet()
            with self._lock:
                flushes, self._flushes = self._flushes, []
                stopping = self._stopping
            self._export_queued()
            for done in flushes:
                done.set()
            if stopping:
                return

    def _wait_for_quiet(self) -> None:
        """Until no request is open here, `max_defer_s` has passed, a flush or stop is asked
        for, or the queue is half full (waiting longer would start dropping spans)."""
        deadline = time.monotonic() + self.max_defer_s
        with self._quiet:
            while (
                self._open_requests
                and not self._flushes
                and not self._stopping
                and len(self._queue) < self.max_queue_size // 2
            ):
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._quiet.wait(min(left, self.interval_s))

    def _export_queued(self) -> None:
        while batch := self._take_batch():
            try:
                result = self.exporter.export(batch)
            except Exception:  # an exporter bug must not kill the thread
                result = SpanExportResult.FAILURE
            if result is SpanExportResult.SUCCESS:
                self.exported += len(batch)
            else:
                self.dropped_export_failed += len(batch)

    def _take_batch(self) -> list[ReadableSpan]:
        with self._lock:
            n = min(len(self._queue), self.max_batch_size)
            return [self._queue.popleft() for _ in range(n)]

    # -- lifecycle ---------------------------------------------------------------------

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        done = threading.Event()
        with self._lock:
            if not self._thread.is_alive():
                return not self._queue
            self._flushes.append(done)
            self._quiet.notify_all()
        self._wake.set()
        return done.wait(timeout_millis / 1000)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Export what is queued (bounded by `timeout_s`), then close the exporter."""
        with self._lock:
            self._stopping = True
            self._quiet.notify_all()
        self._wake.set()
        self._thread.join(timeout_s)
        self.exporter.shutdown()

    @property
    def queued(self) -> int:
        return len(self._queue)


class SpanExportCollector(Collector):
    """The processor's counters as Prometheus metrics (register in any number of registries)."""

    def __init__(self, processor: BoundedSpanProcessor):
        self.processor = processor

    def collect(self) -> Iterator[CounterMetricFamily]:
        p = self.processor
        dropped = CounterMetricFamily(
            "splitserve_trace_spans_dropped",
            "Spans lost before reaching the trace backend: export queue full, or export failed",
            labels=["reason"],
        )
        dropped.add_metric(["queue_full"], p.dropped_queue_full)
        dropped.add_metric(["export_failed"], p.dropped_export_failed)
        yield dropped
        yield CounterMetricFamily(
            "splitserve_trace_spans_exported", "Spans handed to the trace backend", p.exported
        )
