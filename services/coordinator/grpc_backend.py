"""The production backend: routes each request to a (prefill, decode) pair of worker
processes over gRPC and turns their token ids into text here, where stop strings live.

Disaggregated: Prefill on the prefill replica (which pushes the KV to the chosen decode
replica) yields the first token at once; Decode on the decode replica streams the rest.
Colocated (`both` replicas only): one Decode call that prefills locally.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
from opentelemetry import trace

from services.coordinator.backend import (
    BackendError,
    BackendRequestError,
    BackendUnavailable,
    GenerationChunk,
    GenerationRequest,
    ModelInfo,
)
from services.coordinator.registry import WorkerInfo, WorkerRegistry
from services.coordinator.routing import RoutingDecision, choose_pair
from services.worker.convert import (
    logprob_from_proto,
    params_to_proto,
    prompt_logprobs_from_proto,
)
from shared.engine.output import TextTracker
from shared.proto_gen import worker_pb2 as pb
from shared.proto_gen import worker_pb2_grpc as pb_grpc
from shared.telemetry import attributes as A
from shared.telemetry.propagation import current_trace_metadata
from shared.telemetry.rpc_spans import RpcSpan, describe_route
from shared.tokenizer.detokenizer import IncrementalDetokenizer

log = logging.getLogger(__name__)

_DEAD_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN)


class GrpcBackend:
    def __init__(
        self,
        registry: WorkerRegistry,
        models: list[ModelInfo],
        transfer_deadline_s: float,
        tracer: trace.Tracer | None = None,
    ):
        self.registry = registry
        self._tracer = tracer or trace.NoOpTracer()
        self._models = {m.id: m for m in models}
        self.transfer_deadline_s = transfer_deadline_s
        self._channels: dict[str, grpc.aio.Channel] = {}

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

    def _stub(self, worker: WorkerInfo) -> pb_grpc.WorkerStub:
        channel = self._channels.get(worker.address)
        if channel is None:
            channel = grpc.aio.insecure_channel(worker.address)
            self._channels[worker.address] = channel
        return pb_grpc.WorkerStub(channel)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()

    async def generate(self, req: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        info = self._models.get(req.model)
        if info is None:
            raise BackendRequestError("model", f"model '{req.model}' is not served here")
        with self._tracer.start_as_current_span(A.SPAN_ROUTE) as span:
            decision = choose_pair(self.registry, req.model)
            describe_route(
                span,
                decision.prefill.worker_id if decision and decision.prefill else None,
                decision.decode.worker_id if decision else None,
                decision.reasoning if decision else [],
            )
        if decision is None:
            raise BackendUnavailable(
                f"no healthy replica for model '{req.model}'", retry_after_s=1.0
            )
        tracker = TextTracker(IncrementalDetokenizer(info.tokenizer), req.params.stop)
        spec = pb.GenerateSpec(
            request_id=req.request_id,
            model=req.model,
            prompt_token_ids=req.prompt_token_ids,
            sampling=params_to_proto(req.params),
            priority=req.priority,
            prompt_logprobs=req.prompt_logprobs,
        )
        # aclosing: the inner generator's cleanup (in-flight counts, cancelling the Decode
        # call) must run when we stop, not whenever it is garbage-collected.
        async with contextlib.aclosing(self._run(req, decision, spec, tracker)) as stream:
            async for chunk in stream:
                yield chunk
                if chunk.finished:
                    return

    async def _run(
        self, req, decision: RoutingDecision, spec, tracker
    ) -> AsyncIterator[GenerationChunk]:
        decode = decision.decode
        first_token = None
        prefill_cached = 0  # the decode replica did not compute the prompt: prefill's count
        sent = 0
        meta = {
            "replica": decision.describe(),
            "routing": decision.reasoning,
            **current_trace_metadata(),
        }
        decode.in_flight += 1
        if decision.prefill is not None:
            decision.prefill.in_flight += 1
        try:
            if decision.prefill is not None:
                prefill = decision.prefill
                span = RpcSpan(
                    self._tracer, A.SPAN_PREFILL, "Prefill", prefill.worker_id, prefill.address
                )
                try:
                    resp = await self._stub(prefill).Prefill(
                        pb.PrefillRequest(
                            spec=spec,
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
                    prefill.in_flight -= 1
                    span.end()
                first_token = resp.first_token
                prefill_cached = resp.num_cached_tokens
                meta["transfer"] = {
                    "status": resp.transfer.status,
                    "bytes": resp.transfer.nbytes,
                    "seconds": resp.transfer.seconds,
                    "backend": resp.transfer.backend,
                }
                chunk = self._chunk(
                    tracker,
                    [first_token],
                    [logprob_from_proto(resp.logprob)] if resp.has_logprob else [],
                    finished=resp.finished,
                    reason=resp.finish_reason or None,
                    prompt=resp.num_prompt_tokens,
                    cached=resp.num_cached_tokens,
                    outputs=1,
                    replica=prefill.worker_id,
                    meta=meta,
                )
                chunk.prompt_logprobs = prompt_logprobs_from_proto(resp.prompt_logprobs)
                sent = 1
                yield chunk
                if chunk.finished:
                    if resp.transfer.status == "done":  # the pushed KV is not needed now
                        with contextlib.suppress(grpc.aio.AioRpcError):
                            await self._stub(decode).Abort(
                                pb.AbortRequest(request_id=req.request_id)
                            )
                    return
            request = pb.DecodeRequest(
                spec=spec, kv_transferred=first_token is not None, first_token=first_token or 0
            )
            span = RpcSpan(self._tracer, A.SPAN_DECODE, "Decode", decode.worker_id, decode.address)
            call = self._stub(decode).Decode(request, metadata=span.metadata)
            try:
                async for msg in call:
                    span.record_chunk(len(msg.token_ids), msg.finished, msg.num_output_tokens)
                    chunk = self._chunk(
                        tracker,
                        list(msg.token_ids),
                        [logprob_from_proto(lp) for lp in msg.logprobs],
                        finished=msg.finished,
                        reason=msg.finish_reason or None,
                        prompt=msg.num_prompt_tokens,
                        cached=msg.num_cached_tokens if msg.local_prefill else prefill_cached,
                        outputs=msg.num_output_tokens,
                        replica=decode.worker_id,
                        meta=meta if sent == 0 else None,
                    )
                    if msg.prompt_logprobs:
                        chunk.prompt_logprobs = prompt_logprobs_from_proto(msg.prompt_logprobs)
                    sent += 1
                    yield chunk
                    if chunk.finished:
                        return
            except grpc.aio.AioRpcError as exc:
                span.fail(exc)
                raise self._failure(decode, exc) from exc
            finally:
                call.cancel()
                span.end()
            raise BackendError(
                f"decode replica {decode.worker_id} ended the stream without finishing"
            )
        finally:
            decode.in_flight -= 1

    def _chunk(
        self,
        tracker: TextTracker,
        tokens,
        logprobs,
        *,
        finished,
        reason,
        prompt,
        cached,
        outputs,
        replica,
        meta,
    ) -> GenerationChunk:
        text, hit_stop = tracker.feed(tokens) if tokens else ("", False)
        if hit_stop:
            finished, reason = True, "stop"
        elif finished:
            text += tracker.finish()
        return GenerationChunk(
            token_ids=tokens,
            text=text,
            logprobs=logprobs,
            finished=finished,
            finish_reason=reason if finished else None,
            num_prompt_tokens=prompt,
            num_cached_tokens=cached,
            num_output_tokens=outputs,
            replica=replica,
            metadata=meta,
        )

    def _failure(self, worker: WorkerInfo, exc: grpc.aio.AioRpcError) -> Exception:
        code = exc.code()
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            param, _, message = (exc.details() or "").partition(": ")
            return BackendRequestError(param or "request", message or exc.details() or "")
        if code in _DEAD_CODES:
            self.registry.mark_dead(worker.worker_id, f"{code.name}: {exc.details()}")
        return BackendError(f"replica {worker.worker_id} failed: {code.name}: {exc.details()}")


async def reap_forever(registry: WorkerRegistry, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        for worker_id in registry.reap():
            log.warning("worker %s missed its heartbeats and left the pool", worker_id)
