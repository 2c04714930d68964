"""One attempt at serving a request on one (prefill, decode) pair of replicas.

Disaggregated: Prefill on the prefill replica streams the first token the moment it is
sampled, and the attempt yields it, then (once it is on its way to the client) opens Decode
on the decode replica, while the prefill replica pushes the KV there (the decode replica
waits for it, or prefills locally if it never lands); the push's outcome is read in the
background and reported with the stream (`metadata.transfer`, at the latest on the finished
chunk). Local prefill (colocated `both` replicas, or a decode replica that prefills the tail
itself): one Decode call. The attempt yields the workers' chunks as they come; text, stop
strings and counters across attempts are the retry loop's.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from opentelemetry import trace

from services.coordinator.attempt.prefill_call import LOST_CODES, PrefillCall, StubSource
from services.coordinator.attempt.rpc_spans import RpcSpan
from services.coordinator.generation_backend import (
    BackendError,
    BackendRequestError,
    GenerationChunk,
    ReplicaHandedOver,
    ReplicaLost,
)
from services.coordinator.route.pair_choice import RoutingDecision
from services.coordinator.route.registry import WorkerInfo, WorkerRegistry
from shared.proto_gen import worker_pb2 as pb
from shared.proto_gen import worker_pb2_grpc as pb_grpc
from shared.telemetry import attributes as A
from shared.wire.convert import decode_chunk

# Aborts sent when a client leaves must not hang on a replica that is itself in trouble.
ABORT_TIMEOUT_S = 2.0


class PairAttempt:
    def __init__(
        self,
        registry: WorkerRegistry,
        stubs: StubSource,
        tracer: trace.Tracer,
        decision: RoutingDecision,
        generation: pb.Generation,
        transfer_deadline_s: float,
        background: set[asyncio.Task],
    ):
        self.registry = registry
        self._stubs = stubs
        self._tracer = tracer
        self.decision = decision
        self.generation = generation
        self.transfer_deadline_s = transfer_deadline_s
        self._background = background  # keeps fire-and-forget aborts referenced

    def _stub(self, worker: WorkerInfo) -> pb_grpc.WorkerStub:
        return self._stubs(worker, pb_grpc.WorkerStub)

    async def run(self) -> AsyncIterator[GenerationChunk]:
        """Yields chunks until one is finished. Raises ReplicaLost when a replica dies,
        BackendRequestError for the client's faults, BackendError for anything else.
        Leaving early (client gone) aborts the request on both replicas."""
        decision = self.decision
        decode, prefill = decision.decode, decision.prefill
        finished = False
        lost: str | None = None
        decode.in_flight += 1
        call: PrefillCall | None = None
        decoding: _DecodeCall | None = None
        try:
            first_token, prefill_cached = None, 0
            if prefill is not None:
                call = PrefillCall(
                    self.registry,
                    self._stubs,
                    self._tracer,
                    prefill,
                    decode,
                    self.generation,
                    self.transfer_deadline_s,
                    self._failure,
                    self._background,
                )
                first = await call.first_token()
                first_token, prefill_cached = first.token_ids[0], first.num_cached_tokens
                finished = first.finished
                yield first
                if finished:  # nothing was pushed: the first token ended the request
                    return
                # The token is on its way to the client (a streaming client's pump resumes
                # this only once it is written): Decode opens now, its replica starts waiting
                # for the KV the prefill replica is already pushing, and the push's outcome
                # is read in the background. Opening Decode first would put its cost (a
                # span, a call, their cold Python) in front of the first token.
                decoding = self._open_decode(decode, first_token)
                call.watch_transfer()
            if decoding is None:
                decoding = self._open_decode(decode, None)
            unreported = call
            async for chunk in self._decode(decode, decoding, prefill_cached):
                if unreported is not None:
                    transfer = (
                        await unreported.transfer(self.transfer_deadline_s)
                        if chunk.finished  # the push's outcome belongs in the last chunk
                        else unreported.transfer_now()
                    )
                    if transfer is not None:
                        chunk = chunk.with_changes(metadata={"transfer": transfer})
                        unreported = None
                finished = chunk.finished
                yield chunk
                if finished:
                    return
        except ReplicaLost as exc:
            lost = exc.worker_id
            raise
        finally:
            decode.in_flight -= 1
            if decoding is not None:
                decoding.close()
            if call is not None:
                call.close()
            if not finished:
                for worker in (prefill, decode):
                    if worker is not None and worker.worker_id != lost:
                        self._abort_later(worker)

    def _open_decode(self, decode: WorkerInfo, first_token: int | None) -> _DecodeCall:
        pushed = first_token is not None
        request = pb.DecodeRequest(
            generation=self.generation,
            kv_transferred=pushed,
            first_token=first_token or 0,
            # The push began as the first token left the prefill replica: a PrepareReceive
            # that has not reached the decode replica within the push's deadline never will.
            kv_deadline_s=self.transfer_deadline_s if pushed else 0.0,
        )
        span = RpcSpan(self._tracer, A.SPAN_DECODE, "Decode", decode.worker_id, decode.address)
        return _DecodeCall(self._stub(decode).Decode(request, metadata=span.metadata), span)

    async def _decode(
        self, decode: WorkerInfo, decoding: _DecodeCall, prefill_cached: int
    ) -> AsyncIterator[GenerationChunk]:
        call, span = decoding.call, decoding.span
        try:
            async for msg in call:
                if msg.handed_over:  # draining: every token it made came before this
                    self.registry.mark_draining(decode.worker_id)
                    raise ReplicaHandedOver(decode.worker_id, msg.handed_over)
                span.record_chunk(len(msg.token_ids), msg.finished, msg.num_output_tokens)
                chunk = decode_chunk(msg, decode.worker_id)
                if not msg.local_prefill:  # the decode replica did not compute the prompt
                    chunk = chunk.with_changes(num_cached_tokens=prefill_cached)
                yield chunk
                if msg.finished:
                    return
        except grpc.aio.AioRpcError as exc:
            span.fail(exc)
            raise self._failure(decode, exc) from exc
        finally:
            decoding.close()
        # An OK end without a finished chunk: the replica drained or broke; treat it as gone.
        reason = "the stream ended without finishing"
        self.registry.mark_dead(decode.worker_id, reason)
        raise ReplicaLost(decode.worker_id, reason)

    def _failure(self, worker: WorkerInfo, exc: grpc.aio.AioRpcError) -> Exception:
        code = exc.code()
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            param, _, message = (exc.details() or "").partition(": ")
            return BackendRequestError(param or "request", message or exc.details() or "")
        if code in LOST_CODES:
            reason = f"{code.name}: {exc.details()}"
            self.registry.mark_dead(worker.worker_id, reason)
            return ReplicaLost(worker.worker_id, reason)
        return BackendError(f"replica {worker.worker_id} failed: {code.name}: {exc.details()}")

    def _abort_later(self, worker: WorkerInfo) -> None:
        """Fire-and-forget: this may run inside a cancelled task, which must not wait."""
        stub = self._stub(worker)
        rid = self.generation.request_id

        async def abort() -> None:
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.TimeoutError):
                await stub.Abort(pb.AbortRequest(request_id=rid), timeout=ABORT_TIMEOUT_S)

        task = asyncio.get_running_loop().create_task(abort())
        self._background.add(task)
        task.add_done_callback(self._background.discard)


@dataclass
class _DecodeCall:
    call: grpc.aio.UnaryStreamCall
    span: RpcSpan

    def close(self) -> None:
        """Idempotent: cancelling a finished call does nothing, the span ends once."""
        self.call.cancel()
        self.span.end()
