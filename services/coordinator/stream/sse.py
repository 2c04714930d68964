"""Server-sent events: one event's text, the stream's end, and a response that always notices
the client leaving and always closes its source.

A client that goes away must free its request's resources promptly (a long prefill queued for
nobody costs everyone's TTFT), so the response watches for the disconnect itself rather than
waiting to fail on the next write: closing the body's iterator aborts the requests.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


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
