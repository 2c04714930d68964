"""A bounded open-loop load generator for the local stack: SSE timings per request."""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field

import httpx


@dataclass
class RequestTiming:
    kind: str
    ttft_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str | None = None
    e2e_ms: float = 0.0
    # The server's own count (`usage.completion_tokens`, sent when the request asked for
    # stream_options.include_usage): a chunk may carry several tokens, or one that is no text.
    completion_tokens: int | None = None


class StreamError(Exception):
    """A streamed request that failed: an HTTP error status, or an error event mid-stream."""


async def stream_events(
    client: httpx.AsyncClient, url: str, body: dict, timeout_s: float = 300.0
) -> AsyncIterator[dict]:
    """The JSON payloads of a streamed OpenAI response, in order (without the final [DONE])."""
    async with client.stream("POST", url, json=body, timeout=timeout_s) as resp:
        if resp.status_code != 200:
            raise StreamError(f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                raise StreamError(str(data["error"].get("message", "error")))
            yield data


def chat_token(choice: dict) -> bool:
    """A /v1/chat/completions chunk choice that carries text."""
    return bool(choice.get("delta", {}).get("content"))


def completion_token(choice: dict) -> bool:
    """A /v1/completions chunk choice that carries text."""
    return bool(choice.get("text"))


async def stream_timing(
    client: httpx.AsyncClient,
    url: str,
    body: dict,
    kind: str,
    is_token: Callable[[dict], bool] = chat_token,
    timeout_s: float = 300.0,
) -> RequestTiming:
    """TTFT, inter-token gaps and end-to-end time of one streamed request; a failure is
    recorded in `error`, never raised."""
    timing = RequestTiming(kind)
    start = time.perf_counter()
    last = None
    try:
        async for data in stream_events(client, url, body, timeout_s):
            usage = data.get("usage")
            if usage and usage.get("completion_tokens") is not None:
                timing.completion_tokens = int(usage["completion_tokens"])
            for choice in data.get("choices", []):
                if is_token(choice):
                    now = time.perf_counter()
                    if last is None:
                        timing.ttft_ms = (now - start) * 1e3
                    else:
                        timing.itl_ms.append((now - last) * 1e3)
                    last = now
                    timing.tokens += 1
    except StreamError as exc:
        timing.error = str(exc)
    except (TimeoutError, httpx.HTTPError) as exc:
        timing.error = f"{type(exc).__name__}: {exc}"
    timing.e2e_ms = (time.perf_counter() - start) * 1e3
    return timing


async def stream_chat(
    client: httpx.AsyncClient, url: str, body: dict, kind: str, timeout_s: float = 300.0
) -> RequestTiming:
    return await stream_timing(client, url, body, kind, chat_token, timeout_s)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    k = (len(values) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def summarize(timings: list[RequestTiming], kind: str | None = None) -> dict:
    rows = [t for t in timings if kind is None or t.kind == kind]
    ok = [t for t in rows if t.error is None]
    ttft = [t.ttft_ms for t in ok if t.ttft_ms is not None]
    itl = [x for t in ok for x in t.itl_ms]
    return {
        "requests": len(rows),
        "errors": len(rows) - len(ok),
        "ttft_p50_ms": percentile(ttft, 0.5),
        "ttft_p99_ms": percentile(ttft, 0.99),
        "itl_p50_ms": percentile(itl, 0.5),
        "itl_p99_ms": percentile(itl, 0.99),
        "itl_mean_ms": statistics.fmean(itl) if itl else None,
        "tokens": sum(t.tokens for t in ok),
    }


def filler_text(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    words = (
        "the of and to in is was that for on with as by at from this be an are his but not "
        "river garden window music quiet morning letter travel dinner friend story city light"
    ).split()
    return " ".join(rng.choice(words) for _ in range(n_words))


def timing_samples(timings: Iterable[RequestTiming]) -> dict[str, list[float]]:
    """A `samples` entry from the load generator's per-request timings (errors left out)."""
    ok = [t for t in timings if t.error is None]
    return {
        "ttft_ms": [t.ttft_ms for t in ok if t.ttft_ms is not None],
        "itl_ms": [x for t in ok for x in t.itl_ms],
    }
