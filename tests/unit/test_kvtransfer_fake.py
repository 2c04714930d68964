"""The transfer interface, sessions and metrics, exercised through the in-process fake."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from prometheus_client import CollectorRegistry

from engine.kvcache.block_manager import BlockManager
from engine.kvcache.pool import KVLayout, KVPool
from services.kvtransfer.blockbytes import byte_view
from services.kvtransfer.fake import FakeFabric, FakeFaults, FakeTransferBackend
from services.kvtransfer.session import TransferSession
from services.kvtransfer.types import TransferError, TransferState
from tools.bench.transfer_peer import alarm_after

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.bfloat16)
NUM_BLOCKS = 24


@pytest.fixture(autouse=True)
def _hard_timeout():
    with alarm_after(30):
        yield


class Side:
    """One replica: a pool, its block manager, a fake agent, and a release ledger."""

    def __init__(self, name: str, fabric: FakeFabric, registry: CollectorRegistry, seed: int):
        self.pool = KVPool(LAYOUT, NUM_BLOCKS)
        raw = byte_view(self.pool.tensor)
        gen = torch.Generator().manual_seed(seed)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
        self.blocks = BlockManager(NUM_BLOCKS, LAYOUT.block_size)
        self.agent = FakeTransferBackend(name, fabric, registry=registry)
        self.metadata = self.agent.register_pool(self.pool)
        self.released: list[TransferState] = []
        self._rng = random.Random(seed)

    def allocate(self, n: int):
        tokens = [self._rng.randrange(1 << 30) for _ in range(n * LAYOUT.block_size)]
        allocation = self.blocks.allocate(tokens)
        assert allocation is not None
        return allocation.table

    def on_release(self, table):
        def release(state: TransferState) -> None:
            self.released.append(state)
            self.blocks.free(table)

        return release

    def block_bytes(self, ids) -> bytes:
        return b"".join(byte_view(self.pool.tensor[i]).numpy().tobytes() for i in ids)


@pytest.fixture
def registry():
    return CollectorRegistry()


@pytest.fixture
def pair(registry):
    fabric = FakeFabric()
    prefill = Side("prefill", fabric, registry, seed=1)
    decode = Side("decode", fabric, registry, seed=2)
    prefill.agent.add_peer("decode", decode.metadata)
    decode.agent.add_peer("prefill", prefill.metadata)
    yield prefill, decode
    prefill.agent.close()
    decode.agent.close()


def start(prefill: Side, decode: Side, rid: str, n: int, *, send_deadline=5.0, recv_deadline=6.0):
    src_table, dst_table = prefill.allocate(n), decode.allocate(n)
    recv = decode.agent.prepare_receive(rid, dst_table.block_ids, recv_deadline)
    sent = prefill.agent.send(rid, src_table.block_ids, recv.descriptors, send_deadline)
    return (
        TransferSession(prefill.agent, sent, prefill.on_release(src_table)),
        TransferSession(decode.agent, recv, decode.on_release(dst_table)),
        list(src_table.block_ids),
        list(dst_table.block_ids),
    )


def assert_all_blocks_back(*sides: Side) -> None:
    for side in sides:
        side.blocks.check_integrity()
        assert side.blocks.num_free_blocks == NUM_BLOCKS
        assert len(side.released) == 1


def test_blocks_arrive_bit_identical(pair):
    prefill, decode = pair
    send, recv, src, dst = start(prefill, decode, "r1", 7)
    expected = prefill.block_bytes(src)
    untouched = [i for i in range(NUM_BLOCKS) if i not in dst]
    before = decode.block_bytes(untouched)
    assert send.wait() is TransferState.DONE
    # The receive side keeps its blocks until its own session sees DONE.
    assert decode.block_bytes(dst) == expected
    assert recv.wait() is TransferState.DONE
    assert decode.block_bytes(untouched) == before
    assert prefill.released == [TransferState.DONE] and decode.released == [TransferState.DONE]
    assert_all_blocks_back(prefill, decode)


def test_injected_failure_fails_both_sides_and_frees_blocks(pair):
    prefill, decode = pair
    prefill.agent.faults.fail_requests.add("bad")
    send, recv, _, dst = start(prefill, decode, "bad", 3)
    before = decode.block_bytes(dst)
    assert send.wait() is TransferState.FAILED
    assert recv.wait() is TransferState.FAILED
    assert send.handle.error == "injected failure"
    assert decode.block_bytes(dst) == before
    assert_all_blocks_back(prefill, decode)


def test_deadline_passes_while_delayed(pair):
    prefill, decode = pair
    prefill.agent.faults = FakeFaults(delay_s=5.0)
    send, recv, _, _ = start(prefill, decode, "slow", 2, send_deadline=0.05, recv_deadline=0.2)
    assert send.wait() is TransferState.TIMED_OUT
    assert send.handle.seconds < 1.0
    # The sender's stop reaches the receiver before its own (longer) deadline.
    assert recv.wait() is TransferState.FAILED
    assert "deadline" in recv.handle.error
    assert_all_blocks_back(prefill, decode)


def test_receiver_times_out_when_nobody_sends(pair):
    _, decode = pair
    table = decode.allocate(2)
    handle = decode.agent.prepare_receive("lonely", table.block_ids, 0.05)
    session = TransferSession(decode.agent, handle, decode.on_release(table))
    assert session.poll() is TransferState.PENDING
    assert session.wait() is TransferState.TIMED_OUT
    assert decode.released == [TransferState.TIMED_OUT]
    decode.blocks.check_integrity()


def test_abort_in_flight(pair):
    prefill, decode = pair
    prefill.agent.faults = FakeFaults(delay_s=5.0)
    send, recv, _, _ = start(prefill, decode, "abort", 4)
    assert send.poll() is TransferState.PENDING
    send.abort()
    assert send.state is TransferState.ABORTED
    assert recv.wait() is TransferState.FAILED
    assert_all_blocks_back(prefill, decode)


def test_release_runs_exactly_once_whatever_the_order(pair):
    prefill, decode = pair
    send, recv, _, _ = start(prefill, decode, "once", 2)
    assert send.wait() is TransferState.DONE
    send.poll()
    send.close()
    send.abort()
    with recv:
        recv.wait()
        recv.poll()
    recv.close()
    assert_all_blocks_back(prefill, decode)


def test_exception_inside_session_still_releases(pair):
    prefill, decode = pair
    prefill.agent.faults = FakeFaults(delay_s=5.0)
    send, recv, _, _ = start(prefill, decode, "boom", 2)
    with pytest.raises(RuntimeError, match="caller bug"):
        with send, recv:
            raise RuntimeError("caller bug")
    assert prefill.released == [TransferState.ABORTED]
    assert decode.released == [TransferState.ABORTED]
    assert_all_blocks_back(prefill, decode)


def test_wait_async(pair):
    prefill, decode = pair
    send, recv, src, dst = start(prefill, decode, "async", 5)

    async def both():
        return await asyncio.gather(send.wait_async(), recv.wait_async())

    assert asyncio.run(both()) == [TransferState.DONE, TransferState.DONE]
    assert decode.block_bytes(dst) == prefill.block_bytes(src)
    assert_all_blocks_back(prefill, decode)


def test_caller_errors_are_refused_with_clear_messages(pair):
    prefill, decode = pair
    recv = decode.agent.prepare_receive("v", [1, 2], 1.0)
    with pytest.raises(TransferError, match="3 source blocks but the receiver prepared 2"):
        prefill.agent.send("v", [1, 2, 3], recv.descriptors, 1.0)
    with pytest.raises(TransferError, match="descriptors are for request 'v'"):
        prefill.agent.send("w", [1, 2], recv.descriptors, 1.0)
    with pytest.raises(TransferError, match="already has a receive in flight"):
        decode.agent.prepare_receive("v", [3], 1.0)
    with pytest.raises(ValueError, match="outside the pool"):
        decode.agent.prepare_receive("x", [NUM_BLOCKS], 1.0)
    with pytest.raises(ValueError, match="repeat"):
        decode.agent.prepare_receive("x", [4, 4], 1.0)
    other = FakeTransferBackend("stranger", FakeFabric())
    other.register_pool(KVPool(LAYOUT, NUM_BLOCKS))
    with pytest.raises(TransferError, match="unknown peer 'decode'"):
        other.send("v", [1, 2], recv.descriptors, 1.0)
    decode.agent.release("v")


def test_add_peer_refuses_another_layout_naming_the_field(registry):
    fabric = FakeFabric()
    a = FakeTransferBackend("a", fabric, registry=registry)
    a.register_pool(KVPool(LAYOUT, 4))
    b = FakeTransferBackend("b", fabric, registry=registry)
    other = KVLayout(3, 4, 8, 4, torch.float32)
    md = b.register_pool(KVPool(other, 4))
    with pytest.raises(TransferError) as info:
        a.add_peer("b", md)
    assert "num_kv_heads: a=2 b=4" in str(info.value)
    assert "dtype: a=bfloat16 b=float32" in str(info.value)


def test_metrics_count_transfers_per_backend(pair, registry):
    prefill, decode = pair
    send, recv, _, _ = start(prefill, decode, "m", 3)
    send.wait()
    recv.wait()
    labels = {"backend": "fake", "role": "send"}
    moved = registry.get_sample_value("splitserve_kvtransfer_bytes_total", labels)
    assert moved == 3 * LAYOUT.block_bytes
    done = registry.get_sample_value(
        "splitserve_kvtransfer_transfers_total", {**labels, "state": "done"}
    )
    assert done == 1
    count = registry.get_sample_value(
        "splitserve_kvtransfer_seconds_count", {"backend": "fake", "role": "receive"}
    )
    assert count == 1
    # A third agent in the same process and registry reuses the collectors.
    FakeTransferBackend("third", FakeFabric(), registry=registry).close()


def test_a_restarted_peer_replaces_its_earlier_process(registry):
    """Same replica, new agent (its next process): what was kept about the old one goes, and
    transfers reach the new one; unnamed agents are never taken for one another."""
    fabric = FakeFabric()
    prefill = FakeTransferBackend("prefill-0-1", fabric, registry=registry)
    prefill.register_pool(KVPool(LAYOUT, NUM_BLOCKS), replica="prefill-0@h")
    first = FakeTransferBackend("decode-0-100", fabric, registry=registry)
    prefill.add_peer("decode-0-100", first.register_pool(KVPool(LAYOUT, 4), replica="decode-0@h"))
    other = FakeTransferBackend("decode-1-101", fabric, registry=registry)
    prefill.add_peer("decode-1-101", other.register_pool(KVPool(LAYOUT, 4), replica="decode-1@h"))
    first.close()  # killed
    second = FakeTransferBackend("decode-0-102", fabric, registry=registry)
    restarted = second.register_pool(KVPool(LAYOUT, 4), replica="decode-0@h")
    assert restarted.replica == "decode-0@h"
    prefill.add_peer("decode-0-102", restarted)
    assert prefill.peer_names == ["decode-0-102", "decode-1-101"]
    second.add_peer("prefill-0-1", prefill.metadata)
    recv = second.prepare_receive("r", [0, 1], 2.0)
    sent = prefill.send("r", [5, 6], recv.descriptors, 2.0)
    sessions = [
        TransferSession(prefill, sent, lambda _: None),
        TransferSession(second, recv, lambda _: None),
    ]
    assert [s.wait() for s in sessions] == [TransferState.DONE, TransferState.DONE]
    for name in ("x-1", "x-2"):
        peer = FakeTransferBackend(name, fabric, registry=registry)
        prefill.add_peer(name, peer.register_pool(KVPool(LAYOUT, 4)))
    assert {"x-1", "x-2"} <= set(prefill.peer_names)
