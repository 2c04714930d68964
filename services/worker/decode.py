"""The decode role: receive a request's KV into blocks reserved for it, join the continuous
batch, stream tokens as they come. The Decode call may come while the KV is still on its way:
it waits for the receive (bounded by the transfer deadline). Without pushed KV (transfer
failed, timed out, aborted, or told to) the replica prefills the prompt itself. A cancelled
stream frees its blocks at once.

A draining replica whose grace ran out hands its open streams over (`hand_over`): each ends
with a `handed_over` message after the last token it sent, its KV freed here, and the
coordinator continues it on another replica from exactly those tokens (its migration path).
The replica says so instead of just being cut because only it knows where each stream
stopped, and an OK end with a reason tells the coordinator this is a planned move, not a
crash: the request goes on without counting against its failure budget, and the replica is
not marked dead while it still finishes other work (a coordinator noticing the drain itself
would have to guess the grace's end and race the tokens already in flight)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import grpc

from engine.core.async_engine import EngineStepError
from engine.core.engine import RequestError
from services.kvtransfer.control import (
    BlocksUnavailable,
    KvTransferControlServicer,
    ReceiveRefused,
)
from services.kvtransfer.types import TransferState
from services.worker.runtime import WorkerRuntime
from shared.proto_gen import worker_pb2 as pb
from shared.sampling.params import SamplingParamError
from shared.wire.convert import logprob_to_proto, params_from_proto, prompt_logprobs_to_proto

log = logging.getLogger(__name__)


class _HandedOver(Exception):
    """Raised out of a request's engine stream when the replica hands it over."""


class DecodeService:
    def __init__(self, runtime: WorkerRuntime):
        self.runtime = runtime
        self._open: set[str] = set()  # request ids of the Decode calls open now
        self.handing_over: str = ""  # why, once the replica hands every stream over

    def hand_over(self, reason: str) -> int:
        """End every open Decode call (and every later one) with a hand-over message; their
        requests leave the engine before its next step. Returns how many were open."""
        self.handing_over = reason
        for rid in self._open:
            self.runtime.arrivals.cancel(rid)  # a call waiting for its KV stops waiting
            self.runtime.async_engine.end_stream(rid, _HandedOver(reason))
        return len(self._open)

    async def decode(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext):
        rid = request.generation.request_id
        self._open.add(rid)
        try:
            # aclosing: a call cancelled while a message is on its way closes the stream now
            # (aborting its request), not when it is collected.
            async with contextlib.aclosing(self._decode(request, context)) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            self._open.discard(rid)

    async def _decode(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext):
        generation = request.generation
        rid = generation.request_id
        try:
            params = params_from_proto(generation.sampling)
        except SamplingParamError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if rid in self.runtime.cancelled:  # aborted before its Decode call got here
            await context.abort(grpc.StatusCode.ABORTED, f"request {rid} was cancelled")
        prompt = list(generation.prompt_token_ids)
        table = None
        waited = time.perf_counter()
        if request.kv_transferred:
            wait_s = request.kv_deadline_s or self.runtime.config.transfer.deadline_s
            table = await self.runtime.arrivals.take(rid, wait_s)
            if rid in self.runtime.cancelled:  # aborted while its KV was on the way
                if table is not None:
                    self.runtime.free_blocks(table)
                await context.abort(grpc.StatusCode.ABORTED, f"request {rid} was cancelled")
        else:  # this replica computes the first token
            await self.runtime.delay_first_token()
        if self.handing_over:  # it came, or its KV did, after the grace ran out
            if table is not None:
                self.runtime.free_blocks(table)
            yield pb.DecodeChunk(handed_over=self.handing_over)
            return
        kv_wait_ms = (time.perf_counter() - waited) * 1e3 if request.kv_transferred else 0.0
        local = table is None
        if table is not None:

            def add(engine) -> str:
                return engine.add_prefilled(
                    rid, prompt, request.first_token, table, params, generation.priority
                )

        elif request.kv_transferred:
            # The first token was already streamed from the prefill side but its KV never
            # arrived: continue from prompt + that token so the text stays one sequence.
            params = params.continued(1)

            def add(engine) -> str:
                return engine.add_request(
                    prompt + [request.first_token],
                    params,
                    request_id=rid,
                    priority=generation.priority,
                )

        else:

            def add(engine) -> str:
                return engine.add_request(
                    prompt,
                    params,
                    request_id=rid,
                    priority=generation.priority,
                    prompt_logprobs=generation.prompt_logprobs,
                )

        # Tokens this replica's engine does not count: the first, streamed by prefill, when
        # its KV was lost and the prompt was recomputed here.
        extra = 1 if request.kv_transferred and local else 0
        start = time.perf_counter()
        first = True
        outputs = self.runtime.async_engine.generate(add, params.structured)
        try:
            async with contextlib.aclosing(outputs):
                async for out in outputs:
                    now_ms = (time.perf_counter() - start) * 1e3
                    yield pb.DecodeChunk(
                        kv_wait_ms=kv_wait_ms if first else 0.0,
                        token_ids=out.new_token_ids,
                        logprobs=[logprob_to_proto(lp) for lp in out.logprobs],
                        token_time_ms=[now_ms] * len(out.new_token_ids),
                        finished=out.finished,
                        finish_reason=out.finish_reason or "",
                        num_prompt_tokens=len(prompt),
                        num_cached_tokens=out.num_cached_tokens,
                        num_output_tokens=out.num_output_tokens + extra,
                        local_prefill=local,
                        prompt_logprobs=prompt_logprobs_to_proto(out.prompt_logprobs),
                    )
                    first = False
                    # A request added after `hand_over` looked for it: its first output ends it.
                    if self.handing_over and not out.finished:
                        await outputs.aclose()  # aborts it
                        yield pb.DecodeChunk(handed_over=self.handing_over)
                        return
        except _HandedOver as exc:
            yield pb.DecodeChunk(handed_over=str(exc))
        except RequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{exc.param}: {exc}")
        except EngineStepError as exc:
            await context.abort(grpc.StatusCode.INTERNAL, str(exc))


class DecodeTransferControl(KvTransferControlServicer):
    """The kvtransfer control plane with this replica's engine as the block owner; what
    arrives is handed to the Decode call through the runtime's ``KVArrivals``."""

    def __init__(self, runtime: WorkerRuntime, **kwargs):
        super().__init__(runtime.transfer, **kwargs)
        self.runtime = runtime

    async def cancel(self, request_id: str) -> bool:
        """Stop a receive still in flight; its blocks come back through the usual hook."""
        return await self._stop(request_id)

    async def PrepareReceive(self, request, context):
        if request.request_id in self.runtime.cancelled:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, f"request {request.request_id} was cancelled"
            )
        return await super().PrepareReceive(request, context)

    async def Abort(self, request, context):
        response = await super().Abort(request, context)
        # The sender gave up, perhaps before PrepareReceive: a Decode call waiting for this
        # KV prefills locally now instead of at its deadline.
        self.runtime.arrivals.never_coming(request.request_id, request.reason or "sender aborted")
        return response

    async def allocate_blocks(self, request_id: str, num_blocks: int) -> list[int]:
        rt = self.runtime
        n_tokens = max(1, num_blocks) * rt.engine.blocks.block_size
        reserving = asyncio.ensure_future(
            rt.async_engine.call(lambda e: e.reserve_blocks(n_tokens))
        )
        try:
            table = await asyncio.shield(reserving)
        except asyncio.CancelledError:
            # The engine thread reserves them anyway: they go back once it has.
            reserving.add_done_callback(_free_when_reserved(rt))
            raise
        if table is None:
            reason = f"decode replica {rt.worker_id} has no room for {num_blocks} blocks now"
            rt.arrivals.never_coming(request_id, reason)
            raise BlocksUnavailable(reason)
        if request_id in rt.cancelled or not rt.arrivals.receiving(request_id, table):
            rt.free_blocks(table)
            raise ReceiveRefused(f"request {request_id} no longer wants its KV here")
        return list(table.block_ids)

    def on_transfer_finished(
        self, request_id: str, block_ids: list[int], state: TransferState
    ) -> None:
        if state is TransferState.DONE:
            self.runtime.arrivals.landed(request_id)
        else:
            log.warning("KV transfer of %s ended %s; its blocks are freed", request_id, state.value)
            self.runtime.arrivals.receive_failed(request_id, state.value)


def _free_when_reserved(runtime: WorkerRuntime) -> Callable[[asyncio.Future], None]:
    def free(reserving: asyncio.Future) -> None:
        if not reserving.cancelled() and reserving.exception() is None:
            table = reserving.result()
            if table is not None:
                runtime.free_blocks(table)

    return free
