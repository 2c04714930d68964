"""Conversions between the kvtransfer dataclasses and their protobuf messages."""

from __future__ import annotations

from engine.kvcache.pool import KVLayout
from services.kvtransfer.types import (
    AgentMetadata,
    BlockDescriptor,
    ReceiveDescriptors,
    TransferState,
    dtype_from_name,
    dtype_name,
)
from shared.proto_gen import kvtransfer_pb2 as pb

_STATUS = {
    TransferState.PENDING: pb.TRANSFER_STATUS_PENDING,
    TransferState.DONE: pb.TRANSFER_STATUS_DONE,
    TransferState.FAILED: pb.TRANSFER_STATUS_FAILED,
    TransferState.TIMED_OUT: pb.TRANSFER_STATUS_TIMED_OUT,
    TransferState.ABORTED: pb.TRANSFER_STATUS_ABORTED,
}
_STATE = {v: k for k, v in _STATUS.items()}


def layout_to_proto(layout: KVLayout) -> pb.KVLayout:
    return pb.KVLayout(
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        block_size=layout.block_size,
        dtype=dtype_name(layout.dtype),
    )


def layout_from_proto(msg: pb.KVLayout) -> KVLayout:
    """Raises ValueError on an unknown dtype name."""
    return KVLayout(
        num_layers=msg.num_layers,
        num_kv_heads=msg.num_kv_heads,
        head_dim=msg.head_dim,
        block_size=msg.block_size,
        dtype=dtype_from_name(msg.dtype),
    )


def metadata_to_proto(md: AgentMetadata) -> pb.AgentMetadata:
    return pb.AgentMetadata(
        backend=md.backend,
        agent_name=md.agent_name,
        layout=layout_to_proto(md.layout),
        num_blocks=md.num_blocks,
        payload=md.payload,
        replica=md.replica,
    )


def metadata_from_proto(msg: pb.AgentMetadata) -> AgentMetadata:
    return AgentMetadata(
        backend=msg.backend,
        agent_name=msg.agent_name,
        layout=layout_from_proto(msg.layout),
        num_blocks=msg.num_blocks,
        payload=msg.payload,
        replica=msg.replica,
    )


def blocks_to_proto(descriptors: ReceiveDescriptors) -> list[pb.BlockDescriptor]:
    return [
        pb.BlockDescriptor(block_id=b.block_id, addr=b.addr, nbytes=b.nbytes)
        for b in descriptors.blocks
    ]


def descriptors_from_proto(
    request_id: str, agent_name: str, blocks: list[pb.BlockDescriptor]
) -> ReceiveDescriptors:
    return ReceiveDescriptors(
        request_id=request_id,
        agent_name=agent_name,
        blocks=tuple(BlockDescriptor(b.block_id, b.addr, b.nbytes) for b in blocks),
    )


def status_to_proto(state: TransferState) -> int:
    return _STATUS[state]


def status_from_proto(status: int) -> TransferState:
    if status not in _STATE:
        raise ValueError(f"transfer status {status} is not a known state")
    return _STATE[status]
