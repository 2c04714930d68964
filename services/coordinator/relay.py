"""Carrying backend streams to a client: merging choices, SSE, noticing the client leave.

A client that goes away must free its request's resources promptly (a long prefill queued
for nobody costs everyone's TTFT), so both paths watch for the disconnect themselves rather
than waiting to fail on the next write: closing the backend iterators aborts the requests.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from services.coordinator.backend import GenerationChunk, GenerationRequest
from services.coordinator.retry import RetryLoop

T = TypeVar("T")

_DONE = object()


class ClientDisconnected(Exception):
    """The client closed the connection before the response was complete."""


class ChoiceStreams:
    """The streams of a request's choices, merged into one `(index, chunk)` stream.

    `next()` raises the first backend error; `close()` (synchronous, so it is safe inside a
    cancelled scope) cancels the pumps, which closes their iterators and aborts the requests.
    """

    def __init__(self, loop: RetryLoop, requests: list[GenerationRequest]):
        self._events: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self._pending = len(requests)
        self._tasks = [
            asyncio.create_task(self._pump(i, loop, req), name=f"pump-{req.request_id}")
            for i, req in enumerate(requests)
        ]

    async def next(self) -> tuple[int, GenerationChunk] | None:
        while self._pending:
            index, item = await self._events.get()
            if item is _DONE:
                self._pending -= 1
                continue
            if isinstance(item, BaseException):
                self._pending = 0
                self.close()
                raise item
            return index, item
        return None

    def close(self) -> None:
        for task in self._tasks:
            if not task.done():
                task.cancel()

    async def _pump(self, index: int, loop: RetryLoop, req: GenerationRequest) -> None:
        stream = loop.generate(req)
        try:
            async for chunk in stream:
                self._events.put_nowait((index, chunk))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._events.put_nowait((index, exc))
            return
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
        self._events.put_nowait((index, _DONE))


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run `work`, cancelling it if the client disconnects first (ClientDisconnected)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        raise ClientDisconnected()
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read, so the next ASGI message can only be the disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class SSEResponse(StreamingResponse):
    """An event stream that always notices the client leaving and always closes its source.

    Starlette only listens for the disconnect on older ASGI spec versions and leaves an
    interrupted body iterator to the garbage collector; here the iterator's cleanup (which
    aborts the backend requests) runs as soon as the client is gone.
    """

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], headers: dict[str, str] | None = None):
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})}
        super().__init__(content, headers=headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    await self.stream_response(send)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        except* OSError:
            pass  # the write failed because the client is gone: same as a disconnect
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
