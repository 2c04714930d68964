"""KVArrivals: a Decode call meets its pushed KV in whatever order the two arrive, and every
reserved table leaves exactly once (taken by the call, or freed) — observed with a real
BlockManager whose free blocks come back and whose integrity check stays clean."""

from __future__ import annotations

import asyncio

import pytest

from engine.kvcache.block_manager import BlockManager
from engine.kvcache.tables import BlockTable
from services.worker.arrivals import KVArrivals, Stage

NUM_BLOCKS = 16
BLOCK_SIZE = 4


class Pool:
    """The decode replica's blocks: what PrepareReceive reserves and `free` gives back."""

    def __init__(self) -> None:
        self.blocks = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
        self.freed: list[BlockTable] = []

    def reserve(self, n_blocks: int = 2) -> BlockTable:
        table = self.blocks.allocate_fresh(n_blocks * BLOCK_SIZE)
        assert table is not None
        return table

    def free(self, table: BlockTable) -> None:
        self.freed.append(table)
        self.blocks.free(table)

    def assert_all_back(self) -> None:
        assert self.blocks.num_free_blocks == NUM_BLOCKS
        self.blocks.check_integrity()


async def _until(predicate, steps: int = 200) -> None:
    """Yields to the loop until `predicate()` holds (an event, not a duration)."""
    for _ in range(steps):
        if predicate():
            return
        await asyncio.sleep(0)
    raise AssertionError("the condition never held")


def run(scenario):
    pool = Pool()
    asyncio.run(scenario(pool, KVArrivals(pool.free)))
    pool.assert_all_back()


def test_decode_before_prepare_receive_gets_the_kv():
    async def scenario(pool: Pool, arrivals: KVArrivals):
        waiter = asyncio.create_task(arrivals.take("r", wait_s=30))
        await _until(lambda: arrivals.waiting("r") == 1)
        assert arrivals.stage("r") is Stage.EXPECTED
        table = pool.reserve()
        assert arrivals.receiving("r", table)
        await asyncio.sleep(0)
        assert not waiter.done()  # still receiving: the call keeps waiting
        arrivals.landed("r")
        assert await waiter is table
        assert arrivals.stage("r") is None and not pool.freed
        pool.free(table)  # the engine's sequence would own it now

    run(scenario)


def test_decode_while_receiving_and_after_landing():
    async def scenario(pool: Pool, arrivals: KVArrivals):
        during, after = pool.reserve(), pool.reserve()
        assert arrivals.receiving("during", during)
        assert arrivals.receiving("after", after)
        waiter = asyncio.create_task(arrivals.take("during", wait_s=30))
        await _until(lambda: arrivals.waiting("during") == 1)
        arrivals.landed("during")
        arrivals.landed("after")
        assert await waiter is during
        assert arrivals.num_parked == 1  # "after" waits for its call
        assert await arrivals.take("after", wait_s=30) is after
        assert arrivals.num_parked == 0 and not pool.freed
        pool.free(during)
        pool.free(after)

    run(scenario)


def test_failed_receive_frees_and_the_call_prefills_locally():
    async def scenario(pool: Pool, arrivals: KVArrivals):
        table = pool.reserve()
        arrivals.receiving("r", table)
        waiter = asyncio.create_task(arrivals.take("r", wait_s=30))
        await _until(lambda: arrivals.waiting("r") == 1)
        arrivals.receive_failed("r", "timed_out")
        assert await waiter is None
        assert pool.freed == [table]
        # A Decode call arriving after the failure does not wait for anything.
        assert await arrivals.take("r", wait_s=30) is None
        assert arrivals.stage("r") is Stage.LOST

    run(scenario)


def test_sender_abort_before_prepare_wakes_the_call_and_refuses_a_late_receive():
    async def scenario(pool: Pool, arrivals: KVArrivals):
        waiter = asyncio.create_task(arrivals.take("r", wait_s=30))
        await _until(lambda: arrivals.waiting("r") == 1)
        arrivals.never_coming("r", "push failed")
        assert await waiter is None
        late = pool.reserve()
        assert not arrivals.receiving("r", late)  # the caller still owns it and frees it
        pool.free(late)

    run(scenario)


def test_no_prepare_receive_within_the_deadline_abandons():
    async def scenario(pool: Pool, arrivals: KVArrivals):
        assert await arrivals.take("r", wait_s=0.0) is None
        assert arrivals.stage("r") is Stage.ABANDONED
        late = pool.reserve()
        assert not arrivals.receiving("r", late)
        pool.free(late)

    run(scenario)


def test_cancelled_call_while_receiving_frees_the_kv_when_it_lands():
    async def scenario(pool: Pool, arrivals: KVArrivals):
        table = pool.reserve()
        arrivals.receiving("r", table)
        waiter = asyncio.create_task(arrivals.take("r", wait_s=30))
        await _until(lambda: arrivals.waiting("r") == 1)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert arrivals.stage("r") is Stage.ABANDONED and not pool.freed  # still being written
        arrivals.landed("r")
        assert pool.freed == [table]
        assert arrivals.num_parked == 0

    run(scenario)


def test_coordinator_abort_in_every_stage():
    async def scenario(pool: Pool, arrivals: KVArrivals):
        parked, receiving = pool.reserve(), pool.reserve()
        arrivals.receiving("parked", parked)
        arrivals.landed("parked")
        arrivals.receiving("receiving", receiving)
        waiter = asyncio.create_task(arrivals.take("waiting", wait_s=30))
        await _until(lambda: arrivals.waiting("waiting") == 1)
        for rid in ("parked", "receiving", "waiting"):
            arrivals.cancel(rid)
        assert await waiter is None
        assert pool.freed == [parked]  # landed KV goes at once
        arrivals.receive_failed("receiving", "aborted")  # the control plane stops it
        assert pool.freed == [parked, receiving]
        assert arrivals.count(Stage.ABANDONED) == 3

    run(scenario)


def test_parked_kv_expires_and_tombstones_are_forgotten():
    async def scenario(pool: Pool, arrivals: KVArrivals):
        table = pool.reserve()
        arrivals.receiving("r", table)
        arrivals.landed("r")
        assert arrivals.expire() == []  # within its TTL
        arrivals.parked_ttl_s = arrivals.tombstone_ttl_s = -1.0
        arrivals.receiving("x", pool.reserve())
        arrivals.landed("x")
        assert sorted(arrivals.expire()) == ["x"]
        assert pool.freed and arrivals.stage("x") is Stage.LOST
        arrivals.expire()
        assert arrivals.stage("x") is None
        assert await arrivals.take("r", wait_s=30) is table  # landed before the TTL change
        pool.free(table)

    run(scenario)


def test_close_frees_landed_kv():
    async def scenario(pool: Pool, arrivals: KVArrivals):
        table = pool.reserve()
        arrivals.receiving("r", table)
        arrivals.landed("r")
        arrivals.close()
        assert pool.freed == [table]
        assert await arrivals.take("r", wait_s=30) is None

    run(scenario)
