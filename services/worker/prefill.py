"""The prefill role: compute a prompt's KV in chunks, sample the first token and stream it to
the coordinator at once, then push the KV to the decode replica the coordinator chose and
stream the push's outcome; the blocks go back afterwards (they stay in the prefix cache, so
the next turn of the conversation reuses them)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

import grpc

from engine.core.engine import RequestError
from services.kvtransfer.control_client import (
    ControlPlaneError,
    KvTransferControlClient,
    push_blocks,
)
from services.kvtransfer.types import TransferError
from services.worker.runtime import WorkerRuntime
from shared.proto_gen import worker_pb2 as pb
from shared.rpc.channels import ChannelPool
from shared.sampling.params import SamplingParamError
from shared.wire.convert import logprob_to_proto, params_from_proto, prompt_logprobs_to_proto

log = logging.getLogger(__name__)

# Refusals by the decode replica itself: it already knows no KV is coming.
_REFUSALS = (
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.ALREADY_EXISTS,
)


class PrefillService:
    def __init__(self, runtime: WorkerRuntime):
        self.runtime = runtime
        self._channels = ChannelPool(runtime.auth)  # to the decode replicas' control planes
        self._background: set[asyncio.Task] = set()  # aborts sent on cancellation

    def _client(self, address: str) -> KvTransferControlClient:
        return self._channels.stub(address, KvTransferControlClient)

    async def close(self) -> None:
        await self._channels.close()

    async def prefill(
        self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.PrefillEvent]:
        """Yields the first token the moment it is sampled, then the KV push's outcome."""
        generation = request.generation
        rid = generation.request_id
        try:
            params = params_from_proto(generation.sampling)
        except SamplingParamError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if rid in self.runtime.cancelled:
            await context.abort(grpc.StatusCode.ABORTED, f"request {rid} was cancelled")
        push = bool(request.destination.control_address)
        prompt = list(generation.prompt_token_ids)
        start = time.perf_counter()
        await self.runtime.delay_first_token()

        def add(engine) -> str:
            return engine.add_request(
                prompt,
                params,
                request_id=rid,
                priority=generation.priority,
                prompt_logprobs=generation.prompt_logprobs,
                keep_kv=True,
                max_new_tokens=1,
            )

        first = None
        try:
            async for out in self.runtime.async_engine.generate(add, params.structured):
                first = out
        except RequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{exc.param}: {exc}")
        assert first is not None and first.new_token_ids, "prefill produced no token"
        prefill_ms = (time.perf_counter() - start) * 1e3
        finished = first.finish_reason == "stop" or params.max_tokens <= 1
        token = pb.PrefillFirstToken(
            first_token=first.new_token_ids[0],
            prompt_logprobs=prompt_logprobs_to_proto(first.prompt_logprobs),
            num_prompt_tokens=first.num_prompt_tokens,
            num_cached_tokens=first.num_cached_tokens,
            prefill_ms=prefill_ms,
            finished=finished,
            finish_reason=(first.finish_reason or "") if finished else "",
            replica=self.runtime.worker_id,
        )
        if first.logprobs:
            token.logprob.CopyFrom(logprob_to_proto(first.logprobs[0]))
            token.has_logprob = True
        if not push or finished:
            self.runtime.async_engine.post(lambda e: e.release(rid))
            yield pb.PrefillEvent(first_token=token)
            yield pb.PrefillEvent(transfer=pb.TransferOutcome(status="skipped"))
            return
        try:
            # The coordinator opens Decode on this token while the KV is pushed below; the
            # decode replica waits for the push it is about to get.
            yield pb.PrefillEvent(first_token=token)
        except BaseException:  # the call ended (client gone) before the push began
            self.runtime.async_engine.post(lambda e: e.release(rid))
            raise
        yield pb.PrefillEvent(transfer=await self._push(rid, request.destination))

    async def _push(self, rid: str, dest: pb.KVDestination) -> pb.TransferOutcome:
        engine = self.runtime.async_engine
        block_ids = await engine.call(lambda e: list(e.sequences[rid].table.block_ids))
        released = False

        def release(_state) -> None:
            nonlocal released
            released = True
            engine.post(lambda e: e.release(rid))

        start = time.perf_counter()
        outcome = pb.TransferOutcome(backend=self.runtime.transfer_kind, num_blocks=len(block_ids))
        try:
            result = await push_blocks(
                self._client(dest.control_address),
                self.runtime.transfer,
                rid,
                block_ids,
                deadline_s=dest.deadline_s or self.runtime.config.transfer.deadline_s,
                on_release=release,
                hold_s=self.runtime.faults.kv_push_hold_ms / 1e3,
            )
            outcome.status = result.receiver_state.value
            outcome.error = result.error
            if result.receiver_state.value == "done":
                outcome.nbytes = len(block_ids) * self.runtime.engine.pool.layout.block_bytes
        except (ControlPlaneError, TransferError, OSError) as exc:
            log.warning("KV push of %s failed: %s", rid, exc)
            outcome.status = "failed"
            outcome.error = str(exc)
            refused = isinstance(exc, ControlPlaneError) and exc.code in _REFUSALS
            if not refused:
                # The decode replica may be waiting on a receive it will never get (or one
                # that never started): tell it, so its Decode call prefills locally now.
                self._abort_receive(dest.control_address, rid, f"push failed: {exc}")
        except asyncio.CancelledError:
            # The coordinator gave up (client gone): the decode replica must not wait out
            # the deadline with blocks reserved for KV that will never come.
            self._abort_receive(dest.control_address, rid, "prefill cancelled")
            raise
        finally:
            if not released:
                engine.post(lambda e: e.release(rid))
        outcome.seconds = time.perf_counter() - start
        return outcome

    def _abort_receive(self, control_address: str, rid: str, reason: str) -> None:
        client = self._client(control_address)

        async def abort() -> None:
            with contextlib.suppress(ControlPlaneError):
                await client.abort(rid, reason)

        task = asyncio.get_running_loop().create_task(abort())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
