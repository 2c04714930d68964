"""One attempt at serving a request on one (prefill, decode) pair of replicas.

Disaggregated: Prefill on the prefill replica (which pushes the KV to the chosen decode
replica) yields the first token at once; Decode on the decode replica streams the rest.
Local prefill (colocated `both` replicas, or a decode replica that prefills the tail itself):
one Decode call. The attempt yields raw `Piece`s; text, stop strings and counters across
attempts are the caller's (migration continues a stream on a new pair).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry import trace

from services.coordinator.backend import BackendError, BackendRequestError
from services.coordinator.migration import LOST_CODES, ReplicaLost
from services.coordinator.registry import WorkerInfo, WorkerRegistry
from services.coordinator.routing import RoutingDecision
from services.worker.convert import logprob_from_proto, prompt_logprobs_from_proto
from shared.engine.output import TokenLogprob
from shared.proto_gen import worker_pb2 as pb
from shared.proto_gen import worker_pb2_grpc as pb_grpc
from shared.telemetry import attributes as A
from shared.telemetry.rpc_spans import RpcSpan

# Aborts sent when a client leaves must not hang on a replica that is itself in trouble.
ABORT_TIMEOUT_S = 2.0


@dataclass
class Piece:
    """What one worker message carried for the request."""

    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int  # cumulative within this attempt
    replica: str
    prompt_logprobs: list[float | None] | None = None
    transfer: dict[str, Any] | None = None  # on the prefill replica's piece


class PairAttempt:
    def __init__(
        self,
        registry: WorkerRegistry,
        stub: Callable[[WorkerInfo], pb_grpc.WorkerStub],
        tracer: trace.Tracer,
        decision: RoutingDecision,
        spec: pb.GenerateSpec,
        transfer_deadline_s: float,
        background: set[asyncio.Task],
    ):
        self.registry = registry
        self._stub = stub
        self._tracer = tracer
        self.decision = decision
        self.spec = spec
        self.transfer_deadline_s = transfer_deadline_s
        self._background = background  # keeps fire-and-forget aborts referenced

    async def run(self) -> AsyncIterator[Piece]:
        """Yields pieces until one is finished. Raises ReplicaLost when a replica dies,
        BackendRequestError for the client's faults, BackendError for anything else.
        Leaving early (client gone) aborts the request on both replicas."""
        decision = self.decision
        decode, prefill = decision.decode, decision.prefill
        finished = False
        lost: str | None = None
        decode.in_flight += 1
        if prefill is not None:
            prefill.in_flight += 1
        try:
            first_token, prefill_cached = None, 0
            if prefill is not None:
                try:
                    piece = await self._prefill(prefill, decode)
                finally:
                    prefill.in_flight -= 1
                first_token, prefill_cached = piece.token_ids[0], piece.num_cached_tokens
                finished = piece.finished
                yield piece
                if finished:
                    if piece.transfer and piece.transfer["status"] == "done":
                        self._abort_later(decode)  # the pushed KV is not needed now
                    return
            async for piece in self._decode(decode, first_token, prefill_cached):
                finished = piece.finished
                yield piece
                if finished:
                    return
        except ReplicaLost as exc:
            lost = exc.worker_id
            raise
        finally:
            decode.in_flight -= 1
            if not finished:
                for worker in (prefill, decode):
                    if worker is not None and worker.worker_id != lost:
                        self._abort_later(worker)

    async def _prefill(self, prefill: WorkerInfo, decode: WorkerInfo) -> Piece:
        span = RpcSpan(self._tracer, A.SPAN_PREFILL, "Prefill", prefill.worker_id, prefill.address)
        try:
            resp = await self._stub(prefill).Prefill(
                pb.PrefillRequest(
                    spec=self.spec,
                    destination=pb.KVDestination(
                        control_address=decode.address,
                        agent_name=decode.transfer_agent,
                        deadline_s=self.transfer_deadline_s,
                    ),
                ),
                metadata=span.metadata,
            )
            span.record_prefill(resp)
        except grpc.aio.AioRpcError as exc:
            span.fail(exc)
            raise self._failure(prefill, exc) from exc
        finally:
            span.end()
        return Piece(
            token_ids=[resp.first_token],
            logprobs=[logprob_from_proto(resp.logprob)] if resp.has_logprob else [],
            finished=resp.finished,
            finish_reason=resp.finish_reason or None,
            num_prompt_tokens=resp.num_prompt_tokens,
            num_cached_tokens=resp.num_cached_tokens,
            num_output_tokens=1,
            replica=prefill.worker_id,
            prompt_logprobs=prompt_logprobs_from_proto(resp.prompt_logprobs),
            transfer={
                "status": resp.transfer.status,
                "bytes": resp.transfer.nbytes,
                "seconds": resp.transfer.seconds,
                "backend": resp.transfer.backend,
            },
        )

    async def _decode(
        self, decode: WorkerInfo, first_token: int | None, prefill_cached: int
    ) -> AsyncIterator[Piece]:
        request = pb.DecodeRequest(
            spec=self.spec, kv_transferred=first_token is not None, first_token=first_token or 0
        )
        span = RpcSpan(self._tracer, A.SPAN_DECODE, "Decode", decode.worker_id, decode.address)
        call = self._stub(decode).Decode(request, metadata=span.metadata)
        try:
            async for msg in call:
                span.record_chunk(len(msg.token_ids), msg.finished, msg.num_output_tokens)
                yield Piece(
                    token_ids=list(msg.token_ids),
                    logprobs=[logprob_from_proto(lp) for lp in msg.logprobs],
                    finished=msg.finished,
                    finish_reason=msg.finish_reason or None,
                    num_prompt_tokens=msg.num_prompt_tokens,
                    # The decode replica did not compute the prompt: the prefill's count.
                    num_cached_tokens=msg.num_cached_tokens
                    if msg.local_prefill
                    else prefill_cached,
                    num_output_tokens=msg.num_output_tokens,
                    replica=decode.worker_id,
                    prompt_logprobs=prompt_logprobs_from_proto(msg.prompt_logprobs)
                    if msg.prompt_logprobs
                    else None,
                )
                if msg.finished:
                    return
        except grpc.aio.AioRpcError as exc:
            span.fail(exc)
            raise self._failure(decode, exc) from exc
        finally:
            call.cancel()
            span.end()
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
        rid = self.spec.request_id

        async def abort() -> None:
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.TimeoutError):
                await stub.Abort(pb.AbortRequest(request_id=rid), timeout=ABORT_TIMEOUT_S)

        task = asyncio.get_running_loop().create_task(abort())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
