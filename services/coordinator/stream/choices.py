"""A request's choices, merged into one stream of `(index, chunk)`, with the first-token hold.

The hold lives here and nowhere else. Streaming, a choice's pump pauses after the chunk that
carries its first token until the caller asks for the next event: by then the caller has
written that token to the client. What the generation backend does next (opening Decode,
reading the transfer's outcome, a span) would otherwise run in front of the token.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from services.coordinator.generation_backend import GenerationChunk, GenerationRequest

# One choice's stream of chunks: the retry loop's `generate`, or a stand-in in tests.
Generate = Callable[[GenerationRequest], AsyncIterator[GenerationChunk]]

_DONE = object()


class ChoiceStreams:
    """`next()` raises the first backend error; `close()` (synchronous, so it is safe inside a
    cancelled scope) cancels the pumps, which closes their iterators and aborts the requests.
    """

    def __init__(self, generate: Generate, requests: list[GenerationRequest], hold_first: bool):
        self._events: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self._pending = len(requests)
        self._written = [asyncio.Event() for _ in requests] if hold_first else None
        self._handed_out: int | None = None  # the choice whose first token `next` returned
        self._tasks = [
            asyncio.create_task(self._pump(i, generate, req), name=f"pump-{req.request_id}")
            for i, req in enumerate(requests)
        ]

    async def next(self) -> tuple[int, GenerationChunk] | None:
        """The next chunk of any choice; None once every choice has ended. Calling it again
        is the caller's word that the chunk it returned last has been written."""
        if self._handed_out is not None and self._written is not None:
            self._written[self._handed_out].set()
            self._handed_out = None
        while self._pending:
            index, item = await self._events.get()
            if item is _DONE:
                self._pending -= 1
                continue
            if isinstance(item, BaseException):
                self._pending = 0
                self.close()
                raise item
            if item.token_ids and self._written is not None and not self._written[index].is_set():
                self._handed_out = index
            return index, item
        return None

    def close(self) -> None:
        for task in self._tasks:
            if not task.done():
                task.cancel()

    async def _pump(self, index: int, generate: Generate, req: GenerationRequest) -> None:
        stream = generate(req)
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
