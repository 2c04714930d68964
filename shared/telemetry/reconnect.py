"""An OTLP/gRPC exporter that tries a fresh connection after every failed batch.

gRPC keeps one connection per target and, after failed connects, waits longer and longer
(up to two minutes, jittered) before it tries again; a batch sent meanwhile fails at once
and is dropped. So when a collector restarts, every worker would keep losing spans for up
to two minutes after it is back. Here a failed batch replaces the exporter, and with it the
channel (each with a connection of its own, never one shared in the process): the first
batch after the collector returns connects afresh and gets through.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

# Passed to every channel: a connection of its own, and short waits between reconnects
# while an export is still inside its deadline.
OTLP_GRPC_CHANNEL_OPTIONS = (
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2000),
)


class ReconnectingSpanExporter(SpanExporter):
    def __init__(self, make_exporter: Callable[[], SpanExporter]):
        self._make_exporter = make_exporter
        self._exporter = make_exporter()
        self.reconnects = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        result = self._exporter.export(spans)
        if result is not SpanExportResult.SUCCESS:
            # Only the processor's export thread calls this, so no lock is needed.
            self._exporter.shutdown()
            self._exporter = self._make_exporter()
            self.reconnects += 1
        return result

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._exporter.force_flush(timeout_millis)

    def shutdown(self) -> None:
        self._exporter.shutdown()
