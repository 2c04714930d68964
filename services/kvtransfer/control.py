"""The kvtransfer control plane over grpc.aio: the decode side serves it, prefill calls it.

``KvTransferControlServicer`` is the decode replica's base: subclass it with the two block
manager hooks (``allocate_blocks``, async because reserving blocks is a trip to the engine
thread; ``on_transfer_finished``). Every prepared request is watched by a task, so its blocks
come back exactly once even when the sender vanishes and never calls TransferDone. The
client side (``KvTransferControlClient``, ``push_blocks``) lives in ``control_client`` and
is re-exported here.
"""

from __future__ import annotations

import asyncio
import functools
from collections import OrderedDict
from dataclasses import dataclass

import grpc

from services.kvtransfer.codec import (
    blocks_to_proto,
    layout_from_proto,
    metadata_from_proto,
    metadata_to_proto,
    status_from_proto,
    status_to_proto,
)
from services.kvtransfer.control_client import (
    ControlPlaneError,
    KvTransferControlClient,
    PreparedReceive,
    PushResult,
    push_blocks,
)
from services.kvtransfer.interface import TransferBackend
from services.kvtransfer.session import TransferSession
from services.kvtransfer.types import TransferError, TransferState, layout_mismatch
from shared.proto_gen import kvtransfer_pb2 as pb
from shared.proto_gen import kvtransfer_pb2_grpc as pb_grpc

__all__ = [
    "BlocksUnavailable",
    "ReceiveRefused",
    "ControlPlaneError",
    "KvTransferControlClient",
    "KvTransferControlServicer",
    "PreparedReceive",
    "PushResult",
    "add_control_servicer",
    "push_blocks",
]

# Outcomes remembered after a request's blocks were given back, for a late TransferDone.
_REMEMBERED_OUTCOMES = 4096


class ReceiveRefused(Exception):
    """Raised by ``allocate_blocks`` when this replica no longer wants the request's KV."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class BlocksUnavailable(ReceiveRefused):
    """Raised by ``allocate_blocks`` when the decode pool cannot hold the request now."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


@dataclass
class _Entry:
    session: TransferSession
    watcher: asyncio.Task


class KvTransferControlServicer(pb_grpc.KvTransferControlServicer):
    def __init__(self, backend: TransferBackend, *, grace_s: float = 2.0):
        """``grace_s`` is added to the sender's deadline for the receive side, so the sender
        always gives up first and has stopped writing before these blocks are freed."""
        self.backend = backend
        self.grace_s = grace_s
        self._entries: dict[str, _Entry] = {}
        self._preparing: set[str] = set()  # PrepareReceive awaiting its blocks
        self._outcomes: OrderedDict[str, tuple[TransferState, str]] = OrderedDict()

    # ------------------------------------------------------ decode-service hooks

    async def allocate_blocks(self, request_id: str, num_blocks: int) -> list[int]:
        """Blocks for the incoming KV; raise BlocksUnavailable when the pool is full,
        ReceiveRefused when the request is not wanted. If the call is cancelled, the
        blocks it may have reserved are the hook's to give back."""
        raise NotImplementedError

    def on_transfer_finished(
        self, request_id: str, block_ids: list[int], state: TransferState
    ) -> None:
        """Called exactly once per prepared request: keep the blocks on DONE, else free them."""
        raise NotImplementedError

    # ---------------------------------------------------------------- the RPCs

    async def PrepareReceive(self, request: pb.PrepareReceiveRequest, context):
        rid = request.request_id
        if not rid:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty")
        if request.num_blocks <= 0 or not request.deadline_s > 0:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"num_blocks ({request.num_blocks}) and deadline_s ({request.deadline_s}) "
                "must be positive",
            )
        try:
            layout = layout_from_proto(request.layout)
            sender = metadata_from_proto(request.sender)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        mismatch = layout_mismatch(layout, self.backend.pool.layout, "sender", "receiver")
        if mismatch:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, mismatch)
        if rid in self._entries or rid in self._preparing:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {rid!r} is in flight")
        try:
            self.backend.add_peer(sender.agent_name, sender)
        except (TransferError, ValueError) as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        self._preparing.add(rid)
        try:
            block_ids = await self.allocate_blocks(rid, request.num_blocks)
        except ReceiveRefused as exc:
            await context.abort(exc.code, str(exc))
        finally:
            self._preparing.discard(rid)
        # No await from here until the watcher exists: nothing can come between the blocks
        # and the entry that gives them back.
        try:
            if len(block_ids) != request.num_blocks:
                raise RuntimeError(
                    f"allocate_blocks gave {len(block_ids)} blocks for {request.num_blocks}"
                )
            handle = self.backend.prepare_receive(rid, block_ids, request.deadline_s + self.grace_s)
        except BaseException:  # a bug on this side: give the blocks back, fail loudly
            self.on_transfer_finished(rid, block_ids, TransferState.FAILED)
            raise
        session = TransferSession(
            self.backend, handle, functools.partial(self._finished, rid, list(block_ids))
        )
        self._entries[rid] = _Entry(session, asyncio.create_task(session.wait_async()))
        return pb.PrepareReceiveResponse(
            receiver=metadata_to_proto(self.backend.metadata),
            blocks=blocks_to_proto(handle.descriptors),
        )

    async def TransferDone(self, request: pb.TransferDoneRequest, context):
        rid = request.request_id
        entry = self._entries.get(rid)
        if entry is not None:
            try:
                sender_state = status_from_proto(request.status)
            except ValueError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            if sender_state is not TransferState.DONE:
                self.backend.abort(entry.session.handle)
            # The receive side may learn of completion a moment after the sender (NIXL's
            # notification); the watcher is bounded by the receive deadline either way.
            await asyncio.shield(entry.watcher)
        outcome = self._outcomes.get(rid)
        if outcome is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no transfer prepared for {rid!r}")
        state, error = outcome
        return pb.TransferDoneResponse(receiver_status=status_to_proto(state), error=error)

    async def Release(self, request: pb.ReleaseRequest, context):
        """The caller is done with the request: stop it if still in flight, then forget it.
        ``released`` is False only for a request this replica does not know (any more)."""
        rid = request.request_id
        stopped = await self._stop(rid)
        remembered = self._outcomes.pop(rid, None) is not None
        return pb.ReleaseResponse(released=stopped or remembered)

    async def Abort(self, request: pb.AbortRequest, context):
        entry = self._entries.get(request.request_id)
        if entry is None or entry.session.state.terminal:
            return pb.AbortResponse(aborted=False)
        return pb.AbortResponse(aborted=await self._stop(request.request_id))

    async def close(self) -> None:
        """Aborts every transfer still in flight and waits until their blocks are back."""
        for rid in list(self._entries):
            await self._stop(rid)

    # ---------------------------------------------------------------- helpers

    async def _stop(self, request_id: str) -> bool:
        entry = self._entries.get(request_id)
        if entry is None:
            return False
        self.backend.abort(entry.session.handle)
        await asyncio.shield(entry.watcher)
        return True

    def _finished(self, request_id: str, block_ids: list[int], state: TransferState) -> None:
        entry = self._entries.pop(request_id, None)
        error = entry.session.handle.error if entry is not None else ""
        self._outcomes[request_id] = (state, error)
        while len(self._outcomes) > _REMEMBERED_OUTCOMES:
            self._outcomes.popitem(last=False)
        self.on_transfer_finished(request_id, block_ids, state)


def add_control_servicer(server: grpc.aio.Server, servicer: KvTransferControlServicer) -> None:
    pb_grpc.add_KvTransferControlServicer_to_server(servicer, server)
