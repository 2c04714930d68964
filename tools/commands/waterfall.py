"""A request's trace as a terminal waterfall: the span tree in start order, each span's
offset and duration, a bar on a shared time axis, and the gaps no child span accounts for
(time spent somewhere nobody measured: queues, network, the event loop)."""

from __future__ import annotations

import datetime as dt
from collections import defaultdict
from dataclasses import dataclass

from shared.telemetry.records import SpanRecord

_SHOWN_PREFIXES = ("gen_ai.", "splitserve.", "http.response", "error.")


@dataclass
class TraceSummary:
    trace_id: str
    start_ns: int
    end_ns: int
    root_name: str
    num_spans: int
    services: list[str]
    errors: int

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


def group_traces(spans: list[SpanRecord]) -> dict[str, list[SpanRecord]]:
    traces: dict[str, list[SpanRecord]] = defaultdict(list)
    for s in spans:
        traces[s.trace_id].append(s)
    return dict(traces)


def summarize(trace: list[SpanRecord]) -> TraceSummary:
    roots = _roots(trace)
    return TraceSummary(
        trace_id=trace[0].trace_id,
        start_ns=min(s.start_ns for s in trace),
        end_ns=max(s.end_ns for s in trace),
        root_name=roots[0].name if roots else trace[0].name,
        num_spans=len(trace),
        services=sorted({_short(s.service) for s in trace}),
        errors=sum(s.is_error for s in trace),
    )


def latest_traces(spans: list[SpanRecord], n: int) -> list[list[SpanRecord]]:
    """The `n` traces that started last, oldest first."""
    traces = sorted(group_traces(spans).values(), key=lambda t: min(s.start_ns for s in t))
    return traces[-n:] if n > 0 else []


def render(trace: list[SpanRecord], width: int = 120, verbose: bool = False) -> str:
    """The waterfall of one trace (all its spans, any order)."""
    info = summarize(trace)
    t0, total = info.start_ns, max(1, info.end_ns - info.start_ns)
    bar_width = max(20, width - 74)
    gap_floor = max(1_000_000, total // 50)  # gaps under 1 ms or 2% of the trace are noise
    when = dt.datetime.fromtimestamp(t0 / 1e9, tz=dt.UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
    lines = [
        f"trace {info.trace_id}  {when} UTC  {info.duration_ms:.1f} ms  "
        f"{info.num_spans} spans  services: {', '.join(info.services)}"
        + (f"  errors: {info.errors}" if info.errors else ""),
        f"{'span':<44} {'service':<12} {'start ms':>8} {'dur ms':>8}  timeline",
    ]
    children = _children(trace)

    def bar(start: int, end: int, fill: str) -> str:
        a = int((start - t0) / total * bar_width)
        b = max(a + 1, int(round((end - t0) / total * bar_width)))
        return " " * a + fill * (min(b, bar_width) - a)

    def row(label: str, service: str, start: int, end: int, fill: str, suffix: str = "") -> str:
        label = label if len(label) <= 44 else label[:43] + "~"
        offset, dur = (start - t0) / 1e6, (end - start) / 1e6
        return (
            f"{label:<44} {service:<12} {offset:>8.1f} {dur:>8.1f}  "
            f"|{bar(start, end, fill):<{bar_width}}|{suffix}"
        )

    def walk(span: SpanRecord, depth: int) -> None:
        pad = "  " * depth
        mark = f"  ! {span.status_message or 'error'}" if span.is_error else ""
        lines.append(
            row(f"{pad}{span.name}", _short(span.service), span.start_ns, span.end_ns, "=", mark)
        )
        if verbose:
            for key, value in sorted(span.attributes.items()):
                if key.startswith(_SHOWN_PREFIXES):
                    lines.append(f"{pad}    {key} = {value}")
        for event in span.events:
            lines.append(row(f"{pad}  * {event.name}", "", event.time_ns, event.time_ns, "*"))
        cursor = span.start_ns
        for child in children.get(span.span_id, []):
            if child.start_ns - cursor >= gap_floor:
                lines.append(row(f"{pad}  - gap", "", cursor, child.start_ns, "-"))
            walk(child, depth + 1)
            cursor = max(cursor, child.end_ns)
        if children.get(span.span_id) and span.end_ns - cursor >= gap_floor:
            lines.append(row(f"{pad}  - gap", "", cursor, span.end_ns, "-"))

    for root in _roots(trace):
        walk(root, 0)
    return "\n".join(lines)


def _children(trace: list[SpanRecord]) -> dict[str, list[SpanRecord]]:
    out: dict[str, list[SpanRecord]] = defaultdict(list)
    for s in trace:
        if s.parent_span_id:
            out[s.parent_span_id].append(s)
    for spans in out.values():
        spans.sort(key=lambda s: (s.start_ns, s.end_ns))
    return out


def _roots(trace: list[SpanRecord]) -> list[SpanRecord]:
    """Spans whose parent is not in the trace: the true root, or orphans of a lost parent."""
    ids = {s.span_id for s in trace}
    roots = [s for s in trace if not s.parent_span_id or s.parent_span_id not in ids]
    return sorted(roots, key=lambda s: s.start_ns)


def _short(service: str) -> str:
    return service.removeprefix("splitserve-")
