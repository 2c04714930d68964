"""The engine's step loop on its own thread, with an asyncio face: the one driver of an
`Engine` for every use (the gRPC workers and the in-process generation backend).

The block manager and the scheduler are single-threaded by design; everything that touches
them (admission, aborts, reserving blocks for incoming KV) runs on the engine thread between
steps, submitted through `call`. Outputs reach each request's asyncio queue through
`call_soon_threadsafe`, so a slow consumer never stalls the step loop.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from engine.core.engine import Engine
from engine.core.output import RequestOutput
from shared.sampling.structured import StructuredOutput

log = logging.getLogger(__name__)
T = TypeVar("T")

_IDLE_WAIT_S = 0.05
# After a step that leaves the engine idle (a prefill's first token, a reply's last), the
# event loop thread needs the GIL to send the outputs: the engine thread waits this long for
# commands (holding no GIL) before it runs the step's observers.
_HANDOFF_S = 0.001


class EngineStepError(RuntimeError):
    """The step that carried this request failed (or the engine stopped); it was aborted."""


class AsyncEngine:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="engine-step-loop", daemon=True)
        self.steps = 0
        self.num_failed_steps = 0
        self.last_error: str | None = None

    def start(self) -> None:
        if not self._thread.is_alive():
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._commands.put(lambda: None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    # -- asyncio side --------------------------------------------------------------------

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run fn(engine) on the engine thread; exceptions propagate to the awaiting caller."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()

        def run() -> None:
            try:
                result = fn(self.engine)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller as is
                loop.call_soon_threadsafe(_set_exception, future, exc)
            else:
                loop.call_soon_threadsafe(_set_result, future, result)

        self._commands.put(run)
        return await future

    async def generate(
        self, add: Callable[[Engine], str], structured: StructuredOutput | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Add a request with `add(engine) -> request_id` and stream its outputs.

        `structured`: the request's output constraint, whose grammar is compiled here on a
        helper thread first, so that a new schema never stalls the step loop (the engine
        thread then finds it cached). Leaving the iterator early (client gone,
        cancellation) aborts the request.
        """
        if not self.running:
            raise EngineStepError("the engine thread is not running")
        if structured is not None:
            await asyncio.to_thread(self.engine.constraints.compile, structured)
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()

        def add_and_listen(engine: Engine) -> str:
            request_id = add(engine)
            self._streams[request_id] = (loop, outputs)
            return request_id

        request_id = await self.call(add_and_listen)
        finished = False
        try:
            while True:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request_id)
            self._streams.pop(request_id, None)

    def post(self, fn: Callable[[Engine], object]) -> None:
        """Thread-safe fire-and-forget: run fn(engine) on the engine thread before next step."""

        def run() -> None:
            try:
                fn(self.engine)
            except Exception:
                log.exception("posted engine command failed")

        self._commands.put(run)

    def abort(self, request_id: str) -> None:
        """Thread-safe; the request's blocks are freed before the next step."""

        def run() -> None:
            self._streams.pop(request_id, None)
            self.engine.abort(request_id)

        self._commands.put(run)

    def end_stream(self, request_id: str, why: BaseException) -> None:
        """Thread-safe: abort a streamed request before the next step and raise `why` to its
        consumer once it has read every output delivered before (so it knows exactly which
        tokens were produced). A request not streamed (finished, aborted) is left alone."""

        def run() -> None:
            if request_id in self._streams:
                self._end(request_id, why)

        self._commands.put(run)

    # -- engine thread -------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._drain(block=not self.engine.has_work)
            if self._stop.is_set() or not self.engine.has_work:
                continue
            try:
                outputs = self.engine.step(defer_observers=True)
            except Exception as exc:  # a bug: fail the requests of this step, keep serving
                log.exception("engine step failed")
                self.num_failed_steps += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
                self._fail_all(f"engine step failed: {self.last_error}")
                continue
            self.steps += 1
            for out in outputs:
                self._deliver(out.request_id, out)
            if outputs and not self.engine.has_work:
                self._drain(block=True, timeout=_HANDOFF_S)
            self.engine.notify_observers()
        # Stopping: whoever still waits on a stream hears why instead of hanging.
        self._fail_all("the engine is shutting down")

    def _drain(self, block: bool, timeout: float = _IDLE_WAIT_S) -> None:
        try:
            command = self._commands.get(timeout=timeout) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            command()
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _deliver(self, request_id: str, item: Any) -> None:
        target = self._streams.get(request_id)
        if target is None:
            return  # aborted, or a request nobody streams (a prefill kept for hand-off)
        loop, outputs = target
        if isinstance(item, RequestOutput) and item.finished:
            del self._streams[request_id]
        try:
            loop.call_soon_threadsafe(outputs.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed: nobody is listening
            self._streams.pop(request_id, None)
            self.engine.abort(request_id)

    def _fail_all(self, reason: str) -> None:
        for request_id in list(self._streams):
            self._end(request_id, EngineStepError(reason))

    def _end(self, request_id: str, why: BaseException) -> None:
        try:
            self.engine.abort(request_id)
        except Exception:  # the engine is already broken; the waiter still hears why
            log.exception("abort of %s failed", request_id)
        self._deliver(request_id, why)
        self._streams.pop(request_id, None)


def _set_result(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
