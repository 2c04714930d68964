"""Streaming /v1/completions for the live check: the time of every token that carries text."""

from __future__ import annotations

import json
import time

import httpx

from services.bench.load import RequestTiming


async def stream_completion(
    client: httpx.AsyncClient, url: str, body: dict, timeout_s: float = 600.0
) -> RequestTiming:
    """Like services.bench.load.stream_chat, for /v1/completions' `text` deltas."""
    timing = RequestTiming("replay")
    start = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", url, json=body, timeout=timeout_s) as resp:
            if resp.status_code != 200:
                timing.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return timing
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    timing.error = data["error"].get("message", "error")
                    break
                for choice in data.get("choices", []):
                    if choice.get("text"):
                        now = time.perf_counter()
                        if last is None:
                            timing.ttft_ms = (now - start) * 1e3
                        else:
                            timing.itl_ms.append((now - last) * 1e3)
                        last = now
                        timing.tokens += 1
    except (TimeoutError, httpx.HTTPError) as exc:
        timing.error = f"{type(exc).__name__}: {exc}"
    timing.e2e_ms = (time.perf_counter() - start) * 1e3
    return timing


async def collect_token_times(
    client: httpx.AsyncClient, url: str, body: dict, times: list[float]
) -> None:
    """Append the perf_counter time of every text-carrying token to `times` as it arrives
    (the list keeps what came before a cancellation)."""
    async with client.stream("POST", url, json=body, timeout=600.0) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if any(choice.get("text") for choice in data.get("choices", [])):
                times.append(time.perf_counter())
