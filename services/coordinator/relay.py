"""Carrying backend streams to a client: merging choices, SSE, noticing the client leave.

A client that goes away must free its request's resources promptly (a long prefill queued
for nobody costs everyone's TTFT), so both paths watch for the disconnect themselves rather
than waiting to fail on the next write: closing the backend iterators aborts the requests.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

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

    Streaming (`hold_first`), a choice's pump waits after its first token until the caller
    says it is written (`written(index)`): what the backend does next (opening Decode, reading
    the transfer's outcome) would otherwise run first, and the first token would wait for it.
    """

    def __init__(self, loop: RetryLoop, requests: list[GenerationRequest], hold_first: bool):
        self._events: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self._pending = len(requests)
        self._written = [asyncio.Event() for _ in requests] if hold_first else None
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

    def written(self, index: int) -> None:
        """The caller has written choice `index`'s first token: its pump may go on."""
        if self._written is not None:
            self._written[index].set()

    def close(self) -> None:
        for task in self._tasks:
            if not task.done():
                task.cancel()

    async def _pump(self, index: int, loop: RetryLoop, req: GenerationRequest) -> None:
        stream = loop.generate(req)
        held = self._written[index] if self._written is not None else None
        try:
            async for chunk in stream:
                self._events.put_nowait((index, chunk))
                if held is not None and chunk.token_ids:
                    await held.wait()
                    held = None
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._events.put_nowait((index, exc))
            return
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
        self._events.put_nowait((index, _DONE))


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run `work`, cancelling it if the client disconnects first (ClientDisconnected).

    The work is awaited in the caller's own task and a side task watches the connection:
    wrapping the work in a task of its own would put two more turns of the event loop
    between a backend's first token and its relay to the client."""
    caller = asyncio.current_task()
    assert caller is not None
    gone = False

    async def watch() -> None:
        nonlocal gone
        await _wait_for_disconnect(request)
        gone = True
        caller.cancel()

    watcher = asyncio.create_task(watch())
    try:
        return await work
    except asyncio.CancelledError:
        if not gone:
            raise  # cancelled from outside (shutdown): not ours to swallow
        caller.uncancel()
        raise ClientDisconnected() from None
    finally:
        watcher.cancel()
        if asyncio.iscoroutine(work):
            work.close()  # never started (cancelled at once): no "never awaited" warning


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

    def __init__(
        self,
        content: AsyncIterator[str] | None = None,
        headers: dict[str, str] | None = None,
        on_close: Callable[[], None] | None = None,
    ):
        """`content` may be set later (`body_iterator`): a handler builds the response while
        its first event is still on the way."""
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})}
        super().__init__(_nothing() if content is None else content, headers=headers)
        # Runs however the response ends, even if the body never started (a client gone
        # before the headers were written): closing an unstarted generator runs none of its
        # cleanup, and the backend streams it owns would wait on it for ever.
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # The stream is written from this task at once (the first token is in its first
        # chunk); a side task listens for the disconnect and cancels it. Plain asyncio: an
        # anyio task group here cost more than the rest of the first token's relay.
        streaming = asyncio.current_task()
        assert streaming is not None
        gone = asyncio.Event()

        async def listen() -> None:
            await self.listen_for_disconnect(receive)
            gone.set()
            streaming.cancel()

        listener = asyncio.create_task(listen())
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            if not gone.is_set():
                raise  # cancelled from outside (shutdown): not ours to swallow
            streaming.uncancel()
        except OSError:
            pass  # the write failed because the client is gone: same as a disconnect
        finally:
            listener.cancel()
            # The body's cleanup aborts the backend requests; it never waits on the network.
            await _close_quietly(self.body_iterator, streaming, gone)
            if self._on_close is not None:
                self._on_close()


async def _nothing() -> AsyncIterator[str]:
    return
    yield  # an async generator that yields nothing


async def _close_quietly(body: AsyncIterator[str], task: asyncio.Task, gone: asyncio.Event) -> None:
    try:
        await body.aclose()  # type: ignore[attr-defined]
    except asyncio.CancelledError:
        # The listener's cancel landed just as the stream ended on its own: it was for a
        # stream that is over, not for whoever awaits this task.
        if not gone.is_set():
            raise
        task.uncancel()
        await body.aclose()  # type: ignore[attr-defined]
