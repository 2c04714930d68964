"""The production backend: routes each request to a (prefill, decode) pair of worker
processes over gRPC and streams their token ids (text and stop strings are `text_stream`'s).

One `PairAttempt` serves the request on one pair. If a replica of the pair dies mid-stream,
the request migrates: the prompt plus the tokens already streamed go to a freshly routed pair
and the same stream continues (see `migration`), up to `max_migrations` times.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
from opentelemetry import trace

from services.coordinator.affinity import ConversationAffinity
from services.coordinator.backend import (
    BackendError,
    BackendRequestError,
    BackendUnavailable,
    GenerationChunk,
    GenerationRequest,
    ModelInfo,
)
from services.coordinator.migration import DEFAULT_MAX_MIGRATIONS, ReplicaLost, StreamProgress
from services.coordinator.pair_attempt import PairAttempt, Piece
from services.coordinator.registry import WorkerInfo, WorkerRegistry
from services.coordinator.routing import RoutingDecision, choose_pair
from shared.proto_gen import worker_pb2 as pb
from shared.rpc.channels import ChannelPool
from shared.telemetry import attributes as A
from shared.telemetry.propagation import current_trace_metadata
from shared.telemetry.rpc_spans import describe_route
from shared.wire.convert import params_to_proto

log = logging.getLogger(__name__)


class GrpcBackend:
    def __init__(
        self,
        registry: WorkerRegistry,
        models: list[ModelInfo],
        transfer_deadline_s: float,
        tracer: trace.Tracer | None = None,
        *,
        max_migrations: int = DEFAULT_MAX_MIGRATIONS,
    ):
        if max_migrations < 0:
            raise ValueError("max_migrations must be >= 0")
        self.registry = registry
        self._tracer = tracer or trace.NoOpTracer()
        self._models = {m.id: m for m in models}
        self.transfer_deadline_s = transfer_deadline_s
        self.max_migrations = max_migrations
        self.affinity = ConversationAffinity(registry.config.block_size)
        self._channels = ChannelPool()
        self._background: set[asyncio.Task] = set()

    def models(self) -> list[ModelInfo]:
        return list(self._models.values())

    async def health(self) -> dict[str, Any]:
        workers = {
            w.worker_id: {
                "role": w.role,
                "model": w.model,
                "alive": w.alive,
                "address": w.address,
                "metrics_address": w.metrics_address,
            }
            for w in self.registry.workers.values()
        }
        return {"ready": self.registry.is_ready(), "workers": workers}

    def _channel(self, worker: WorkerInfo) -> grpc.aio.Channel:
        return self._channels.get(worker.address)

    async def close(self) -> None:
        if self._background:  # aborts still on their way out
            await asyncio.wait(self._background, timeout=2.0)
        await self._channels.close()

    def _route(
        self, req: GenerationRequest, prompt: list[int], exclude: set[str]
    ) -> RoutingDecision | None:
        with self._tracer.start_as_current_span(A.SPAN_ROUTE) as span:
            decision = choose_pair(
                self.registry,
                req.model,
                prompt_token_ids=prompt,
                previous_decode=self.affinity.previous(req.user, req.prompt_token_ids),
                exclude=frozenset(exclude),
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
        decision = self._route(req, req.prompt_token_ids, set())
        if decision is None:
            raise BackendUnavailable(
                f"no healthy replica for model '{req.model}'", retry_after_s=1.0
            )
        progress = StreamProgress(
            req.request_id, list(req.prompt_token_ids), req.params, self.max_migrations
        )
        stream = _ClientStream(progress)
        meta = {"replica": decision.describe(), "routing": decision.reasoning}
        meta.update(current_trace_metadata())
        stream.pending_meta = meta
        failed: set[str] = set()
        remembered: RoutingDecision | None = None
        while True:
            attempt = PairAttempt(
                self.registry,
                self._channel,
                self._tracer,
                decision,
                self._spec(req, progress),
                self.transfer_deadline_s,
                self._background,
            )
            try:
                # aclosing: the attempt's cleanup (in-flight counts, aborting the call on the
                # replicas) must run when we stop, not whenever it is garbage-collected.
                async with contextlib.aclosing(attempt.run()) as pieces:
                    async for piece in pieces:
                        chunk = stream.chunk(piece)
                        if chunk.token_ids and remembered is not decision:
                            # The conversation's KV is on this decode replica from now on
                            # (a stop string may close the stream before its last chunk).
                            self.affinity.remember(
                                req.user, req.prompt_token_ids, decision.decode.worker_id
                            )
                            remembered = decision
                        yield chunk
                        if chunk.finished:
                            return
            except ReplicaLost as lost:
                if progress.remaining_tokens <= 0:  # lost right after the last token
                    yield stream.finish("length")
                    return
                failed.add(lost.worker_id)
                decision = self._migrate(req, progress, decision, lost, failed)
                if stream.pending_meta is not None:  # nothing streamed yet: name the new pair
                    stream.pending_meta.update(
                        replica=decision.describe(), routing=decision.reasoning
                    )

    def _migrate(
        self,
        req: GenerationRequest,
        progress: StreamProgress,
        failed_pair: RoutingDecision,
        lost: ReplicaLost,
        failed: set[str],
    ) -> RoutingDecision:
        if not progress.can_migrate:
            raise BackendError(progress.give_up_message(lost)) from lost
        decision = self._route(req, progress.attempt_prompt(), failed)
        if decision is None:
            raise BackendError(
                f"{progress.give_up_message(lost)} (no healthy replica pair left for '{req.model}')"
            ) from lost
        migration = progress.record(failed_pair.describe(), decision.describe(), lost.reason)
        log.warning(
            "request %s migrated from %s to %s after %d tokens: %s",
            req.request_id,
            migration.from_replica,
            migration.to_replica,
            migration.after_tokens,
            lost.reason,
        )
        return decision

    def _spec(self, req: GenerationRequest, progress: StreamProgress) -> pb.GenerateSpec:
        return pb.GenerateSpec(
            request_id=progress.attempt_request_id(),
            model=req.model,
            prompt_token_ids=progress.attempt_prompt(),
            sampling=params_to_proto(progress.attempt_params()),
            priority=req.priority,
            # Prompt logprobs are the client's prompt's: asked of the attempt that starts it.
            prompt_logprobs=req.prompt_logprobs and not progress.streamed,
        )


class _ClientStream:
    """Turns pieces from successive attempts into the client's one stream: counters relative
    to the client's own prompt, migrations reported from the first chunk after each."""

    def __init__(self, progress: StreamProgress):
        self.progress = progress
        self.pending_meta: dict[str, Any] | None = None  # goes on the next chunk
        self._output_base = 0  # output tokens streamed before the current attempt
        self._attempt = 0
        # The attempt that streamed the first token: its prompt is the client's, so its cache
        # hits, prompt logprobs and transfer are the ones to report (a continuation's are not).
        self._origin: int | None = None
        self._num_cached = 0
        self._last_replica: str | None = None

    def chunk(self, piece: Piece) -> GenerationChunk:
        progress = self.progress
        migrated = progress.attempt != self._attempt
        if migrated:
            self._attempt = progress.attempt
            self._output_base = len(progress.streamed)
        if self._origin is None:
            self._origin = progress.attempt
        origin = self._origin == progress.attempt
        if origin:
            self._num_cached = piece.num_cached_tokens
        progress.streamed.extend(piece.token_ids)
        meta = self.pending_meta
        self.pending_meta = None
        if piece.transfer is not None and origin:
            meta = {**(meta or {}), "transfer": piece.transfer}
        if migrated:
            # Said as soon as it happened: a stop string may end the stream before the
            # backend's own last chunk.
            meta = {**(meta or {}), "migrations": progress.metadata()}
        out = self._make(
            piece.token_ids,
            piece.finished,
            piece.finish_reason,
            self._output_base + piece.num_output_tokens,
            piece.replica,
            meta,
        )
        out.logprobs = piece.logprobs
        if origin and piece.prompt_logprobs is not None:
            out.prompt_logprobs = piece.prompt_logprobs
        return out

    def finish(self, reason: str) -> GenerationChunk:
        n = len(self.progress.streamed)
        return self._make([], True, reason, n, self._last_replica, None)

    def _make(self, tokens, finished, reason, outputs, replica, meta) -> GenerationChunk:
        if finished and self.progress.migrations:
            meta = {**(meta or {}), "migrations": self.progress.metadata()}
        self._last_replica = replica
        return GenerationChunk(
            token_ids=tokens,
            text="",
            finished=finished,
            finish_reason=reason if finished else None,
            num_prompt_tokens=len(self.progress.prompt_token_ids),
            num_cached_tokens=self._num_cached,
            num_output_tokens=outputs,
            replica=replica,
            metadata=meta,
        )


async def reap_forever(registry: WorkerRegistry, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        for worker_id in registry.reap():
            log.warning("worker %s missed its heartbeats and left the pool", worker_id)
