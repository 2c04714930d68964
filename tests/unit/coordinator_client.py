"""Driving a coordinator app in-process (httpx over ASGI, no sockets) from synchronous tests."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import httpx

from services.coordinator.api.app import create_app
from services.coordinator.settings import APISettings

T = TypeVar("T")


def run_with_client(
    backend,
    settings: APISettings,
    work: Callable[[httpx.AsyncClient], Awaitable[T]],
    tracing=None,
) -> T:
    app = create_app(backend, settings, tracing) if tracing else create_app(backend, settings)

    async def main() -> T:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://coord") as client:
            return await work(client)

    return asyncio.run(main())


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, **extra}


def sse_events(text: str) -> list[dict]:
    """The JSON payloads of an SSE body (without the final [DONE])."""
    events = []
    for line in text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[len("data: ") :]))
    return events


def meta(body: dict, key: str) -> Any:
    """A structured `metadata` value (sent as a JSON string, as OpenAI's metadata is str->str)."""
    return json.loads(body["metadata"][key])
