"""A draining decode replica hands its streams over when its grace runs out, through the real
gRPC path (in-process fleet, tiny model): each stream ends on the drained replica with a
`handed_over` message after its last token, the coordinator continues it on the other
replica (greedy: the same tokens as an uninterrupted run, none lost or doubled), the move is
recorded as `drain`, and no KV block stays held on either replica. A stream that ends within
the grace is not handed over. Underneath, the engine driver's `end_stream` ends a stream
after exactly the outputs it delivered and frees the request's blocks."""

from __future__ import annotations

import asyncio

import pytest

from engine.core.async_engine import AsyncEngine
from engine.core.config import EngineConfig
from engine.core.engine import Engine
from services.worker.server import drain
from shared.sampling.params import SamplingParams
from shared.wire.records import WorkerLoad
from tests.unit.test_migration_backend import (
    Fleet,
    Replica,
    collect,
    fleet_config,
    request,
    start_fleet,
    tiny_folder,  # noqa: F401 - the fixture
    tokens,
)
from tests.unit.test_migration_cancel import assert_settled, free_blocks, settled

# Long enough that a stream is still running when a near-zero grace runs out.
LONG = 400
STREAMS = 3


def announcer(fleet: Fleet, replica: Replica):
    """What the worker's registrations do on SIGTERM: a heartbeat saying it is draining."""

    async def announce() -> None:
        fleet.registry.heartbeat(replica.info.worker_id, WorkerLoad(), draining=True)

    return announce


def drainer(fleet: Fleet, grace_s: float, after_tokens: int, started: list[asyncio.Task]):
    """Once a stream has `after_tokens`, drains the decode replica serving it (once)."""

    async def on_chunk(chunks) -> None:
        if started or len(tokens(chunks)) < after_tokens:
            return
        replica = fleet.replicas[chunks[-1].replica]
        task = asyncio.create_task(drain(replica.servicer, announcer(fleet, replica), grace_s))
        task.replica = replica  # type: ignore[attr-defined]
        started.append(task)

    return on_chunk


def reasons(chunks) -> list[str]:
    return [a["reason"] for a in chunks[-1].metadata["attempts"]]


def test_streams_outlasting_the_grace_are_handed_over_intact(tiny_folder, real_tokenizer):  # noqa: F811
    async def main():
        config = fleet_config(tiny_folder, {"prefill": 1, "decode": 2})
        fleet = await start_fleet(config, real_tokenizer)
        try:
            start = await free_blocks(fleet)
            baseline = await collect(fleet.loop, request("base", LONG, ignore_eos=True))
            started: list[asyncio.Task] = []
            on_chunk = drainer(fleet, grace_s=0.02, after_tokens=5, started=started)
            runs = await asyncio.gather(
                *(
                    collect(fleet.loop, request(f"s{i}", LONG, ignore_eos=True), on_chunk)
                    for i in range(STREAMS)
                )
            )
            (drained,) = started
            await asyncio.wait_for(drained, 5)
            stats = await settled(fleet, start)
            return baseline, runs, drained.replica, stats, start, fleet
        finally:
            await fleet.close()

    baseline, runs, drained, stats, start, fleet = asyncio.run(main())
    assert all(tokens(chunks) == tokens(baseline) for chunks in runs)
    assert all(chunks[-1].num_output_tokens == LONG for chunks in runs)
    moved = [chunks for chunks in runs if "drain" in reasons(chunks)]
    assert moved, [reasons(c) for c in runs]
    drained_id = drained.info.worker_id
    for chunks in moved:
        assert reasons(chunks) == ["first", "drain"]
        first, handed = chunks[-1].metadata["attempts"]
        assert first["replica"].endswith(drained_id)
        assert first["success"] and first["error"] is None  # a hand-over is no failure
        assert drained_id not in handed["replica"] and handed["success"]
        # Handed over mid-stream, from the tokens it had: the drain starts when one stream has
        # 5, and a stream that started later on the same replica may have fewer.
        assert handed["after_tokens"] >= 1
    # Still in the pool (finishing its drain), but nothing new goes there.
    info = fleet.registry.workers[drained_id]
    assert info.alive and info.draining and not info.routable
    assert_settled(stats, start)  # no block held on the drained replica nor the survivor


def test_a_stream_ending_within_the_grace_stays_where_it_is(tiny_folder, real_tokenizer):  # noqa: F811
    async def main():
        config = fleet_config(tiny_folder, {"prefill": 1, "decode": 2})
        fleet = await start_fleet(config, real_tokenizer)
        try:
            started: list[asyncio.Task] = []
            on_chunk = drainer(fleet, grace_s=30.0, after_tokens=2, started=started)
            chunks = await collect(fleet.loop, request("short", 12), on_chunk)
            (drained,) = started
            await asyncio.wait_for(drained, 5)  # returns as soon as the stream ended
            return chunks
        finally:
            await fleet.close()

    chunks = asyncio.run(main())
    assert reasons(chunks) == ["first"] and chunks[-1].num_output_tokens == 12
    (only,) = chunks[-1].metadata["attempts"]
    assert only["success"] and only["error"] is None


class _Moved(Exception):
    pass


def test_end_stream_ends_after_the_delivered_outputs_and_frees_the_blocks(tiny_model):
    engine = Engine(EngineConfig(num_blocks=32, max_model_len=128), model=tiny_model)
    driver = AsyncEngine(engine)
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)

    def add(rid: str):
        return lambda e: e.add_request([1, 2, 3], params, request_id=rid)

    async def main():
        driver.start()
        try:
            total = (await driver.call(lambda e: e.load())).free_blocks
            whole = [t async for out in driver.generate(add("whole")) for t in out.new_token_ids]
            driver.end_stream("whole", _Moved())  # finished: nothing to end
            got: list[int] = []
            with pytest.raises(_Moved):
                async for out in driver.generate(add("cut")):
                    got.extend(out.new_token_ids)
                    if len(got) >= 3 and len(got) - len(out.new_token_ids) < 3:
                        driver.end_stream("cut", _Moved())
            load = await driver.call(lambda e: e.load())
            return whole, got, total, load
        finally:
            driver.stop()

    whole, got, total, load = asyncio.run(main())
    assert 3 <= len(got) < len(whole) == 100
    assert got == whole[: len(got)]  # every token made before the end, in order, once
    assert engine.num_aborted == 1
    assert (load.running, load.waiting, load.free_blocks) == (0, 0, total)
