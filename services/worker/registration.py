"""A worker's side of one coordinator's registry: register, heartbeat with load, publish KV
events (services/worker/registrations.py keeps one of these per coordinator).

Registration is refused when the worker's model, tokenizer or block size disagree with the
coordinator's config; the worker then exits with the coordinator's reason. A heartbeat the
coordinator does not know (it restarted) triggers a new registration and a full snapshot of
the cached blocks; a reported gap in event sequence numbers triggers a snapshot too.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from services.worker.runtime import WorkerRuntime
from shared.kvblocks.events import KVEvent
from shared.proto_gen import worker_pb2 as pb
from shared.proto_gen import worker_pb2_grpc as pb_grpc
from shared.rpc.channels import RECONNECT_OPTIONS
from shared.wire.convert import kv_event_to_proto, load_to_proto

log = logging.getLogger(__name__)


class RegistrationRefused(RuntimeError):
    pass


def load_proto(runtime: WorkerRuntime) -> pb.WorkerLoad:
    # Read without the engine thread's lock: counts may be one step stale, which is fine
    # for routing (they are a hint, refreshed every heartbeat).
    try:
        load = runtime.engine.load()
    except RuntimeError:  # a list changed size under us mid-step; report next time
        return pb.WorkerLoad()
    return load_to_proto(load)


class RegistryClient:
    def __init__(
        self,
        runtime: WorkerRuntime,
        registry_address: str,
        worker_address: str,
        metrics_address: str = "",
        pump: Callable[[], None] = lambda: None,
    ):
        self.runtime = runtime
        self.registry_address = registry_address
        self.worker_address = worker_address
        self.metrics_address = metrics_address
        # Moves the engine's new KV events into `pending` of every coordinator's client.
        self._pump = pump
        self.pending: list[KVEvent] = []
        self.registered = False  # accepted once; from then on `pending` fills
        # The coordinator may restart: re-register within a second of it being back.
        self._channel = runtime.auth.channel(registry_address, options=RECONNECT_OPTIONS)
        self._stub = pb_grpc.RegistryStub(self._channel)
        self.interval_s = runtime.config.coordinator.heartbeat_interval_s
        self._last_seq = 0
        self.draining = False  # reported with every heartbeat once set

    def _register_request(self) -> pb.RegisterRequest:
        rt = self.runtime
        # Peers exchange full agent metadata over the kvtransfer control plane; the
        # registry only needs to know who is who.
        agent_name = rt.transfer.metadata.agent_name
        return pb.RegisterRequest(
            worker_id=rt.worker_id,
            role=rt.role,
            model=rt.model_cfg.id,
            tokenizer_fingerprint=rt.tokenizer_fingerprint,
            block_size=rt.config.block_size,
            address=self.worker_address,
            max_model_len=rt.engine.max_model_len,
            load=load_proto(rt),
            transfer_backend=rt.transfer_kind,
            transfer_agent=agent_name.encode(),
            weights=rt.model_cfg.weights,
            metrics_address=self.metrics_address,
            replica=rt.replica,
        )

    async def register(self, attempts: int | None = 600) -> None:
        """Retry until the coordinator answers (it may start after us; None: however long
        that takes); refusal is final."""
        tried = 0
        while attempts is None or tried < attempts:
            tried += 1
            try:
                resp = await self._stub.Register(self._register_request(), timeout=5.0)
            except grpc.aio.AioRpcError as exc:
                if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    await asyncio.sleep(0.2)
                    continue
                raise
            if not resp.accepted:
                raise RegistrationRefused(resp.reason)
            self.interval_s = resp.heartbeat_interval_s or self.interval_s
            self.registered = True
            await self.publish_snapshot()
            log.info(
                "registered %s with the coordinator at %s",
                self.runtime.worker_id,
                self.registry_address,
            )
            return
        raise RegistrationRefused("the coordinator's registry never answered")

    async def heartbeat_forever(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.publish_pending()
            resp = await self.heartbeat()
            if resp is None:
                continue
            if not resp.known:
                await self.register(attempts=None)
            elif resp.resync_from_seq:
                await self.publish_snapshot()

    async def heartbeat(self) -> pb.HeartbeatResponse | None:
        """One heartbeat now; None when the coordinator did not answer."""
        try:
            return await self._stub.Heartbeat(
                pb.HeartbeatRequest(
                    worker_id=self.runtime.worker_id,
                    load=load_proto(self.runtime),
                    kv_event_seq=self._last_seq,
                    draining=self.draining,
                ),
                timeout=max(1.0, self.interval_s),
            )
        except grpc.aio.AioRpcError as exc:
            log.warning("heartbeat to %s failed: %s", self.registry_address, exc.details())
            return None

    async def announce_draining(self) -> None:
        """Tell the coordinator at once (not at the next beat) to route nothing new here."""
        self.draining = True
        await self.heartbeat()

    async def publish_pending(self) -> None:
        self._pump()
        events, self.pending = self.pending, []
        if not events:
            return
        batch = pb.KVEventBatch(
            worker_id=self.runtime.worker_id,
            events=[kv_event_to_proto(e) for e in events],
        )
        await self._send([batch])
        self._last_seq = events[-1].seq

    async def publish_snapshot(self) -> None:
        """Everything cached, per tier, replacing what the coordinator knew about us."""
        self._pump()
        # The sequence number is read on the engine thread with the hashes, so no event can
        # fall between them: later events number past the snapshot and are applied on top.
        cached, seq = await self.runtime.async_engine.call(
            lambda e: (e.blocks.cached_hashes(), e.blocks.events.last_seq)
        )
        batch = pb.KVEventBatch(
            worker_id=self.runtime.worker_id,
            snapshot=True,
            events=[
                kv_event_to_proto(KVEvent("stored", tuple(hashes), kv_tier, seq))
                for kv_tier, hashes in cached.items()
                if hashes or kv_tier == "device"  # one event even when empty: it carries seq
            ],
        )
        # What was pending up to `seq` is in the snapshot; what came after goes on top.
        self.pending = [e for e in self.pending if e.seq > seq]
        await self._send([batch])
        self._last_seq = seq

    async def _send(self, batches: list[pb.KVEventBatch]) -> None:
        async def stream():
            for b in batches:
                yield b

        try:
            await self._stub.PublishKVEvents(stream(), timeout=5.0)
        except grpc.aio.AioRpcError as exc:
            log.warning(
                "publishing KV events to %s failed: %s", self.registry_address, exc.details()
            )

    async def close(self) -> None:
        await self._channel.close()
