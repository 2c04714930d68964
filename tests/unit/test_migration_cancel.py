"""Cancellation through the real gRPC path (in-process fleet, tiny model): a consumer that
stops reading frees the request's blocks on every replica, whatever stage it was in, and
the fault-injection knob delays a replica's first token.

The requests ignore EOS and ask for far more tokens than the test reads, so they cannot end
by themselves while the test watches: what is checked is the abort itself (counted by the
engine, the request gone long before its budget, no replica stepping any more)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc

from shared.proto_gen import worker_pb2 as pb
from shared.proto_gen import worker_pb2_grpc as pb_grpc
from shared.wire.convert import params_to_proto
from tests.unit.test_migration_backend import (
    Fleet,
    collect,
    fleet_config,
    request,
    start_fleet,
    tiny_folder,  # noqa: F401 - the fixture
)

# Far more than any test here reads (the tiny model's context is 1,024): only an abort ends
# such a request while the test watches.
LONG = 900


async def free_blocks(fleet: Fleet) -> dict[str, int]:
    return {wid: (await r.stats())["load"]["free_blocks"] for wid, r in fleet.replicas.items()}


async def settled(fleet: Fleet, start: dict[str, int], timeout_s: float = 5.0) -> dict:
    """Wait until every replica is idle with its starting free blocks; return the last stats."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = {wid: await r.stats() for wid, r in fleet.replicas.items()}
        idle = all(
            s["load"]["running"] == 0
            and s["load"]["waiting"] == 0
            and s["parked_kv"] == 0
            and s["load"]["free_blocks"] == start[wid]
            for wid, s in stats.items()
        )
        if idle or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.05)


async def consume_then_leave(fleet: Fleet, rid: str, n_chunks: int) -> int:
    got = 0
    stream = fleet.loop.generate(request(rid, LONG, ignore_eos=True))
    async with contextlib.aclosing(stream):
        async for _chunk in stream:
            got += 1
            if got >= n_chunks:
                break
    return got


def assert_settled(stats: dict, start: dict[str, int]) -> None:
    for wid, s in stats.items():
        assert s["load"]["running"] == 0 and s["load"]["waiting"] == 0, (wid, s["load"])
        assert s["parked_kv"] == 0, wid
        assert s["load"]["free_blocks"] == start[wid], (wid, s["load"], start[wid])


async def steps_after_a_pause(fleet: Fleet, pause_s: float = 0.3) -> tuple[dict, dict]:
    """Each replica's engine step count, read twice `pause_s` apart."""
    before = {wid: (await r.stats())["steps"] for wid, r in fleet.replicas.items()}
    await asyncio.sleep(pause_s)
    return before, {wid: (await r.stats())["steps"] for wid, r in fleet.replicas.items()}


def test_leaving_mid_decode_aborts_it_everywhere(tiny_folder, real_tokenizer):  # noqa: F811
    async def main():
        fleet = await start_fleet(
            fleet_config(tiny_folder, {"prefill": 1, "decode": 1}), real_tokenizer
        )
        try:
            start = await free_blocks(fleet)
            got = await consume_then_leave(fleet, "leaver", 3)
            stats = await settled(fleet, start, timeout_s=2.0)
            return got, start, stats, await steps_after_a_pause(fleet)
        finally:
            await fleet.close()

    got, start, stats, (steps, later) = asyncio.run(main())
    assert got == 3
    assert_settled(stats, start)
    (decode,) = [s for s in stats.values() if s["role"] == "decode"]
    assert decode["aborted"] == 1  # the engine stopped it: it did not run out of tokens
    assert decode["steps"] < LONG // 2, decode["steps"]
    assert steps == later  # nobody is stepping it any more


def test_leaving_during_prefill_frees_blocks_everywhere(tiny_folder, real_tokenizer):  # noqa: F811
    """The first token is held back (fault injection) so the client leaves mid-prefill."""

    async def main():
        config = fleet_config(
            tiny_folder, {"prefill": 1, "decode": 1}, fault_injection={"first_token_delay_ms": 300}
        )
        fleet = await start_fleet(config, real_tokenizer)
        try:
            start = await free_blocks(fleet)
            req = request("early", LONG, ignore_eos=True)
            task = asyncio.create_task(collect(fleet.loop, req))
            await asyncio.sleep(0.1)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await asyncio.sleep(0.4)  # past the held-back first token: it would be out now
            return start, await settled(fleet, start, timeout_s=2.0)
        finally:
            await fleet.close()

    start, stats = asyncio.run(main())
    assert_settled(stats, start)
    # The cancelled Prefill call never reached an engine: no replica computed a step for it
    # (left running, the prefill would have stepped and the decode replica ~900 times).
    assert {wid: s["steps"] for wid, s in stats.items()} == dict.fromkeys(stats, 0)


def test_abort_before_the_kv_arrives_refuses_it(tiny_folder, real_tokenizer):  # noqa: F811
    """An Abort that overtakes the prefill: the decode replica must not keep KV for it."""

    async def main():
        fleet = await start_fleet(
            fleet_config(tiny_folder, {"prefill": 1, "decode": 1}), real_tokenizer
        )
        try:
            start = await free_blocks(fleet)
            (prefill,) = fleet.role("prefill")
            (decode,) = fleet.role("decode")
            async with grpc.aio.insecure_channel(decode.info.address) as channel:
                await pb_grpc.WorkerStub(channel).Abort(pb.AbortRequest(request_id="late"))
            req = request("late", 10)
            generation = pb.Generation(
                request_id="late",
                model=req.model,
                prompt_token_ids=req.prompt_token_ids,
                sampling=params_to_proto(req.params),
            )
            async with grpc.aio.insecure_channel(prefill.info.address) as channel:
                call = pb_grpc.WorkerStub(channel).Prefill(
                    pb.PrefillRequest(
                        generation=generation,
                        destination=pb.KVDestination(
                            control_address=decode.info.address,
                            agent_name=decode.info.transfer_agent,
                            deadline_s=5.0,
                        ),
                    )
                )
                events = [event async for event in call]
            return events, start, await settled(fleet, start)
        finally:
            await fleet.close()

    events, start, stats = asyncio.run(main())
    assert [e.WhichOneof("event") for e in events] == ["first_token", "transfer"]
    assert events[1].transfer.status == "failed"
    assert "cancelled" in events[1].transfer.error
    assert_settled(stats, start)


def test_first_token_delay_fault_holds_the_first_token(
    tiny_folder,  # noqa: F811
    real_tokenizer,
    monkeypatch,
):
    # The worker's stall is observed, not timed: its sleeps are recorded in order with the
    # chunks the client receives.
    from services.worker import runtime

    events: list[object] = []
    real_sleep = asyncio.sleep

    class RecordingAsyncio:
        def __getattr__(self, name):
            return getattr(asyncio, name)

        async def sleep(self, seconds, *args):
            events.append(("sleep", seconds))
            await real_sleep(0)

    monkeypatch.setattr(runtime, "asyncio", RecordingAsyncio())

    async def main():
        config = fleet_config(
            tiny_folder, {"prefill": 1, "decode": 1}, fault_injection={"first_token_delay_ms": 400}
        )
        fleet = await start_fleet(config, real_tokenizer)
        try:
            async for chunk in fleet.loop.generate(request("slow", 4)):
                events.append("chunk")
                if chunk.finished:
                    break
        finally:
            await fleet.close()

    asyncio.run(main())
    assert "chunk" in events
    assert ("sleep", 0.4) in events[: events.index("chunk")]
