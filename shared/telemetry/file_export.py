"""Spans as JSON lines in a local file: tracing on one machine without a collector.

Every process of a local stack appends to the same file. Each batch goes out in one
`write()` on an O_APPEND descriptor, so lines from different processes never interleave
(a regular file's appends are serialised by the kernel).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from shared.telemetry.records import SpanRecord


class JsonLinesSpanExporter(SpanExporter):
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = "".join(
            json.dumps(SpanRecord.from_readable(s).to_json(), separators=(",", ":"), default=str)
            + "\n"
            for s in spans
        )
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, lines.encode())
            finally:
                os.close(fd)
        except OSError:
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def read_span_file(path: str | Path) -> list[SpanRecord]:
    """Every complete span in the file; a line being written right now is skipped."""
    spans = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n"):
                break  # another process is mid-write
            try:
                spans.append(SpanRecord.from_json(json.loads(line)))
            except (ValueError, TypeError, KeyError):
                continue  # not one of ours (or truncated by a crash): skip, keep reading
    return spans
