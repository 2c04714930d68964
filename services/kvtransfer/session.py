"""One side of one transfer, owned until its blocks are given back exactly once.

Both the prefill and the decode side wrap their handle in a ``TransferSession`` with a
release callback for their own block manager. Whatever ends the transfer (done, failure,
deadline, abort, an exception in the caller leaving a ``with`` block, the control plane
dropping the request) the callback runs once, after the backend has fenced the blocks.
The decode side's callback gets the final state so it can keep the blocks on DONE and
free them otherwise.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

from services.kvtransfer.interface import TransferBackend
from services.kvtransfer.types import TransferHandle, TransferState

ReleaseCallback = Callable[[TransferState], None]

_MIN_POLL_S = 0.0005
_MAX_POLL_S = 0.002  # a transfer finishing is noticed within 2 ms (it sets TTFT)


class TransferSession:
    def __init__(
        self, backend: TransferBackend, handle: TransferHandle, on_release: ReleaseCallback
    ):
        self.backend = backend
        self.handle = handle
        self._on_release = on_release
        self._lock = threading.Lock()
        self._released = False

    @property
    def request_id(self) -> str:
        return self.handle.request_id

    @property
    def state(self) -> TransferState:
        return self.handle.state

    @property
    def released(self) -> bool:
        return self._released

    def poll(self) -> TransferState:
        """Polls the backend; the first time a terminal state is seen, releases."""
        state = self.backend.poll(self.handle)
        if state.terminal:
            self._release()
        return state

    def abort(self) -> None:
        self.backend.abort(self.handle)
        self._release()

    def close(self) -> None:
        """Ends the session however far it got: aborts if pending, then releases."""
        if not self.handle.state.terminal:
            self.backend.abort(self.handle)
        self._release()

    def wait(self, max_poll_interval_s: float = _MAX_POLL_S) -> TransferState:
        """Blocks until terminal; bounded by the handle's deadline. Polls back off to
        ``max_poll_interval_s``; 0 spins, for benchmarks that time small transfers."""
        delay = min(_MIN_POLL_S, max_poll_interval_s)
        while not (state := self.poll()).terminal:
            # sleep(0) still drops the GIL, which the tcp/shm worker threads need to run.
            time.sleep(delay)
            delay = min(delay * 2, max_poll_interval_s)
        return state

    async def wait_async(self) -> TransferState:
        """Like ``wait`` for an event loop: the fence wait runs off the loop, the callback on it."""
        delay = _MIN_POLL_S
        while not self.backend.poll(self.handle).terminal:
            await asyncio.sleep(delay)
            delay = min(delay * 2, _MAX_POLL_S)
        if self._claim():
            try:
                await asyncio.to_thread(self.backend.release, self.request_id)
            finally:
                self._on_release(self.handle.state)
        return self.handle.state

    def _claim(self) -> bool:
        with self._lock:
            if self._released:
                return False
            self._released = True
            return True

    def _release(self) -> None:
        if not self._claim():
            return
        try:
            self.backend.release(self.request_id)
        finally:
            self._on_release(self.handle.state)

    def __enter__(self) -> TransferSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
