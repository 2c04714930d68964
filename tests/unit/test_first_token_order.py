"""What the first token waits for: nothing the backend or telemetry can do after it.

- A streaming choice's pump holds the backend after the first token until the HTTP layer has
  written it (so Decode opening, a span, the transfer watcher do not run in front of it).
- The SSE response writes from the request's task at once, closes its source however it
  ends, and runs its close hook even when the body never started.
- The engine's driver hands a step's outputs to their streams before the step's observers.
"""

from __future__ import annotations

import asyncio
import functools

import pytest

from engine.core.async_engine import AsyncEngine
from engine.core.config import EngineConfig
from engine.core.engine import Engine
from services.coordinator.generation_backend import GenerationChunk, GenerationRequest
from services.coordinator.stream.choices import ChoiceStreams
from services.coordinator.stream.sse import SSEResponse
from shared.sampling.params import SamplingParams


class _Loop:
    """A retry loop stand-in that records how far its one stream was pulled."""

    def __init__(self, chunks: int):
        self.chunks = chunks
        self.pulled = 0

    async def generate(self, req: GenerationRequest):
        for i in range(self.chunks):
            self.pulled = i + 1
            yield GenerationChunk(token_ids=[i], finished=i == self.chunks - 1)


def _request() -> GenerationRequest:
    return GenerationRequest(
        request_id="r",
        model="m",
        prompt_token_ids=[1, 2, 3],
        params=SamplingParams(),
        priority=1,
        service_tier="default",
    )


def _sync(test):
    """Runs an async test on a fresh event loop (the suite has no asyncio plugin)."""

    @functools.wraps(test)
    def run(*args, **kwargs):
        asyncio.run(test(*args, **kwargs))

    return run


async def _settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


@_sync
async def test_streaming_pump_waits_for_the_first_token_to_be_written():
    loop = _Loop(chunks=3)
    streams = ChoiceStreams(loop.generate, [_request()], hold_first=True)
    index, chunk = await streams.next()
    await _settle()
    assert (index, chunk.token_ids) == (0, [0])
    assert loop.pulled == 1  # the backend was not asked for more before the token is out
    # Asking for the next event is the caller's word that the first token is written.
    rest = [await streams.next(), await streams.next(), await streams.next()]
    assert [c.token_ids for _, c in rest[:2]] == [[1], [2]] and rest[2] is None
    assert loop.pulled == 3


@_sync
async def test_collecting_pump_never_waits():
    loop = _Loop(chunks=3)
    streams = ChoiceStreams(loop.generate, [_request()], hold_first=False)
    got = []
    while (event := await streams.next()) is not None:
        got.append(event[1].token_ids)
    assert got == [[0], [1], [2]]


@_sync
async def test_a_held_pump_is_cancelled_by_close():
    loop = _Loop(chunks=3)
    streams = ChoiceStreams(loop.generate, [_request()], hold_first=True)
    await streams.next()
    streams.close()
    await _settle()
    assert all(t.done() for t in streams._tasks)
    assert loop.pulled == 1


def _receiver(disconnect: asyncio.Event):
    async def receive():
        await disconnect.wait()
        return {"type": "http.disconnect"}

    return receive


@_sync
async def test_sse_response_streams_closes_and_runs_its_hook():
    closed: list[str] = []
    sent: list[dict] = []

    async def body():
        try:
            yield "data: 1\n\n"
            yield "data: 2\n\n"
        finally:
            closed.append("body")

    async def send(message):
        sent.append(message)

    response = SSEResponse(body(), on_close=lambda: closed.append("hook"))
    await response({"type": "http"}, _receiver(asyncio.Event()), send)
    bodies = [m.get("body") for m in sent if m["type"] == "http.response.body"]
    assert bodies == [b"data: 1\n\n", b"data: 2\n\n", b""]
    assert closed == ["body", "hook"]


@_sync
async def test_sse_response_stops_when_the_client_leaves():
    disconnect = asyncio.Event()
    closed: list[str] = []
    sent: list[dict] = []

    async def body():
        try:
            yield "data: 1\n\n"
            await asyncio.sleep(30)  # a backend that would go on for a long time
            yield "data: never\n\n"
        finally:
            closed.append("body")

    async def send(message):
        sent.append(message)
        if message.get("body") == b"data: 1\n\n":
            disconnect.set()

    response = SSEResponse(body(), on_close=lambda: closed.append("hook"))
    await asyncio.wait_for(response({"type": "http"}, _receiver(disconnect), send), 5)
    assert b"data: never\n\n" not in [m.get("body") for m in sent]
    assert closed == ["body", "hook"]
    assert asyncio.current_task().cancelling() == 0  # the listener's cancel was ours alone


@_sync
async def test_sse_response_hook_runs_when_the_body_never_started():
    closed: list[str] = []

    async def body():
        try:
            yield "data: 1\n\n"
        finally:
            closed.append("body")  # never: the generator never started

    async def send(message):
        raise OSError("connection reset")

    response = SSEResponse(body(), on_close=lambda: closed.append("hook"))
    await response({"type": "http"}, _receiver(asyncio.Event()), send)
    assert closed == ["hook"]


@pytest.fixture
def engine(tiny_model):
    return Engine(EngineConfig(num_blocks=32, max_model_len=128), model=tiny_model)


def test_deferred_observers_run_once_on_notify(engine):
    seen: list[int] = []
    engine.step_observers.append(lambda batch, *_: seen.append(batch.num_batched_tokens))
    engine.add_request([1, 2, 3, 4], SamplingParams(max_tokens=3, temperature=0.0))
    engine.step(defer_observers=True)
    assert seen == []
    engine.notify_observers()
    engine.notify_observers()  # idempotent
    assert seen == [4]
    engine.step(defer_observers=True)
    engine.step()  # a deferred step nobody notified is observed before the next one
    assert seen == [4, 1, 1]


@_sync
async def test_driver_delivers_outputs_before_observing_the_step(engine):
    driver = AsyncEngine(engine)
    handed_on: list[bool] = []

    def observe(batch, *_):
        # On the engine thread: a finished request's stream is dropped when its last output
        # is handed to the event loop, so it is gone here if delivery came first.
        handed_on.extend(s.seq.request_id not in driver._streams for s in batch.scheduled)

    engine.step_observers.append(observe)
    driver.start()
    try:
        params = SamplingParams(max_tokens=1, temperature=0.0)
        outs = [out async for out in driver.generate(lambda e: e.add_request([1, 2, 3], params))]
        for _ in range(100):
            if handed_on:
                break
            await asyncio.sleep(0.01)
    finally:
        driver.stop()
    assert outs[-1].finished
    assert handed_on == [True]
