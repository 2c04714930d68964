"""First token first, through the real gRPC path (in-process fleet, tiny model): the client
gets the prefill replica's first token before the KV push is over, Decode is opened on it at
once, and the decode replica meets the KV in whatever order the two arrive — before the
PrepareReceive, while the blocks are written, after TransferDone — or prefills locally when
the push fails or times out. The greedy text equals the single-process engine's every time,
and every replica ends with its starting free blocks and a clean block manager.

The orders are forced with gates on the push (held before PrepareReceive, before the data
plane, or the Decode call held until TransferDone) and observed, never timed.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

import pytest

from engine.core.config import EngineConfig
from engine.core.engine import Engine
from services.coordinator.attempt.retry import RetryLoop
from services.coordinator.route.targets import RetryPolicy
from services.kvtransfer.control_client import KvTransferControlClient
from services.kvtransfer.types import TransferError, TransferState
from services.worker.arrivals import Stage
from services.worker.decode import DecodeService
from shared.proto_gen import worker_pb2 as pb
from tests.unit.test_migration_backend import (
    PROMPT,
    Fleet,
    fleet_config,
    request,
    start_fleet,
    tiny_folder,  # noqa: F401 - the fixture
    tokens,
)
from tests.unit.test_migration_cancel import assert_settled, free_blocks, settled

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def expected(tiny_model) -> list[int]:
    """The plain single-process engine's greedy output for PROMPT."""
    engine = Engine(EngineConfig(num_blocks=64), model=tiny_model)
    return engine.generate([list(PROMPT)], greedy_params())[0]


def greedy_params():
    from shared.sampling.params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@dataclass
class Gates:
    """Holds a push or a Decode call at chosen points; records what happened in order."""

    before_prepare: asyncio.Event = field(default_factory=asyncio.Event)
    before_send: asyncio.Event = field(default_factory=asyncio.Event)
    before_decode: asyncio.Event = field(default_factory=asyncio.Event)
    events: list[str] = field(default_factory=list)
    decode_chunks: list[pb.DecodeChunk] = field(default_factory=list)
    receive_ends: list[TransferState] = field(default_factory=list)

    def open_all(self) -> None:
        for gate in (self.before_prepare, self.before_send, self.before_decode):
            gate.set()

    @property
    def local_prefill(self) -> bool:
        return self.decode_chunks[0].local_prefill


def install_gates(monkeypatch) -> Gates:
    gates = Gates()
    real_prepare = KvTransferControlClient.prepare_receive
    real_done = KvTransferControlClient.transfer_done
    real_decode = DecodeService.decode

    async def prepare_receive(self, *args, **kwargs):
        await gates.before_prepare.wait()
        prepared = await real_prepare(self, *args, **kwargs)
        gates.events.append("prepared")
        await gates.before_send.wait()
        return prepared

    async def transfer_done(self, *args, **kwargs):
        answer = await real_done(self, *args, **kwargs)
        gates.events.append("transfer_done")
        return answer

    async def decode(self, request, context):
        gates.events.append("decode_call")
        await gates.before_decode.wait()
        async for chunk in real_decode(self, request, context):
            gates.decode_chunks.append(chunk)
            yield chunk

    monkeypatch.setattr(KvTransferControlClient, "prepare_receive", prepare_receive)
    monkeypatch.setattr(KvTransferControlClient, "transfer_done", transfer_done)
    monkeypatch.setattr(DecodeService, "decode", decode)
    return gates


def watch_receives(fleet: Fleet, gates: Gates) -> None:
    """Records how each receive on the decode replica ended (the control plane's hook)."""
    (decode,) = fleet.role("decode")
    control = decode.control
    assert control is not None
    real = control.on_transfer_finished

    def on_transfer_finished(request_id, block_ids, state):
        gates.receive_ends.append(state)
        real(request_id, block_ids, state)

    control.on_transfer_finished = on_transfer_finished  # type: ignore[method-assign]


async def until(predicate, what: str, steps: int = 2000) -> None:
    """Yields to the loop until `predicate()` holds: waits for an event, asserts no time."""
    for _ in range(steps):
        if predicate():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never happened: {what}")


async def integrity(fleet: Fleet) -> None:
    for replica in fleet.replicas.values():
        await replica.runtime.async_engine.call(lambda e: e.blocks.check_integrity())


def greedy_request(rid: str):
    return request(rid, MAX_TOKENS, ignore_eos=True)


async def run_ordered(fleet: Fleet, gates: Gates, rid: str, release) -> list:
    """Streams `rid`; once the client has its first token, `release(rid)` opens the gates
    in the order the scenario wants, while the client asks for more (as the HTTP layer's
    pump does once the token is written: only then does the attempt open Decode)."""
    chunks: list = []
    releasing: asyncio.Task | None = None
    stream = fleet.loop.generate(greedy_request(rid))
    async with contextlib.aclosing(stream):
        async for chunk in stream:
            chunks.append(chunk)
            if len(chunks) == 1:
                gates.events.append("client_first_token")
                releasing = asyncio.create_task(release(rid))
    assert releasing is not None
    await releasing
    return chunks


def scenario(tiny_folder, real_tokenizer, body, *, transfer_deadline_s: float = 5.0):  # noqa: F811
    async def main():
        fleet = await start_fleet(
            fleet_config(tiny_folder, {"prefill": 1, "decode": 1}),
            real_tokenizer,
            transfer_deadline_s=transfer_deadline_s,
        )
        try:
            start = await free_blocks(fleet)
            result = await body(fleet)
            stats = await settled(fleet, start)
            await integrity(fleet)
            return result, start, stats
        finally:
            await fleet.close()

    result, start, stats = asyncio.run(main())
    assert_settled(stats, start)
    return result


def transfer_of(chunks: list) -> dict:
    """The push's outcome as the response reports it (the HTTP layer keeps every chunk's
    metadata for the last one; here it is on whichever chunk came after the outcome)."""
    (transfer,) = [c.metadata["transfer"] for c in chunks if "transfer" in (c.metadata or {})]
    return transfer


def decode_arrivals(fleet: Fleet):
    (decode,) = fleet.role("decode")
    return decode.runtime.arrivals


def test_decode_call_before_prepare_receive(tiny_folder, real_tokenizer, expected, monkeypatch):  # noqa: F811
    gates = install_gates(monkeypatch)
    gates.before_send.set()
    gates.before_decode.set()

    async def body(fleet: Fleet):
        arrivals = decode_arrivals(fleet)

        async def release(rid: str) -> None:
            await until(lambda: arrivals.waiting(rid) == 1, "the Decode call waits")
            assert arrivals.stage(rid) is Stage.EXPECTED  # no PrepareReceive yet
            gates.before_prepare.set()

        return await run_ordered(fleet, gates, "before", release)

    chunks = scenario(tiny_folder, real_tokenizer, body)
    assert tokens(chunks) == expected
    assert "transfer" not in (chunks[0].metadata or {})  # the first token did not wait for it
    assert transfer_of(chunks)["status"] == "done"
    assert not gates.local_prefill and gates.decode_chunks[0].kv_wait_ms > 0
    order = gates.events
    assert order.index("client_first_token") < order.index("prepared")
    assert order.index("decode_call") < order.index("prepared")


def test_decode_call_while_the_blocks_are_written(
    tiny_folder,  # noqa: F811
    real_tokenizer,
    expected,
    monkeypatch,
):
    gates = install_gates(monkeypatch)
    gates.before_prepare.set()
    gates.before_decode.set()

    async def body(fleet: Fleet):
        arrivals = decode_arrivals(fleet)

        async def release(rid: str) -> None:
            await until(
                lambda: arrivals.waiting(rid) == 1 and arrivals.stage(rid) is Stage.RECEIVING,
                "the Decode call waits on a prepared receive",
            )
            gates.before_send.set()

        return await run_ordered(fleet, gates, "during", release)

    chunks = scenario(tiny_folder, real_tokenizer, body)
    assert tokens(chunks) == expected
    assert transfer_of(chunks)["status"] == "done"
    assert not gates.local_prefill
    order = gates.events
    assert order.index("prepared") < order.index("transfer_done")


def test_decode_call_after_transfer_done(tiny_folder, real_tokenizer, expected, monkeypatch):  # noqa: F811
    gates = install_gates(monkeypatch)
    gates.before_prepare.set()
    gates.before_send.set()

    async def body(fleet: Fleet):
        arrivals = decode_arrivals(fleet)

        async def release(rid: str) -> None:
            await until(lambda: "transfer_done" in gates.events, "TransferDone")
            assert arrivals.stage(rid) is Stage.LANDED  # parked for the call held back
            gates.before_decode.set()

        return await run_ordered(fleet, gates, "after", release)

    chunks = scenario(tiny_folder, real_tokenizer, body)
    assert tokens(chunks) == expected
    assert transfer_of(chunks)["status"] == "done"
    assert not gates.local_prefill


def test_transfer_failure_after_the_first_token_prefills_locally(
    tiny_folder,  # noqa: F811
    real_tokenizer,
    expected,
    monkeypatch,
):
    gates = install_gates(monkeypatch)
    gates.before_prepare.set()
    gates.before_decode.set()

    async def body(fleet: Fleet):
        watch_receives(fleet, gates)
        (prefill,) = fleet.role("prefill")
        arrivals = decode_arrivals(fleet)

        def broken_send(*args, **kwargs):
            raise TransferError("injected: the data plane is down")

        monkeypatch.setattr(prefill.runtime.transfer, "send", broken_send)

        async def release(rid: str) -> None:
            await until(
                lambda: arrivals.waiting(rid) == 1 and arrivals.stage(rid) is Stage.RECEIVING,
                "the Decode call waits on a prepared receive",
            )
            gates.before_send.set()

        return await run_ordered(fleet, gates, "failing", release)

    chunks = scenario(tiny_folder, real_tokenizer, body)
    assert tokens(chunks) == expected
    assert gates.local_prefill
    assert gates.receive_ends == [TransferState.ABORTED]  # the sender told it at once
    transfer = transfer_of(chunks)
    assert transfer["status"] == "failed" and "injected" in transfer["error"]
    assert chunks[-1].num_output_tokens == MAX_TOKENS


def test_transfer_timeout_after_the_first_token_prefills_locally(
    tiny_folder,  # noqa: F811
    real_tokenizer,
    expected,
    monkeypatch,
):
    """The sender stalls after PrepareReceive until the decode replica's receive has timed
    out: the Decode call, waiting on it, prefills locally and the text is unchanged."""
    gates = install_gates(monkeypatch)
    gates.before_prepare.set()
    gates.before_decode.set()

    async def body(fleet: Fleet):
        watch_receives(fleet, gates)
        arrivals = decode_arrivals(fleet)

        async def release(rid: str) -> None:
            await until(lambda: arrivals.stage(rid) is Stage.RECEIVING, "PrepareReceive")
            # Released when the receive is over: the stalled sender then finds it gone.
            asyncio.get_running_loop().create_task(open_after_receive_ended())

        async def open_after_receive_ended() -> None:
            await until(lambda: gates.receive_ends, "the receive's deadline", steps=4000)
            gates.before_send.set()

        return await run_ordered(fleet, gates, "stalled", release)

    chunks = scenario(tiny_folder, real_tokenizer, body, transfer_deadline_s=1.0)
    assert tokens(chunks) == expected
    assert gates.local_prefill
    assert gates.receive_ends == [TransferState.TIMED_OUT]
    assert transfer_of(chunks)["status"] != "done"


def test_client_leaving_during_the_transfer_frees_every_block(
    tiny_folder,  # noqa: F811
    real_tokenizer,
    monkeypatch,
):
    gates = install_gates(monkeypatch)
    gates.before_prepare.set()
    gates.before_decode.set()

    async def body(fleet: Fleet):
        watch_receives(fleet, gates)
        arrivals = decode_arrivals(fleet)
        stream = fleet.loop.generate(greedy_request("leaver"))
        async with contextlib.aclosing(stream):
            first = await anext(stream)
            # The client asks for more (the token is written): the attempt opens Decode.
            more = asyncio.ensure_future(anext(stream))
            await until(
                lambda: (
                    arrivals.waiting("leaver") == 1 and arrivals.stage("leaver") is Stage.RECEIVING
                ),
                "the Decode call waits on a prepared receive",
            )
            more.cancel()  # as the HTTP layer cancels its pump when the client goes
            with contextlib.suppress(asyncio.CancelledError):
                await more
        # The stream is closed: the client is gone while its KV was being written.
        await until(lambda: gates.receive_ends, "the receive ends")
        gates.before_send.set()  # the cancelled push must not resurrect anything
        return first

    first = scenario(tiny_folder, real_tokenizer, body)
    assert first.token_ids
    assert gates.receive_ends == [TransferState.ABORTED]
    assert not gates.decode_chunks  # the Decode call never produced a token


def test_fallback_deadline_counts_the_streamed_first_token(
    tiny_folder,  # noqa: F811
    real_tokenizer,
    expected,
    monkeypatch,
):
    """The first token gets through the fallback layer while the push has not even begun,
    so a transfer slower than the TTFT deadline does not make the request fall back."""
    gates = install_gates(monkeypatch)
    gates.before_send.set()
    gates.before_decode.set()

    async def body(fleet: Fleet):
        policy = RetryPolicy(models=["tiny", "tiny"], ttft_timeout_ms=30_000)
        backend = RetryLoop(fleet.backend, policy, fleet.loop.tokenizer)
        chunks = []
        stream = backend.generate(greedy_request("fallback"))
        async with contextlib.aclosing(stream):
            async for chunk in stream:
                chunks.append(chunk)
                if len(chunks) == 1:
                    assert "prepared" not in gates.events
                    gates.before_prepare.set()
        return chunks

    chunks = scenario(tiny_folder, real_tokenizer, body)
    assert tokens(chunks) == expected
    (attempt,) = chunks[-1].metadata["attempts"]
    assert attempt["success"] and attempt["model"] == "tiny"
    assert transfer_of(chunks)["status"] == "done"
