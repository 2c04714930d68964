"""Row-by-row parsers of the two trace formats; every error names the file and the line."""

from __future__ import annotations

import csv
import datetime as dt
import json
import math
from dataclasses import dataclass, field


class TraceError(ValueError):
    """A trace that cannot be replayed; the message names the file and, for a row, its line."""


@dataclass
class ParsedRows:
    arrival_ms: list[float] = field(default_factory=list)
    input_tokens: list[int] = field(default_factory=list)
    output_tokens: list[int] = field(default_factory=list)
    hash_ids: list[tuple[int, ...]] | None = None


def _count(value: object, name: str, where: str, minimum: int) -> int:
    """A token count: an integer (or a float with no fraction) >= minimum."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise TraceError(f"{where}: {name} must be an integer, got {value!r}")
    try:
        number = float(value)
    except ValueError:
        raise TraceError(f"{where}: {name} must be an integer, got {value!r}") from None
    if not math.isfinite(number) or number != int(number):
        raise TraceError(f"{where}: {name} must be an integer, got {value!r}")
    if number < minimum:
        raise TraceError(f"{where}: {name} must be >= {minimum}, got {value!r}")
    # A request always yields at least one token; some traces log 0 for an empty reply.
    return max(1, int(number))


def parse_mooncake_jsonl(lines: list[str], origin: str) -> ParsedRows:
    rows = ParsedRows(hash_ids=[])
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{origin}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{where}: not a JSON object: {exc.msg}") from None
        if not isinstance(obj, dict):
            raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        missing = [k for k in ("timestamp", "input_length", "output_length") if k not in obj]
        if missing:
            raise TraceError(f"{where}: missing {', '.join(missing)}")
        stamp = obj["timestamp"]
        if isinstance(stamp, bool) or not isinstance(stamp, int | float) or not stamp >= 0:
            raise TraceError(f"{where}: timestamp must be a number of ms >= 0, got {stamp!r}")
        ids = obj.get("hash_ids", [])
        if not isinstance(ids, list) or not all(
            isinstance(h, int) and not isinstance(h, bool) for h in ids
        ):
            raise TraceError(f"{where}: hash_ids must be a list of integers")
        rows.arrival_ms.append(float(stamp))
        rows.input_tokens.append(_count(obj["input_length"], "input_length", where, 1))
        rows.output_tokens.append(_count(obj["output_length"], "output_length", where, 0))
        rows.hash_ids.append(tuple(ids))
    return rows


_AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def parse_azure_csv(lines: list[str], origin: str) -> ParsedRows:
    rows = ParsedRows()
    reader = csv.reader(lines)
    header = None
    epoch_of_date: dict[str, float] = {}
    for lineno, cells in enumerate(reader, 1):
        if not cells or not any(c.strip() for c in cells):
            continue
        where = f"{origin}:{lineno}"
        if header is None:
            names = [c.strip() for c in cells]
            missing = [c for c in _AZURE_COLUMNS if c not in names]
            if missing:
                raise TraceError(
                    f"{where}: CSV header lacks {', '.join(missing)} "
                    f"(expected {','.join(_AZURE_COLUMNS)})"
                )
            header = [names.index(c) for c in _AZURE_COLUMNS]
            width = len(names)
            continue
        if len(cells) != width:
            raise TraceError(f"{where}: expected {width} columns, got {len(cells)}")
        stamp, context, generated = (cells[i].strip() for i in header)
        rows.arrival_ms.append(_azure_time_ms(stamp, where, epoch_of_date))
        rows.input_tokens.append(_count(context, "ContextTokens", where, 1))
        rows.output_tokens.append(_count(generated, "GeneratedTokens", where, 0))
    if header is None:
        raise TraceError(f"{origin}: the trace is empty")
    return rows


def _azure_time_ms(stamp: str, where: str, cache: dict[str, float]) -> float:
    """'2023-11-16 18:15:46.6805900' (7 fractional digits: too many for datetime) or seconds."""
    try:
        return float(stamp) * 1e3
    except ValueError:
        pass
    date, _, clock = stamp.partition(" ")
    if not clock:
        date, _, clock = stamp.partition("T")
    try:
        if date not in cache:
            day = dt.datetime.strptime(date, "%Y-%m-%d").replace(tzinfo=dt.UTC)
            cache[date] = day.timestamp() * 1e3
        hours, minutes, seconds = clock.split(":")
        in_day = (int(hours) * 60 + int(minutes)) * 60 + float(seconds)
        if not (0 <= in_day < 86401):
            raise ValueError(clock)
    except ValueError:
        raise TraceError(
            f"{where}: TIMESTAMP {stamp!r} is neither 'YYYY-MM-DD HH:MM:SS[.f]' nor seconds"
        ) from None
    return cache[date] + in_day * 1e3
