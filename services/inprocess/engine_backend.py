"""A `GenerationBackend` over one in-process `Engine`: single-process runs and tests.

The production backend is the gRPC one (prefill/decode worker pools); this one runs the whole
model in the coordinator's process. The engine is not thread-safe and its `step()` blocks for
a forward pass, so it lives on its own thread: the event loop sends submissions and aborts
through a thread-safe queue, and the thread delivers outputs to per-request asyncio queues
with `loop.call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from services.coordinator.backend import (
    BackendError,
    BackendRequestError,
    GenerationChunk,
    GenerationRequest,
    ModelInfo,
)
from shared.engine.engine import Engine, RequestError
from shared.engine.output import RequestOutput
from shared.modelfile.default import DEFAULT_MODEL_ID
from shared.tokenizer.tokenizer import Tokenizer

log = logging.getLogger(__name__)

_IDLE_POLL_S = 0.5  # how long the idle thread blocks waiting for a command


@dataclass
class _Submit:
    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    sink: asyncio.Queue


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Sink:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class EngineBackend:
    """Runs `engine` on a background thread; `start()` before use, `close()` after."""

    def __init__(
        self,
        engine: Engine,
        model_id: str = DEFAULT_MODEL_ID,
        tokenizer: Tokenizer | None = None,
        replica: str = "local",
    ):
        tokenizer = tokenizer or engine.tokenizer
        if tokenizer is None:
            raise ValueError(
                "EngineBackend needs a tokenizer (pass one, or build the engine with one)"
            )
        self.engine = engine
        self.replica = replica
        fingerprint = hashlib.sha256(
            f"{tokenizer.fingerprint}|{engine.model.config!r}".encode()
        ).hexdigest()
        self._info = ModelInfo(
            id=model_id,
            context_length=engine.max_model_len,
            tokenizer=tokenizer,
            fingerprint=f"fp_{fingerprint[:10]}",
        )
        self._commands: queue.SimpleQueue[_Submit | _Abort | None] = queue.SimpleQueue()
        self._sinks: dict[str, _Sink] = {}  # owned by the engine thread
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.num_aborted = 0
        self.num_failed_steps = 0
        self.last_error: str | None = None

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> EngineBackend:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="engine-step-loop", daemon=True)
            self._thread.start()
        return self

    def close(self, timeout: float = 10.0) -> None:
        if self._thread is None:
            return
        self._stopping.set()
        self._commands.put(None)
        self._thread.join(timeout)
        self._thread = None

    def __enter__(self) -> EngineBackend:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- GenerationBackend ---------------------------------------------------------------

    def models(self) -> list[ModelInfo]:
        return [self._info]

    async def generate(self, req: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        if self._thread is None or not self._thread.is_alive():
            raise BackendError("the engine thread is not running")
        sink: asyncio.Queue = asyncio.Queue()
        self._commands.put(_Submit(req, asyncio.get_running_loop(), sink))
        finished = False
        try:
            while True:
                item = await sink.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine already dropped it
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            # Cancelled (client gone) or closed early: free the request's engine resources.
            # A plain put, no await, so it also runs inside an already-cancelled scope.
            if not finished:
                self._commands.put(_Abort(req.request_id))

    async def health(self) -> dict[str, Any]:
        alive = self._thread is not None and self._thread.is_alive()
        scheduler = self.engine.scheduler
        return {
            "ready": alive,
            "replica": self.replica,
            "running": len(scheduler.running),
            "waiting": len(scheduler.waiting),
            "aborted": self.num_aborted,
            "failed_steps": self.num_failed_steps,
            "last_error": self.last_error,
        }

    # -- the engine thread ---------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.is_set():
            if not self._drain_commands(block=not self.engine.has_work):
                break
            if not self.engine.has_work:
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a bug below us: fail what is in flight, keep serving
                log.exception("engine step failed")
                self.num_failed_steps += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
                self._fail_all(BackendError(f"the engine failed: {self.last_error}"))
                continue
            for out in outputs:
                self._deliver(out)
        self._fail_all(BackendError("the engine backend is shutting down"))

    def _drain_commands(self, block: bool) -> bool:
        """Apply queued submissions/aborts; False once asked to stop."""
        try:
            command = (
                self._commands.get(timeout=_IDLE_POLL_S) if block else self._commands.get_nowait()
            )
        except queue.Empty:
            return True
        while True:
            if command is None:
                return False
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, command: _Submit | _Abort) -> None:
        if isinstance(command, _Abort):
            if self._sinks.pop(command.request_id, None) is not None:
                self.engine.abort(command.request_id)
                self.num_aborted += 1
            return
        req = command.request
        sink = _Sink(command.loop, command.sink)
        try:
            self.engine.add_request(
                req.prompt_token_ids,
                req.params,
                request_id=req.request_id,
                priority=req.priority,
                prompt_logprobs=req.prompt_logprobs,
            )
        except RequestError as exc:
            self._send(sink, BackendRequestError(exc.param, str(exc)))
            return
        self._sinks[req.request_id] = sink

    def _deliver(self, out: RequestOutput) -> None:
        sink = self._sinks.get(out.request_id)
        if sink is None:
            return  # aborted in the same step it produced output
        if out.finished:
            del self._sinks[out.request_id]
        chunk = GenerationChunk(
            token_ids=list(out.new_token_ids),
            text=out.text,
            logprobs=list(out.logprobs),
            prompt_logprobs=out.prompt_logprobs,
            finished=out.finished,
            finish_reason=out.finish_reason,
            num_prompt_tokens=out.num_prompt_tokens,
            num_cached_tokens=out.num_cached_tokens,
            num_output_tokens=out.num_output_tokens,
            replica=self.replica,
        )
        if not self._send(sink, chunk) and not out.finished:
            self._sinks.pop(out.request_id, None)
            self.engine.abort(out.request_id)
            self.num_aborted += 1

    def _fail_all(self, error: BaseException) -> None:
        for request_id, sink in list(self._sinks.items()):
            try:
                self.engine.abort(request_id)
            except Exception:  # the engine is already broken; the waiter still hears why
                log.exception("abort of %s failed", request_id)
            self._send(sink, error)
        self._sinks.clear()

    @staticmethod
    def _send(sink: _Sink, item: GenerationChunk | BaseException) -> bool:
        try:
            sink.loop.call_soon_threadsafe(sink.queue.put_nowait, item)
        except RuntimeError:  # the requester's event loop is closed: nobody is listening
            return False
        return True
