"""A worker registered with several coordinators: each gets its registration, snapshot and
KV events (one index, everywhere); a restarted coordinator is resynced within a heartbeat; a
refusal is final; endpoints resolve to every address, one family, in a stable order."""

from __future__ import annotations

import asyncio
import queue
import socket
import time
from types import SimpleNamespace

import grpc
import pytest

from services.coordinator.route.registry import WorkerRegistry
from services.coordinator.route.registry_service import RegistryService
from services.launcher.ports import pick_free_ports
from services.worker.coordinators import resolve_registries
from services.worker.registration import RegistrationRefused
from services.worker.registrations import Registrations
from shared.config.schema import ConfigError, parse_config
from shared.kvblocks.events import KVEvent
from shared.proto_gen import worker_pb2_grpc as pb_grpc
from shared.rpc.auth import InternalAuth
from shared.wire.records import WorkerLoad

MODEL = "SmolLM2-135M-Instruct"
INTERVAL_S = 0.2
AUTH = InternalAuth("s" * 32)
CONFIG = parse_config(
    {"coordinator": {"heartbeat_interval_s": INTERVAL_S, "heartbeat_timeout_s": 2.0}}
)


class FakeEngine:
    """What registration reads of an engine: load, max length, cached hashes with their seq."""

    max_model_len = 2048

    def __init__(self) -> None:
        self.held: list[int] = []
        self.blocks = SimpleNamespace(
            cached_hashes=lambda: {"device": list(self.held)},
            events=SimpleNamespace(last_seq=0),
        )

    def load(self) -> WorkerLoad:
        return WorkerLoad()


def fake_runtime(engine: FakeEngine) -> SimpleNamespace:
    async def call(fn):
        return fn(engine)

    return SimpleNamespace(
        config=CONFIG,
        model_cfg=CONFIG.models[0],
        worker_id="decode-0-host-1",
        replica="decode-0@host",
        role="decode",
        tokenizer_fingerprint="fp",
        transfer=SimpleNamespace(metadata=SimpleNamespace(agent_name="agent")),
        transfer_kind="shm",
        engine=engine,
        async_engine=SimpleNamespace(call=call),
        kv_events=queue.Queue(),
        auth=AUTH,
    )


def store(runtime: SimpleNamespace, *hashes: int) -> None:
    """The engine caching blocks: its state and the event it emits."""
    engine = runtime.engine
    engine.held += hashes
    engine.blocks.events.last_seq += 1
    runtime.kv_events.put(KVEvent("stored", hashes, "device", engine.blocks.events.last_seq))


class Coordinator:
    """A real registry gRPC server over a fresh WorkerRegistry (a coordinator process)."""

    def __init__(self, port: int, fingerprint: str = "fp"):
        self.port = port
        self.registry = WorkerRegistry(CONFIG, {MODEL: fingerprint})
        self.server: grpc.aio.Server | None = None

    async def start(self) -> Coordinator:
        self.server = AUTH.server()  # internal auth on: the clients must carry the token
        pb_grpc.add_RegistryServicer_to_server(RegistryService(self.registry), self.server)
        self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        await self.server.start()
        return self

    async def stop(self) -> None:
        await self.server.stop(grace=0)

    def view(self) -> tuple[int, list[int]] | None:
        """(last seq, held hashes) its index has of the worker; None: not registered."""
        (worker_id,) = self.registry.workers or [None]
        if worker_id is None:
            return None
        return self.registry.kv.last_seq(worker_id), sorted(self.registry.kv.held(worker_id))


async def until(predicate, timeout_s: float) -> float:
    """Seconds it took `predicate()` to hold; fails the test after `timeout_s`."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout_s, "timed out"
        await asyncio.sleep(0.01)
    return time.monotonic() - start


def test_every_coordinator_gets_the_same_view_and_a_restarted_one_is_resynced():
    async def scenario():
        a, b = [await Coordinator(p).start() for p in pick_free_ports(2)]
        runtime = fake_runtime(FakeEngine())
        store(runtime, 11, 12)  # cached before registering: goes in the snapshot
        endpoints = [f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"]
        regs = Registrations(runtime, endpoints, "127.0.0.1:9", resolve_interval_s=0.1)
        try:
            await regs.start(timeout_s=10)
            await until(lambda: a.view() == b.view() == (1, [11, 12]), 5)
            store(runtime, 13)
            store(runtime, 14)
            await until(lambda: a.view() == b.view() == (3, [11, 12, 13, 14]), 5)

            # b restarts (same address, empty registry): within about one heartbeat the
            # worker registers again and its snapshot rebuilds the index; a never noticed.
            await b.stop()
            store(runtime, 15)  # b misses this one
            b = await Coordinator(b.port).start()
            took = await until(lambda: b.view() == a.view() == (4, [11, 12, 13, 14, 15]), 5)
            assert took < 3 * INTERVAL_S + 0.5
            assert list(a.registry.workers) == list(b.registry.workers)

            await regs.announce_draining()
            assert all(c.registry.workers[runtime.worker_id].draining for c in (a, b))
        finally:
            await regs.close()
            await a.stop()
            await b.stop()

    asyncio.run(scenario())


def test_the_worker_serves_once_one_coordinator_accepts_and_the_late_one_catches_up():
    async def scenario():
        up_port, late_port = pick_free_ports(2)
        up = await Coordinator(up_port).start()
        runtime = fake_runtime(FakeEngine())
        store(runtime, 7)
        endpoints = [f"127.0.0.1:{late_port}", f"127.0.0.1:{up_port}"]
        regs = Registrations(runtime, endpoints, "127.0.0.1:9")
        late = None
        try:
            await regs.start(timeout_s=10)  # the first endpoint has no coordinator yet
            assert up.view() == (1, [7])
            late = await Coordinator(late_port).start()
            await until(lambda: late.view() == (1, [7]), 5)
        finally:
            await regs.close()
            await up.stop()
            if late is not None:
                await late.stop()

    asyncio.run(scenario())


def test_a_refusal_is_final_and_names_the_reason():
    async def scenario():
        (port,) = pick_free_ports(1)
        picky = await Coordinator(port, fingerprint="other").start()
        regs = Registrations(fake_runtime(FakeEngine()), [f"127.0.0.1:{port}"], "127.0.0.1:9")
        try:
            with pytest.raises(RegistrationRefused, match="tokenizer fingerprint"):
                await regs.start(timeout_s=10)
        finally:
            await regs.close()
            await picky.stop()

    asyncio.run(scenario())


def test_endpoints_resolve_to_every_address_of_one_family():
    addresses = asyncio.run(
        resolve_registries(["127.0.0.1:50151", "localhost:50152", "127.0.0.1:50151"])
    )
    assert addresses[0] == "127.0.0.1:50151" and addresses.count("127.0.0.1:50151") == 1
    local = [a for a in addresses if a.endswith(":50152")]
    # localhost may answer in IPv4 and IPv6: one family is kept, so one registration each.
    assert local in (["127.0.0.1:50152"], ["[::1]:50152"])
    unresolvable = f"no-such-host-{time.time_ns()}.invalid:1"
    with pytest.raises(socket.gaierror):
        socket.getaddrinfo(unresolvable.rpartition(":")[0], 1)
    assert asyncio.run(resolve_registries([unresolvable])) == []


def test_registry_endpoints_are_checked_and_default_to_the_coordinator():
    assert CONFIG.coordinator.registries == ("127.0.0.1:50151",)
    two = parse_config({"coordinator": {"registry_endpoints": ["a.svc:1", "[::1]:2"]}})
    assert two.coordinator.registries == ("a.svc:1", "[::1]:2")
    with pytest.raises(ConfigError, match="registry_endpoints.*'a.svc' is not host:port"):
        parse_config({"coordinator": {"registry_endpoints": ["a.svc"]}})
