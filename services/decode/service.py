"""The decode role: receive a request's KV into blocks reserved for it, join the continuous
batch, stream tokens as they come. Without pushed KV (transfer failed, or told to) the
replica prefills the prompt itself. A cancelled stream frees its blocks at once."""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import grpc

from services.kvtransfer.control import BlocksUnavailable, KvTransferControlServicer
from services.kvtransfer.types import TransferState
from services.worker.convert import logprob_to_proto, params_from_proto, prompt_logprobs_to_proto
from services.worker.runtime import WorkerRuntime
from shared.engine.async_engine import EngineStepError
from shared.engine.engine import RequestError
from shared.proto_gen import worker_pb2 as pb
from shared.sampling.params import SamplingParamError

log = logging.getLogger(__name__)


class DecodeService:
    def __init__(self, runtime: WorkerRuntime):
        self.runtime = runtime

    async def decode(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext):
        spec = request.spec
        rid = spec.request_id
        try:
            params = params_from_proto(spec.sampling)
        except SamplingParamError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if rid in self.runtime.cancelled:  # aborted before its Decode call got here
            await context.abort(grpc.StatusCode.ABORTED, f"request {rid} was cancelled")
        prompt = list(spec.prompt_token_ids)
        if not request.kv_transferred:  # this replica computes the first token
            await self.runtime.delay_first_token()
        table = self.runtime.take_parked(rid) if request.kv_transferred else None
        local = table is None
        if table is not None:

            def add(engine) -> str:
                return engine.add_prefilled(
                    rid, prompt, request.first_token, table, params, spec.priority
                )

        elif request.kv_transferred:
            # The first token was already streamed from the prefill side but its KV never
            # arrived: continue from prompt + that token so the text stays one sequence.
            params = replace(params, max_tokens=max(1, params.max_tokens - 1))

            def add(engine) -> str:
                return engine.add_request(
                    prompt + [request.first_token], params, request_id=rid, priority=spec.priority
                )

        else:

            def add(engine) -> str:
                return engine.add_request(
                    prompt,
                    params,
                    request_id=rid,
                    priority=spec.priority,
                    prompt_logprobs=spec.prompt_logprobs,
                )

        # Tokens this replica's engine does not count: the first, streamed by prefill, when
        # its KV was lost and the prompt was recomputed here.
        extra = 1 if request.kv_transferred and local else 0
        start = time.perf_counter()
        try:
            async for out in self.runtime.async_engine.generate(add):
                now_ms = (time.perf_counter() - start) * 1e3
                yield pb.DecodeChunk(
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
        except RequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{exc.param}: {exc}")
        except EngineStepError as exc:
            await context.abort(grpc.StatusCode.INTERNAL, str(exc))


class DecodeTransferControl(KvTransferControlServicer):
    """The kvtransfer control plane with this replica's engine as the block owner."""

    def __init__(self, runtime: WorkerRuntime, **kwargs):
        super().__init__(runtime.transfer, **kwargs)
        self.runtime = runtime
        self._reserved: dict[str, object] = {}
        self._tables: dict[str, object] = {}

    async def cancel(self, request_id: str) -> bool:
        """Stop a receive still in flight; its blocks come back through the usual hook."""
        return await self._stop(request_id)

    async def PrepareReceive(self, request, context):
        if request.request_id in self.runtime.cancelled:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, f"request {request.request_id} was cancelled"
            )
        # Blocks are reserved on the engine thread first; the base class then only
        # looks them up (its hook is synchronous).
        block_size = self.runtime.engine.blocks.block_size
        n_tokens = max(1, request.num_blocks) * block_size
        table = await self.runtime.async_engine.call(lambda e: e.reserve_blocks(n_tokens))
        self._reserved[request.request_id] = table
        try:
            return await super().PrepareReceive(request, context)
        finally:
            leftover = self._reserved.pop(request.request_id, None)
            if leftover is not None:  # refused before the hook took it
                self.runtime.async_engine.post(lambda e: e.free_reserved(leftover))

    def allocate_blocks(self, request_id: str, num_blocks: int) -> list[int]:
        table = self._reserved.pop(request_id, None)
        if table is None:
            raise BlocksUnavailable(
                f"decode replica {self.runtime.worker_id} has no room for {num_blocks} blocks now"
            )
        self._tables[request_id] = table
        return list(table.block_ids)

    def on_transfer_finished(
        self, request_id: str, block_ids: list[int], state: TransferState
    ) -> None:
        table = self._tables.pop(request_id, None)
        if table is None:
            return
        if state is TransferState.DONE:
            self.runtime.park(request_id, table)
        else:
            log.warning("KV transfer of %s ended %s; its blocks are freed", request_id, state.value)
            self.runtime.async_engine.post(lambda e: e.free_reserved(table))
