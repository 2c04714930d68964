"""Streaming /v1/completions for the live check: the time of every token that carries text."""

from __future__ import annotations

import time

import httpx

from tools.bench.load import (
    RequestTiming,
    completion_token,
    stream_events,
    stream_timing,
)


async def stream_completion(
    client: httpx.AsyncClient, url: str, body: dict, timeout_s: float = 600.0
) -> RequestTiming:
    """tools.bench.load's timing of one streamed request, for /v1/completions."""
    return await stream_timing(client, url, body, "replay", completion_token, timeout_s)


async def collect_token_times(
    client: httpx.AsyncClient, url: str, body: dict, times: list[float]
) -> None:
    """Append the perf_counter time of every text-carrying token to `times` as it arrives
    (the list keeps what came before a cancellation). A failed request raises StreamError."""
    async for data in stream_events(client, url, body, timeout_s=600.0):
        if any(completion_token(choice) for choice in data.get("choices", [])):
            times.append(time.perf_counter())
