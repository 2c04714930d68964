"""The production backend: routes each attempt to a (prefill, decode) pair of worker
processes over gRPC and streams their chunks (token ids; the retry loop makes the text).

One `generate` call is one attempt on one pair (`PairAttempt`), routed around the replicas
that already failed the request (`GenerationRequest.exclude`). A replica that dies raises
`ReplicaLost`: going on elsewhere is the retry loop's decision.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import grpc
from opentelemetry import trace

from services.coordinator.attempt.pair_attempt import PairAttempt
from services.coordinator.attempt.rpc_spans import describe_route
from services.coordinator.generation_backend import (
    BackendRequestError,
    BackendUnavailable,
    GenerationChunk,
    GenerationRequest,
    ModelInfo,
)
from services.coordinator.route.affinity import ConversationAffinity
from services.coordinator.route.pair_choice import RoutingDecision, choose_pair
from services.coordinator.route.readiness import fleet_readiness
from services.coordinator.route.registry import WorkerInfo, WorkerRegistry
from shared.proto_gen import worker_pb2 as pb
from shared.rpc.auth import NO_AUTH, InternalAuth
from shared.rpc.channels import ChannelPool
from shared.telemetry import attributes as A
from shared.telemetry.propagation import current_trace_metadata
from shared.wire.convert import params_to_proto

S = TypeVar("S")

log = logging.getLogger(__name__)


class GrpcBackend:
    def __init__(
        self,
        registry: WorkerRegistry,
        models: list[ModelInfo],
        transfer_deadline_s: float,
        tracer: trace.Tracer | None = None,
        auth: InternalAuth = NO_AUTH,
    ):
        self.registry = registry
        self._tracer = tracer or trace.NoOpTracer()
        self._models = {m.id: m for m in models}
        self.transfer_deadline_s = transfer_deadline_s
        self.affinity = ConversationAffinity(registry.config.block_size)
        self._channels = ChannelPool(auth)
        self._background: set[asyncio.Task] = set()

    def models(self) -> list[ModelInfo]:
        return list(self._models.values())

    async def health(self) -> dict[str, Any]:
        workers = {
            w.worker_id: {
                "role": w.role,
                "model": w.model,
                "alive": w.alive,
                "draining": w.draining,
                "replica": w.replica,
                "address": w.address,
                "metrics_address": w.metrics_address,
                # What this coordinator's index knows of it: equal on every coordinator that
                # has applied the same events (the fleet's view is one).
                "kv_event_seq": self.registry.kv.last_seq(w.worker_id),
                "kv_blocks": self.registry.kv.num_held(w.worker_id),
            }
            for w in self.registry.workers.values()
        }
        return {**fleet_readiness(self.registry), "workers": workers}

    def _stub(self, worker: WorkerInfo, kind: Callable[[grpc.aio.Channel], S]) -> S:
        return self._channels.stub(worker.address, kind)

    async def close(self) -> None:
        if self._background:  # aborts still on their way out
            await asyncio.wait(self._background, timeout=2.0)
        await self._channels.close()

    def _route(self, req: GenerationRequest) -> RoutingDecision | None:
        with self._tracer.start_as_current_span(A.SPAN_ROUTE) as span:
            decision = choose_pair(
                self.registry,
                req.model,
                prompt_token_ids=req.prompt_token_ids,
                previous_decode=self.affinity.previous(req.user, req.prompt_token_ids),
                exclude=req.exclude,
            )
            describe_route(
                span,
                decision.prefill.worker_id if decision and decision.prefill else None,
                decision.decode.worker_id if decision else None,
                decision.reasoning if decision else [],
            )
        return decision

    async def generate(self, req: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        if req.model not in self._models:
            raise BackendRequestError("model", f"model '{req.model}' is not served here")
        decision = self._route(req)
        if decision is None:
            raise BackendUnavailable(
                f"no healthy replica for model '{req.model}'", retry_after_s=1.0
            )
        generation = pb.Generation(
            request_id=req.request_id,
            model=req.model,
            prompt_token_ids=req.prompt_token_ids,
            sampling=params_to_proto(req.params),
            priority=req.priority,
            prompt_logprobs=req.prompt_logprobs,
        )
        attempt = PairAttempt(
            self.registry,
            self._stub,
            self._tracer,
            decision,
            generation,
            self.transfer_deadline_s,
            self._background,
        )
        first = True
        async with contextlib.aclosing(attempt.run()) as chunks:
            async for chunk in chunks:
                if first:
                    first = False
                    # The pair took the request: the conversation's next turn should find it.
                    self.affinity.remember(
                        req.user, req.prompt_token_ids, decision.decode.worker_id
                    )
                    meta = {"replica": decision.describe(), "routing": decision.reasoning}
                    meta.update(current_trace_metadata())
                    chunk = chunk.with_changes(metadata={**meta, **(chunk.metadata or {})})
                yield chunk


async def reap_forever(registry: WorkerRegistry, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        registry.reap()  # mark_dead logs each replica it drops
