"""Noticing a client leave while its request waits (in the admission queue, for the first
token, for a whole reply): the wait is cancelled and `ClientDisconnected` raised."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed the connection before the response was complete."""


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
