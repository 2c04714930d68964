"""kvtransfer: moves a request's KV blocks from a prefill replica's pool into blocks a decode
replica allocated for it. Backends: ``nixl`` (UCX), ``shm`` (same host), ``tcp`` (anywhere),
and an in-process fake for tests; control plane over gRPC in ``control``."""

from services.kvtransfer.factory import TRANSFER_BACKEND_KINDS, create_pool, create_transfer_backend
from services.kvtransfer.interface import TransferBackend
from services.kvtransfer.session import TransferSession
from services.kvtransfer.types import (
    AgentMetadata,
    BlockDescriptor,
    ReceiveDescriptors,
    ReceiveHandle,
    TransferError,
    TransferHandle,
    TransferState,
    TransferStats,
)

__all__ = [
    "TRANSFER_BACKEND_KINDS",
    "AgentMetadata",
    "BlockDescriptor",
    "ReceiveDescriptors",
    "ReceiveHandle",
    "TransferBackend",
    "TransferError",
    "TransferHandle",
    "TransferSession",
    "TransferState",
    "TransferStats",
    "create_transfer_backend",
    "create_pool",
]
