"""The last finished traces of this process, in memory, for the playground's waterfall.

A bounded ring: at most `max_traces` traces of at most `max_spans_per_trace` spans each;
when a new trace arrives past the limit the oldest one goes. `on_end` runs on whatever thread
ends a span (the request path), so it only files the SDK's span object under its trace id;
turning spans into plain `SpanRecord`s waits until someone asks for them.

Spans of other processes can be added as records (`add_records`): a local stack whose
services all trace to one JSON-lines file has the workers' spans tailed in from it
(`TraceFileTail`), so the waterfall reaches prefill, transfer and decode.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor

from shared.telemetry.records import SpanRecord


@dataclass(frozen=True)
class TraceSummary:
    trace_id: str
    name: str  # the root span's name, "" until the root has ended
    start_ns: int
    duration_ms: float
    num_spans: int
    services: tuple[str, ...]
    errors: int

    def to_json(self) -> dict:
        return {
            "trace_id": self.trace_id,
            "name": self.name,
            "start_ns": self.start_ns,
            "duration_ms": self.duration_ms,
            "num_spans": self.num_spans,
            "services": list(self.services),
            "errors": self.errors,
        }


class RecentTraces(SpanProcessor):
    """A span processor that keeps the newest traces; add it beside the exporting one."""

    def __init__(self, max_traces: int = 200, max_spans_per_trace: int = 256):
        if max_traces < 1 or max_spans_per_trace < 1:
            raise ValueError("max_traces and max_spans_per_trace must be >= 1")
        self.max_traces = max_traces
        self.max_spans_per_trace = max_spans_per_trace
        # trace id (32 hex) -> its spans as ended: SDK spans (ours) or records (tailed in).
        self._traces: OrderedDict[str, list[ReadableSpan | SpanRecord]] = OrderedDict()
        self._lock = threading.Lock()
        self.evicted_traces = 0
        self.dropped_spans = 0  # past max_spans_per_trace

    # -- filling ---------------------------------------------------------------------------

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        if span.context is None:
            return
        self._file(f"{span.context.trace_id:032x}", span)

    def add_records(self, records: Iterable[SpanRecord]) -> None:
        for record in records:
            self._file(record.trace_id, record)

    def _file(self, trace_id: str, span: ReadableSpan | SpanRecord) -> None:
        with self._lock:
            spans = self._traces.get(trace_id)
            if spans is None:
                spans = self._traces[trace_id] = []
                while len(self._traces) > self.max_traces:
                    self._traces.popitem(last=False)
                    self.evicted_traces += 1
            if len(spans) >= self.max_spans_per_trace:
                self.dropped_spans += 1
                return
            spans.append(span)

    # -- reading ---------------------------------------------------------------------------

    def trace(self, trace_id: str) -> list[SpanRecord] | None:
        """One trace's spans by start time; None when it is not (or no longer) kept."""
        with self._lock:
            spans = self._traces.get(trace_id.lower())
            if spans is None:
                return None
            # Converted once, in place: the page asks for the same traces again and again.
            spans[:] = [_record(s) for s in spans]
            records: list[SpanRecord] = list(spans)  # type: ignore[arg-type]
        return sorted(records, key=lambda r: (r.start_ns, r.end_ns))

    def trace_ids(self) -> list[str]:
        """Every kept trace id, newest first."""
        with self._lock:
            return list(reversed(self._traces))

    def summaries(self, limit: int | None = None) -> list[TraceSummary]:
        """The newest traces whose root span has ended (finished requests), newest first."""
        out = []
        for trace_id in self.trace_ids():
            records = self.trace(trace_id)
            if not records:
                continue
            root = _root(records)
            if root is None:
                continue  # still running: its request span has not ended
            out.append(_summarize(trace_id, records, root))
            if limit is not None and len(out) >= limit:
                break
        return out

    def __len__(self) -> int:
        return len(self._traces)

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def _record(span: ReadableSpan | SpanRecord) -> SpanRecord:
    return span if isinstance(span, SpanRecord) else SpanRecord.from_readable(span)


def _root(records: list[SpanRecord]) -> SpanRecord | None:
    """The request span: a SERVER span whose parent is not here (none, or the client's)."""
    ids = {r.span_id for r in records}
    for r in records:  # by start time: the outermost comes first
        if r.kind == "SERVER" and r.parent_span_id not in ids:
            return r
    return None


def _summarize(trace_id: str, records: list[SpanRecord], root: SpanRecord) -> TraceSummary:
    start = min(r.start_ns for r in records)
    end = max(r.end_ns for r in records)
    return TraceSummary(
        trace_id=trace_id,
        name=root.name,
        start_ns=start,
        duration_ms=(end - start) / 1e6,
        num_spans=len(records),
        services=tuple(sorted({r.service for r in records})),
        errors=sum(r.is_error for r in records),
    )


class TraceFileTail:
    """Reads what other processes appended to a JSON-lines trace file since the last call
    (only the new bytes: a long-lived file costs nothing per read) into `RecentTraces`."""

    def __init__(self, path: str | Path, into: RecentTraces, skip_pid: int | None = None):
        self.path = Path(path)
        self.into = into
        self.skip_pid = skip_pid  # our own spans are in memory already
        self._offset: int | None = None
        self._lock = threading.Lock()

    def start_at_end(self) -> None:
        """Spans written before this process started belong to older runs: skip them."""
        try:
            self._offset = self.path.stat().st_size
        except FileNotFoundError:
            self._offset = 0

    def poll(self) -> int:
        """Spans added; lines still being written are left for the next poll."""
        with self._lock:
            if self._offset is None:
                self.start_at_end()
            try:
                with open(self.path, "rb") as f:
                    f.seek(self._offset)
                    data = f.read()
            except FileNotFoundError:
                return 0
            complete = data[: data.rfind(b"\n") + 1]
            self._offset += len(complete)
        records = []
        for line in complete.splitlines():
            try:
                record = SpanRecord.from_json(json.loads(line))
            except (ValueError, TypeError, KeyError):
                continue  # not one of ours: skip, keep reading
            if self.skip_pid is not None and record.resource.get("process.pid") == self.skip_pid:
                continue
            records.append(record)
        self.into.add_records(records)
        return len(records)
