"""Client side of the kvtransfer control plane, and the prefill side of one transfer."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from services.kvtransfer.codec import (
    descriptors_from_proto,
    layout_to_proto,
    metadata_from_proto,
    metadata_to_proto,
    status_from_proto,
    status_to_proto,
)
from services.kvtransfer.interface import TransferBackend
from services.kvtransfer.session import ReleaseCallback, TransferSession
from services.kvtransfer.types import (
    AgentMetadata,
    ReceiveDescriptors,
    TransferError,
    TransferState,
)
from shared.proto_gen import kvtransfer_pb2 as pb
from shared.proto_gen import kvtransfer_pb2_grpc as pb_grpc


class ControlPlaneError(RuntimeError):
    """The decode replica refused or failed a control call; ``code`` says which way."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


@dataclass(frozen=True)
class PreparedReceive:
    receiver: AgentMetadata
    descriptors: ReceiveDescriptors


@dataclass(frozen=True)
class PushResult:
    sender_state: TransferState
    receiver_state: TransferState  # DONE means the decode replica holds the KV
    error: str


class KvTransferControlClient:
    """The prefill side of the control plane over `channel` (owned by the caller's pool)."""

    def __init__(self, channel: grpc.aio.Channel, *, rpc_timeout_s: float = 10.0):
        self._stub = pb_grpc.KvTransferControlStub(channel)
        self._timeout = rpc_timeout_s

    async def prepare_receive(
        self, request_id: str, num_blocks: int, sender: AgentMetadata, deadline_s: float
    ) -> PreparedReceive:
        response = await self._call(
            self._stub.PrepareReceive,
            pb.PrepareReceiveRequest(
                request_id=request_id,
                num_blocks=num_blocks,
                layout=layout_to_proto(sender.layout),
                sender=metadata_to_proto(sender),
                deadline_s=deadline_s,
            ),
        )
        receiver = metadata_from_proto(response.receiver)
        return PreparedReceive(
            receiver=receiver,
            descriptors=descriptors_from_proto(request_id, receiver.agent_name, response.blocks),
        )

    async def transfer_done(
        self, request_id: str, state: TransferState, *, error: str = "", nbytes: int = 0
    ) -> tuple[TransferState, str]:
        """Reports the sender's outcome; returns the receiver's state and error."""
        response = await self._call(
            self._stub.TransferDone,
            pb.TransferDoneRequest(
                request_id=request_id, status=status_to_proto(state), error=error, nbytes=nbytes
            ),
        )
        return status_from_proto(response.receiver_status), response.error

    async def release(self, request_id: str) -> bool:
        response = await self._call(self._stub.Release, pb.ReleaseRequest(request_id=request_id))
        return response.released

    async def abort(self, request_id: str, reason: str = "") -> bool:
        response = await self._call(
            self._stub.Abort, pb.AbortRequest(request_id=request_id, reason=reason)
        )
        return response.aborted

    async def _call(self, method, request):
        try:
            return await method(request, timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            raise ControlPlaneError(exc.code(), exc.details() or "") from exc


async def push_blocks(
    client: KvTransferControlClient,
    backend: TransferBackend,
    request_id: str,
    src_block_ids: Sequence[int],
    *,
    deadline_s: float,
    on_release: ReleaseCallback,
    hold_s: float = 0.0,
) -> PushResult:
    """The prefill side of one transfer: prepare on decode, send, wait, report.

    ``on_release`` (the prefill block manager's free) runs exactly once, before this
    returns or raises. A refused PrepareReceive raises ControlPlaneError (layout mismatch,
    decode pool full); transport outcomes come back in the result. ``hold_s`` (fault
    injection, tests only) waits between the receiver's reservation and the send.
    """
    try:
        prepared = await client.prepare_receive(
            request_id, len(src_block_ids), backend.metadata, deadline_s
        )
        backend.add_peer(prepared.receiver.agent_name, prepared.receiver)
        if hold_s:
            await asyncio.sleep(hold_s)
        handle = backend.send(request_id, src_block_ids, prepared.descriptors, deadline_s)
    except BaseException as exc:  # cancellation included: the blocks still come back
        on_release(TransferState.FAILED)
        if isinstance(exc, TransferError):
            with contextlib.suppress(ControlPlaneError):
                await client.abort(request_id, str(exc))
        raise
    session = TransferSession(backend, handle, on_release)
    try:
        sender_state = await session.wait_async()
    finally:
        session.close()
    receiver_state, receiver_error = await client.transfer_done(
        request_id, sender_state, error=handle.error, nbytes=handle.stats.nbytes
    )
    return PushResult(sender_state, receiver_state, handle.error or receiver_error)
