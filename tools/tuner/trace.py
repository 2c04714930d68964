"""Request traces: Mooncake JSONL (with prefix block ids) and Azure CSV, parsed into arrays.

A trace is what the simulator replays: arrival time, prompt and output length per request,
and, where the format has them, the ids of the prompt's prefix blocks (two requests share a
prefix exactly as far as their leading ids agree). Bad input is answered with the file and
line it came from.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import numpy as np

from tools.tuner.trace_formats import TraceError, parse_azure_csv, parse_mooncake_jsonl

TraceFormat = Literal["mooncake", "azure", "synthetic"]

# Mooncake's block ids each stand for this many tokens of the original tokenizer.
MOONCAKE_BLOCK_TOKENS = 512

__all__ = ["Trace", "TraceError", "load_trace", "MOONCAKE_BLOCK_TOKENS"]


@dataclass(frozen=True)
class Trace:
    name: str
    format: TraceFormat
    arrival_ms: np.ndarray  # float64, non-decreasing, first request at 0
    input_tokens: np.ndarray  # int64, >= 1
    output_tokens: np.ndarray  # int64, >= 1
    hash_ids: list[tuple[int, ...]] | None = None  # prefix block ids, when the format has them
    block_tokens: float = MOONCAKE_BLOCK_TOKENS  # tokens one block id stands for
    clipped: int = 0  # requests whose lengths were cut to fit the model's context

    def __post_init__(self) -> None:
        n = len(self.arrival_ms)
        if not (len(self.input_tokens) == len(self.output_tokens) == n):
            raise ValueError("trace arrays differ in length")
        if self.hash_ids is not None and len(self.hash_ids) != n:
            raise ValueError("trace hash_ids differ in length from its requests")

    def __len__(self) -> int:
        return len(self.arrival_ms)

    @property
    def duration_s(self) -> float:
        return float(self.arrival_ms[-1]) / 1e3 if len(self) else 0.0

    @property
    def requests_per_s(self) -> float:
        return len(self) / self.duration_s if self.duration_s > 0 else float("inf")

    def scaled(
        self,
        time_scale: float = 1.0,
        length_scale: float = 1.0,
        max_context: int | None = None,
    ) -> Trace:
        """Stretch inter-arrival times by `time_scale` (2 = half the request rate) and multiply
        prompt and output lengths by `length_scale`, then cut requests that would not fit in
        `max_context` tokens (prompt first cut to leave room for its output)."""
        if time_scale <= 0 or length_scale <= 0:
            raise ValueError("time and length scales must be positive")
        inputs = np.maximum(1, np.rint(self.input_tokens * length_scale)).astype(np.int64)
        outputs = np.maximum(1, np.rint(self.output_tokens * length_scale)).astype(np.int64)
        clipped = self.clipped
        if max_context is not None:
            outputs_cut = np.minimum(outputs, max_context // 2)
            inputs_cut = np.minimum(inputs, max_context - outputs_cut)
            clipped += int(np.count_nonzero((inputs_cut != inputs) | (outputs_cut != outputs)))
            inputs, outputs = inputs_cut, outputs_cut
        return replace(
            self,
            arrival_ms=self.arrival_ms * time_scale,
            input_tokens=inputs,
            output_tokens=outputs,
            block_tokens=self.block_tokens * length_scale,
            clipped=clipped,
        )

    def window(self, start: int, count: int) -> Trace:
        """`count` requests from index `start`, arrivals shifted so the first is at 0."""
        sl = slice(start, start + count)
        arrivals = self.arrival_ms[sl]
        return replace(
            self,
            arrival_ms=arrivals - (arrivals[0] if len(arrivals) else 0.0),
            input_tokens=self.input_tokens[sl],
            output_tokens=self.output_tokens[sl],
            hash_ids=self.hash_ids[sl] if self.hash_ids is not None else None,
        )

    def summary(self) -> dict:
        return {
            "name": self.name,
            "format": self.format,
            "requests": len(self),
            "duration_s": self.duration_s,
            "requests_per_s": self.requests_per_s,
            "mean_input_tokens": float(self.input_tokens.mean()) if len(self) else 0.0,
            "mean_output_tokens": float(self.output_tokens.mean()) if len(self) else 0.0,
            "clipped_requests": self.clipped,
        }


def load_trace(path: str | Path) -> Trace:
    """Parse a Mooncake JSONL or Azure CSV trace, telling the format from its first line."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise TraceError(f"{path}: trace file does not exist") from None
    except UnicodeDecodeError:
        raise TraceError(f"{path}: not a text file (expected JSONL or CSV)") from None
    lines = text.splitlines()
    first = next(((i, line.strip()) for i, line in enumerate(lines, 1) if line.strip()), None)
    if first is None:
        raise TraceError(f"{path}: the trace is empty")
    lineno, head = first
    if head.startswith("{"):
        rows = parse_mooncake_jsonl(lines, str(path))
        fmt: TraceFormat = "mooncake"
    elif "ContextTokens" in head or "TIMESTAMP" in head.upper():
        rows = parse_azure_csv(lines, str(path))
        fmt = "azure"
    else:
        raise TraceError(
            f"{path}:{lineno}: unknown trace format: expected Mooncake JSONL "
            '({"timestamp": ..., "input_length": ..., "output_length": ..., "hash_ids": [...]}) '
            "or an Azure CSV with the header TIMESTAMP,ContextTokens,GeneratedTokens"
        )
    if not rows.arrival_ms:
        raise TraceError(f"{path}: the trace has a header but no requests")
    arrivals = np.asarray(rows.arrival_ms, dtype=np.float64)
    order = np.argsort(arrivals, kind="stable")  # a few traces are not sorted by time
    hash_ids = [rows.hash_ids[i] for i in order] if rows.hash_ids is not None else None
    arrivals = arrivals[order]
    return Trace(
        name=path.name,
        format=fmt,
        arrival_ms=arrivals - arrivals[0],
        input_tokens=np.asarray(rows.input_tokens, dtype=np.int64)[order],
        output_tokens=np.asarray(rows.output_tokens, dtype=np.int64)[order],
        hash_ids=hash_ids,
    )
