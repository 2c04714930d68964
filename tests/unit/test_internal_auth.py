"""Internal auth: a server with the deployment's token refuses every call without it (unary,
server-streaming and client-streaming alike) with UNAUTHENTICATED and logs it, takes calls
that carry it, keeps health open; the data plane's handshake is signed; a missing or short
token file is a clear error."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.kvcache.pool import KVLayout, KVPool
from services.coordinator.route.registry import WorkerRegistry
from services.coordinator.route.registry_service import RegistryService
from services.kvtransfer import wire
from services.kvtransfer.tcp import TcpTransferBackend
from services.kvtransfer.types import TransferState
from services.worker.health import WorkerHealth
from shared.config.schema import ConfigError, parse_config
from shared.proto_gen import worker_pb2 as pb
from shared.proto_gen import worker_pb2_grpc as pb_grpc
from shared.rpc.auth import InternalAuth, read_token

TOKEN = "t" * 32


class _Worker(pb_grpc.WorkerServicer):
    async def Stats(self, request, context):
        return pb.StatsResponse(json="{}")

    async def Decode(self, request, context):
        yield pb.DecodeChunk()


async def _serve(auth: InternalAuth) -> tuple[grpc.aio.Server, str]:
    server = auth.server()
    pb_grpc.add_WorkerServicer_to_server(_Worker(), server)
    registry = WorkerRegistry(parse_config({}), {})
    pb_grpc.add_RegistryServicer_to_server(RegistryService(registry), server)
    health = WorkerHealth()
    await health.add_to(server)
    await health.serving()
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def _calls(channel: grpc.aio.Channel) -> dict[str, grpc.StatusCode]:
    """Each kind of call once: its status code."""
    worker, registry = pb_grpc.WorkerStub(channel), pb_grpc.RegistryStub(channel)

    async def batches():
        yield pb.KVEventBatch(worker_id="w")

    async def code(call) -> grpc.StatusCode:
        try:
            await call()
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK

    async def decode():
        return [c async for c in worker.Decode(pb.DecodeRequest(), timeout=5)]

    return {
        "unary": await code(lambda: worker.Stats(pb.StatsRequest(), timeout=5)),
        "server_stream": await code(decode),
        "client_stream": await code(lambda: registry.PublishKVEvents(batches(), timeout=5)),
        "health": await code(
            lambda: health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
        ),
    }


def test_calls_without_the_token_are_refused_and_logged(caplog):
    async def scenario():
        server, address = await _serve(InternalAuth(TOKEN))
        try:
            async with grpc.aio.insecure_channel(address) as bare:
                anonymous = await _calls(bare)
            async with InternalAuth("w" * 32).channel(address) as wrong:
                guessed = await _calls(wrong)
            async with InternalAuth(TOKEN).channel(address) as right:
                trusted = await _calls(right)
        finally:
            await server.stop(grace=0)
        return anonymous, guessed, trusted

    with caplog.at_level(logging.WARNING, logger="shared.rpc.auth"):
        anonymous, guessed, trusted = asyncio.run(scenario())
    refused = {
        k: grpc.StatusCode.UNAUTHENTICATED for k in ("unary", "server_stream", "client_stream")
    }
    assert anonymous == guessed == {**refused, "health": grpc.StatusCode.OK}
    assert set(trusted.values()) == {grpc.StatusCode.OK}
    logged = [r.getMessage() for r in caplog.records]
    assert "refused an unauthenticated call to /splitserve.worker.v1.Worker/Stats" in logged


def test_a_blocking_channel_carries_the_token():
    async def scenario():
        server, address = await _serve(InternalAuth(TOKEN))
        try:
            return await asyncio.to_thread(_sync_stats, address)
        finally:
            await server.stop(grace=0)

    assert asyncio.run(scenario()) == ("{}", grpc.StatusCode.UNAUTHENTICATED)


def _sync_stats(address: str) -> tuple[str, grpc.StatusCode]:
    with InternalAuth(TOKEN).sync_channel(address) as channel:
        ok = pb_grpc.WorkerStub(channel).Stats(pb.StatsRequest(), timeout=5).json
    with InternalAuth().sync_channel(address) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            pb_grpc.WorkerStub(channel).Stats(pb.StatsRequest(), timeout=5)
    return ok, refused.value.code()


def test_without_a_token_nothing_is_checked():
    assert InternalAuth().accepts(None) and not InternalAuth(TOKEN).accepts(None)
    assert InternalAuth(TOKEN).accepts([("authorization", f"Bearer {TOKEN}")])
    assert not InternalAuth(TOKEN).accepts([("authorization", f"Bearer {TOKEN[:-1]}")])


def test_a_missing_or_short_token_file_is_a_clear_error(tmp_path):
    missing = tmp_path / "nope"
    config = parse_config({"internal_auth": {"token_file": str(missing)}})
    with pytest.raises(ConfigError, match=f"internal_auth.token_file: {missing} does not exist"):
        InternalAuth.from_config(config)
    short = tmp_path / "short"
    short.write_text("abc\n")
    with pytest.raises(ConfigError, match="holds 3 characters; at least 16"):
        read_token(str(short))
    good = tmp_path / "good"
    good.write_text(f"  {TOKEN}\n")
    assert read_token(str(good)) == TOKEN


REQUEST = wire.TransferRequest(wire.Kind.PUSH, "r1", "prefill-0", 4096, (1, 2), (5, 6))


class _Bytes:
    """A socket stand-in that reads from a byte string."""

    def __init__(self, data: bytes):
        self.data = memoryview(data)

    def recv_into(self, view: memoryview) -> int:
        n = min(len(view), len(self.data))
        view[:n] = self.data[:n]
        self.data = self.data[n:]
        return n


def test_the_transfer_handshake_is_signed_and_checked():
    key, other = b"k" * 32, b"o" * 32
    signed = wire.encode_request(REQUEST, key)
    assert wire.read_request(_Bytes(signed), key) == REQUEST
    assert wire.read_request(_Bytes(signed)) == REQUEST  # a receiver without a key ignores it
    for frame, receiver_key in ((wire.encode_request(REQUEST), key), (signed, other)):
        with pytest.raises(wire.Unauthenticated):
            wire.read_request(_Bytes(frame), receiver_key)
    tampered = bytearray(signed)
    tampered[wire._REQUEST.size] ^= 1  # the request id's first byte
    with pytest.raises(wire.Unauthenticated):
        wire.read_request(_Bytes(bytes(tampered)), key)


def test_a_tcp_transfer_from_a_sender_without_the_key_is_refused_fast():
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_size=4, dtype=torch.float32)
    receiver = TcpTransferBackend("decode", auth_key=b"k" * 32)
    intruder = TcpTransferBackend("intruder")
    try:
        receiver_md = receiver.register_pool(KVPool(layout, 4))
        intruder_md = intruder.register_pool(KVPool(layout, 4))
        intruder.add_peer("decode", receiver_md)
        receiver.add_peer("intruder", intruder_md)
        handle = receiver.prepare_receive("r1", [0, 1], 10.0)
        sent = intruder.send("r1", [2, 3], handle.descriptors, 10.0)
        start = time.monotonic()
        while not intruder.poll(sent).terminal and time.monotonic() - start < 5:
            time.sleep(0.01)
        assert intruder.poll(sent) is TransferState.FAILED
        assert "unauthenticated" in sent.error and time.monotonic() - start < 2
        assert receiver.poll(handle) is TransferState.PENDING  # nothing was written
    finally:
        receiver.close()
        intruder.close()
