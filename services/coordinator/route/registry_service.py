"""The Registry gRPC service: registration, heartbeats and KV events, into a WorkerRegistry."""

from __future__ import annotations

import logging

from services.coordinator.route.registry import RegistrationError, WorkerInfo, WorkerRegistry
from shared.proto_gen import worker_pb2 as pb
from shared.proto_gen import worker_pb2_grpc as pb_grpc
from shared.wire.convert import kv_event_from_proto, load_from_proto

log = logging.getLogger(__name__)


class RegistryService(pb_grpc.RegistryServicer):
    def __init__(self, registry: WorkerRegistry):
        self.registry = registry

    async def Register(self, request: pb.RegisterRequest, context) -> pb.RegisterResponse:
        try:
            self.registry.check(
                request.model, request.tokenizer_fingerprint, request.block_size, request.role
            )
        except RegistrationError as exc:
            log.warning("refused worker %s: %s", request.worker_id, exc)
            return pb.RegisterResponse(accepted=False, reason=str(exc))
        self.registry.register(
            WorkerInfo(
                worker_id=request.worker_id,
                role=request.role,
                model=request.model,
                address=request.address,
                transfer_agent=request.transfer_agent.decode(),
                max_model_len=request.max_model_len,
                load=load_from_proto(request.load),
                metrics_address=request.metrics_address,
                tokenizer_fingerprint=request.tokenizer_fingerprint,
                replica=request.replica,
            )
        )
        log.info(
            "registered %s (%s, %s) at %s",
            request.worker_id,
            request.role,
            request.model,
            request.address,
        )
        return pb.RegisterResponse(
            accepted=True,
            heartbeat_interval_s=self.registry.config.coordinator.heartbeat_interval_s,
        )

    async def Heartbeat(self, request: pb.HeartbeatRequest, context) -> pb.HeartbeatResponse:
        known = self.registry.heartbeat(
            request.worker_id, load_from_proto(request.load), draining=request.draining
        )
        if not known:
            return pb.HeartbeatResponse(known=False)
        # Events lost in flight (a gap, or the worker published past what we applied): the
        # worker answers a nonzero resync_from_seq with a full snapshot.
        resync = 0
        if self.registry.needs_resync(request.worker_id, request.kv_event_seq):
            resync = self.registry.kv.last_seq(request.worker_id) + 1
        return pb.HeartbeatResponse(known=True, resync_from_seq=resync)

    async def PublishKVEvents(self, request_iterator, context) -> pb.KVEventAck:
        last = 0
        async for batch in request_iterator:
            info = self.registry.workers.get(batch.worker_id)
            if info is None or not info.alive:
                continue  # a dead replica's entries stay dropped until it registers again
            events = [kv_event_from_proto(e) for e in batch.events]
            result = self.registry.apply_events(batch.worker_id, events, batch.snapshot)
            if result.gap:
                log.info("KV events from %s skipped a sequence number: resync", batch.worker_id)
            if batch.events:
                last = max(last, max(e.seq for e in batch.events))
        return pb.KVEventAck(last_seq=last)
