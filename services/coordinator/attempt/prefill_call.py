"""The coordinator's side of one streaming Prefill call.

The prefill replica sends the first token the moment it samples it, then pushes the KV to
the decode replica and sends the push's outcome. `first_token` returns the first message as
a `GenerationChunk` (the client gets it at once and Decode is opened on it); `watch_transfer` then
reads the outcome in the background, so the push overlaps the first token's trip to the
client and the decode replica's wait for the KV.

After the first token a failing Prefill stream no longer fails the request: the decode
replica prefills locally when the KV does not land. The coordinator only makes that quick:
if the prefill replica is gone, the decode replica's receive is aborted so its Decode call
does not wait out the transfer deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import grpc
from opentelemetry import trace

from services.coordinator.attempt.rpc_spans import RpcSpan
from services.coordinator.generation_backend import GenerationChunk, ReplicaLost
from services.coordinator.route.registry import WorkerInfo, WorkerRegistry
from shared.proto_gen import kvtransfer_pb2 as kv_pb
from shared.proto_gen import kvtransfer_pb2_grpc as kv_grpc
from shared.proto_gen import worker_pb2 as pb
from shared.proto_gen import worker_pb2_grpc as pb_grpc
from shared.telemetry import attributes as A
from shared.wire.convert import first_token_chunk

log = logging.getLogger(__name__)

# The decode replica's abort of a receive whose sender died must not hang on it either.
_ABORT_TIMEOUT_S = 2.0

# A replica that answers with one of these is gone (or going): the request moves elsewhere.
LOST_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN)

Failure = Callable[[WorkerInfo, grpc.aio.AioRpcError], Exception]
# (replica, generated stub class) -> that replica's cached stub of that class.
StubSource = Callable[[WorkerInfo, Callable[[grpc.aio.Channel], Any]], Any]


class PrefillCall:
    def __init__(
        self,
        registry: WorkerRegistry,
        stubs: StubSource,
        tracer: trace.Tracer,
        prefill: WorkerInfo,
        decode: WorkerInfo,
        generation: pb.Generation,
        transfer_deadline_s: float,
        failure: Failure,
        background: set[asyncio.Task],
    ):
        self.registry = registry
        self._stubs = stubs
        self.prefill = prefill
        self.decode = decode
        self.generation = generation
        self._failure = failure
        self._background = background
        self._span = RpcSpan(tracer, A.SPAN_PREFILL, "Prefill", prefill.worker_id, prefill.address)
        self._call = stubs(prefill, pb_grpc.WorkerStub).Prefill(
            pb.PrefillRequest(
                generation=generation,
                destination=pb.KVDestination(
                    control_address=decode.address,
                    agent_name=decode.transfer_agent,
                    deadline_s=transfer_deadline_s,
                ),
            ),
            metadata=self._span.metadata,
        )
        self._transfer: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._watcher: asyncio.Task | None = None
        self._closed = False
        prefill.in_flight += 1

    async def first_token(self) -> GenerationChunk:
        """The first message; raises what `failure` makes of an RPC error before it."""
        try:
            event = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            self._span.fail(exc)
            self.close()
            raise self._failure(self.prefill, exc) from exc
        if event is grpc.aio.EOF or not event.HasField("first_token"):
            # An OK end without what the call owes: the replica drained or broke.
            self.close()
            reason = "the Prefill stream ended without a first token"
            self.registry.mark_dead(self.prefill.worker_id, reason)
            raise ReplicaLost(self.prefill.worker_id, reason)
        first = event.first_token
        self._span.record_first_token(first)
        return first_token_chunk(first, self.prefill.worker_id)

    def watch_transfer(self) -> None:
        """Reads the push's outcome in the background (once the first token is out)."""
        if self._watcher is None and not self._closed:
            self._watcher = asyncio.get_running_loop().create_task(self._read_transfer())

    def transfer_now(self) -> dict[str, Any] | None:
        """The push's outcome as response metadata, if it has come."""
        return self._transfer.result() if self._transfer.done() else None

    async def transfer(self, timeout_s: float) -> dict[str, Any]:
        """The push's outcome, waiting at most ``timeout_s`` for it."""
        self.watch_transfer()
        try:
            return await asyncio.wait_for(asyncio.shield(self._transfer), timeout_s)
        except TimeoutError:
            return _outcome("unknown", f"no outcome from the prefill replica in {timeout_s:g}s")

    def close(self) -> None:
        """Ends the call however far it got (idempotent; never waits)."""
        if self._closed:
            return
        self._closed = True
        self.prefill.in_flight -= 1
        if self._watcher is not None and not self._watcher.done():
            self._watcher.cancel()
        self._call.cancel()
        self._span.end()
        if not self._transfer.done():
            self._transfer.set_result(_outcome("unknown", "the request ended first"))

    async def _read_transfer(self) -> None:
        try:
            event = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            self._span.fail(exc)
            self._stream_failed(f"{exc.code().name}: {exc.details()}", exc.code() in LOST_CODES)
            return
        if event is grpc.aio.EOF or not event.HasField("transfer"):
            self._stream_failed("the Prefill stream ended without the transfer outcome", True)
            return
        t = event.transfer
        self._span.record_transfer(t)
        outcome = {
            "status": t.status,
            "bytes": t.nbytes,
            "seconds": t.seconds,
            "backend": t.backend,
        }
        if t.error:
            outcome["error"] = t.error
        if not self._transfer.done():
            self._transfer.set_result(outcome)
        # The server ends its span when its handler returns, just after this last message; the
        # call's status comes after that, so the client span waits for it (no token waits).
        try:
            await self._call.code()
        except grpc.aio.AioRpcError:
            pass
        self._settle(outcome)

    def _stream_failed(self, reason: str, lost: bool) -> None:
        log.warning(
            "Prefill stream of %s broke after its first token: %s",
            self.generation.request_id,
            reason,
        )
        if lost:
            self.registry.mark_dead(self.prefill.worker_id, reason)
            self._abort_receive(f"prefill replica lost: {reason}")
        self._settle(_outcome("failed", reason))

    def _settle(self, outcome: dict[str, Any]) -> None:
        if not self._transfer.done():
            self._transfer.set_result(outcome)
        if not self._closed:
            self._closed = True
            self.prefill.in_flight -= 1
            self._span.end()

    def _abort_receive(self, reason: str) -> None:
        """The KV will not come: the decode replica's Decode call prefills locally now."""
        stub = self._stubs(self.decode, kv_grpc.KvTransferControlStub)
        request = kv_pb.AbortRequest(request_id=self.generation.request_id, reason=reason)

        async def abort() -> None:
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.TimeoutError):
                await stub.Abort(request, timeout=_ABORT_TIMEOUT_S)

        task = asyncio.get_running_loop().create_task(abort())
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def _outcome(status: str, error: str) -> dict[str, Any]:
    return {"status": status, "error": error, "bytes": 0, "seconds": 0.0, "backend": ""}
