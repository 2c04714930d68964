"""The kvtransfer control plane over a real grpc.aio server on 127.0.0.1 (ephemeral port)."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest
import torch
from prometheus_client import CollectorRegistry

from engine.kvcache.block_manager import BlockManager
from engine.kvcache.pool import KVLayout, KVPool
from services.kvtransfer.blockbytes import byte_view
from services.kvtransfer.control import (
    BlocksUnavailable,
    KvTransferControlServicer,
    add_control_servicer,
)
from services.kvtransfer.control_client import (
    ControlPlaneError,
    KvTransferControlClient,
    push_blocks,
)
from services.kvtransfer.fake import FakeFabric, FakeTransferBackend
from services.kvtransfer.interface import TransferBackend
from services.kvtransfer.tcp import TcpTransferBackend
from services.kvtransfer.types import AgentMetadata, TransferState
from tools.bench.transfer_peer import alarm_after

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, dtype=torch.float16)
NUM_BLOCKS = 16


@pytest.fixture(autouse=True)
def _hard_timeout():
    with alarm_after(30):
        yield


def tokens(n_blocks: int, rng: random.Random) -> list[int]:
    return [rng.randrange(1 << 30) for _ in range(n_blocks * LAYOUT.block_size)]


class DecodeControl(KvTransferControlServicer):
    """The decode service's part, with a real BlockManager behind it."""

    def __init__(self, backend: TransferBackend, **kwargs):
        super().__init__(backend, **kwargs)
        self.blocks = BlockManager(NUM_BLOCKS, LAYOUT.block_size)
        self.tables: dict = {}
        self.kept: dict = {}
        self.finished: list[tuple[str, TransferState]] = []
        self._rng = random.Random(7)

    async def allocate_blocks(self, request_id: str, num_blocks: int) -> list[int]:
        allocation = self.blocks.allocate(tokens(num_blocks, self._rng))
        if allocation is None:
            raise BlocksUnavailable(
                f"{num_blocks} blocks wanted, {self.blocks.num_available_blocks} available"
            )
        self.tables[request_id] = allocation.table
        return list(allocation.table.block_ids)

    def on_transfer_finished(self, request_id, block_ids, state) -> None:
        self.finished.append((request_id, state))
        table = self.tables.pop(request_id)
        if state is TransferState.DONE:
            self.kept[request_id] = table  # handed to the decode sequence
        else:
            self.blocks.free(table)


def make_transfer_backends(kind: str) -> tuple[TransferBackend, TransferBackend]:
    registry = CollectorRegistry()
    if kind == "fake":
        fabric = FakeFabric()
        return (
            FakeTransferBackend("prefill", fabric, registry=registry),
            FakeTransferBackend("decode", fabric, registry=registry),
        )
    return (
        TcpTransferBackend("prefill", registry=registry),
        TcpTransferBackend("decode", registry=registry),
    )


class GatedControl(DecodeControl):
    """Reserving blocks waits for `gate`, as a trip to a busy engine thread does."""

    def __init__(self, backend: TransferBackend, **kwargs):
        super().__init__(backend, **kwargs)
        self.gate = asyncio.Event()
        self.allocating = 0

    async def allocate_blocks(self, request_id: str, num_blocks: int) -> list[int]:
        self.allocating += 1
        await self.gate.wait()
        return await super().allocate_blocks(request_id, num_blocks)


class Harness:
    def __init__(self, kind: str, grace_s: float = 0.2, control=DecodeControl):
        self.prefill, decode = make_transfer_backends(kind)
        self.prefill_pool = KVPool(LAYOUT, NUM_BLOCKS)
        raw = byte_view(self.prefill_pool.tensor)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))
        self.prefill.register_pool(self.prefill_pool)
        self.decode_pool = KVPool(LAYOUT, NUM_BLOCKS)
        decode.register_pool(self.decode_pool)
        self.servicer = control(decode, grace_s=grace_s)
        self.prefill_blocks = BlockManager(NUM_BLOCKS, LAYOUT.block_size)
        self.prefill_released: list[TransferState] = []
        self._rng = random.Random(3)

    async def __aenter__(self) -> Harness:
        self.server = grpc.aio.server()
        add_control_servicer(self.server, self.servicer)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        self.client = KvTransferControlClient(self.channel)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.channel.close()
        await self.servicer.close()
        await self.server.stop(grace=None)
        self.prefill.close()
        self.servicer.backend.close()

    def prefill_table(self, n: int):
        return self.prefill_blocks.allocate(tokens(n, self._rng)).table

    def release_prefill(self, table):
        def release(state: TransferState) -> None:
            self.prefill_released.append(state)
            self.prefill_blocks.free(table)

        return release


@pytest.mark.parametrize("kind", ["fake", "tcp"])
def test_prepare_transfer_done_release(kind):
    async def scenario():
        async with Harness(kind) as h:
            table = h.prefill_table(5)
            src = list(table.block_ids)
            expected = h.prefill_pool.read_blocks(src)
            result = await push_blocks(
                h.client,
                h.prefill,
                "req-1",
                src,
                deadline_s=5.0,
                on_release=h.release_prefill(table),
            )
            assert (result.sender_state, result.receiver_state) == (
                TransferState.DONE,
                TransferState.DONE,
            )
            kept = h.servicer.kept["req-1"]
            assert torch.equal(
                byte_view(h.decode_pool.read_blocks(kept.block_ids)), byte_view(expected)
            )
            assert h.prefill_released == [TransferState.DONE]
            assert h.prefill_blocks.num_free_blocks == NUM_BLOCKS
            assert h.servicer.finished == [("req-1", TransferState.DONE)]
            assert await h.client.release("req-1") is True
            assert await h.client.release("req-1") is False
            h.prefill_blocks.check_integrity()
            h.servicer.blocks.check_integrity()

    asyncio.run(scenario())


def test_layout_mismatch_is_refused_naming_the_field():
    async def scenario():
        async with Harness("fake") as h:
            md = h.prefill.metadata
            wrong = AgentMetadata(
                md.backend,
                md.agent_name,
                KVLayout(2, 4, 16, 4, torch.float16),
                md.num_blocks,
                md.payload,
            )
            with pytest.raises(ControlPlaneError) as info:
                await h.client.prepare_receive("req-x", 2, wrong, 5.0)
            assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT
            assert "num_kv_heads: sender=4 receiver=2" in info.value.details
            assert h.servicer.blocks.num_free_blocks == NUM_BLOCKS
            assert h.servicer.finished == []

    asyncio.run(scenario())


def test_refusals_release_the_prefill_blocks_once():
    async def scenario():
        async with Harness("fake") as h:
            md = h.prefill.metadata
            tcp_sender = AgentMetadata("tcp", "p", md.layout, md.num_blocks, b"{}")
            with pytest.raises(ControlPlaneError) as info:
                await h.client.prepare_receive("req-b", 1, tcp_sender, 5.0)
            assert info.value.code is grpc.StatusCode.FAILED_PRECONDITION
            assert "'tcp' backend" in info.value.details
            busy = h.servicer.blocks.allocate(tokens(1, random.Random(1)))  # decode: 15 free
            table = h.prefill_table(NUM_BLOCKS)
            with pytest.raises(ControlPlaneError) as info:
                await push_blocks(
                    h.client,
                    h.prefill,
                    "req-big",
                    list(table.block_ids),
                    deadline_s=5.0,
                    on_release=h.release_prefill(table),
                )
            assert info.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "16 blocks wanted, 15 available" in info.value.details
            h.servicer.blocks.free(busy.table)
            assert h.prefill_released == [TransferState.FAILED]
            assert h.prefill_blocks.num_free_blocks == NUM_BLOCKS

    asyncio.run(scenario())


def test_vanished_sender_still_frees_decode_blocks():
    async def scenario():
        async with Harness("fake", grace_s=0.05) as h:
            prepared = await h.client.prepare_receive("ghost", 3, h.prefill.metadata, 0.05)
            assert len(prepared.descriptors.blocks) == 3
            assert h.servicer.blocks.num_free_blocks == NUM_BLOCKS - 3
            for _ in range(200):
                if h.servicer.finished:
                    break
                await asyncio.sleep(0.01)
            assert h.servicer.finished == [("ghost", TransferState.TIMED_OUT)]
            assert h.servicer.blocks.num_free_blocks == NUM_BLOCKS
            late, _ = await h.client.transfer_done("ghost", TransferState.DONE)
            assert late is TransferState.TIMED_OUT

    asyncio.run(scenario())


def test_abort_and_sender_failure_free_decode_blocks():
    async def scenario():
        async with Harness("fake") as h:
            await h.client.prepare_receive("a", 2, h.prefill.metadata, 5.0)
            await h.client.prepare_receive("b", 2, h.prefill.metadata, 5.0)
            assert await h.client.abort("a", "client went away") is True
            assert await h.client.abort("a") is False
            state, _ = await h.client.transfer_done("b", TransferState.FAILED, error="oom")
            assert state is TransferState.ABORTED
            assert sorted(h.servicer.finished) == [
                ("a", TransferState.ABORTED),
                ("b", TransferState.ABORTED),
            ]
            assert h.servicer.blocks.num_free_blocks == NUM_BLOCKS
            with pytest.raises(ControlPlaneError) as info:
                await h.client.transfer_done("never", TransferState.DONE)
            assert info.value.code is grpc.StatusCode.NOT_FOUND
            h.servicer.blocks.check_integrity()

    asyncio.run(scenario())


def test_a_duplicate_prepare_while_blocks_are_reserved_is_refused():
    async def scenario():
        async with Harness("fake", control=GatedControl) as h:
            first = asyncio.create_task(h.client.prepare_receive("dup", 2, h.prefill.metadata, 5.0))
            for _ in range(500):
                if h.servicer.allocating:
                    break
                await asyncio.sleep(0.01)
            with pytest.raises(ControlPlaneError) as info:
                await h.client.prepare_receive("dup", 2, h.prefill.metadata, 5.0)
            assert info.value.code is grpc.StatusCode.ALREADY_EXISTS
            h.servicer.gate.set()
            assert len((await first).descriptors.blocks) == 2
            assert h.servicer.allocating == 1  # the duplicate never reserved anything
            assert await h.client.abort("dup") is True
            assert h.servicer.blocks.num_free_blocks == NUM_BLOCKS
            h.servicer.blocks.check_integrity()

    asyncio.run(scenario())
