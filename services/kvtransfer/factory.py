"""Builds a backend (and a pool it can send from) by name, for config files and harnesses."""

from __future__ import annotations

from typing import Any, Literal

from prometheus_client import CollectorRegistry

from engine.kvcache.pool import KVLayout, KVPool
from services.kvtransfer.interface import TransferBackend
from services.kvtransfer.shm_pool import SharedKVPool
from services.kvtransfer.types import TransferError

TransferBackendKind = Literal["tcp", "shm", "nixl"]
TRANSFER_BACKEND_KINDS: tuple[TransferBackendKind, ...] = ("tcp", "shm", "nixl")


def create_transfer_backend(
    kind: str,
    agent_name: str,
    *,
    registry: CollectorRegistry | None = None,
    fence_grace_s: float = 2.0,
    **options: Any,
) -> TransferBackend:
    """``options`` go to the backend's constructor (tcp: host, port, advertise_host,
    socket_buffer_bytes; tcp and shm: auth_key). NIXL is imported only when asked for."""
    common = {"registry": registry, "fence_grace_s": fence_grace_s, **options}
    if kind == "tcp":
        from services.kvtransfer.tcp import TcpTransferBackend

        return TcpTransferBackend(agent_name, **common)
    if kind == "shm":
        from services.kvtransfer.shm import ShmTransferBackend

        return ShmTransferBackend(agent_name, **common)
    if kind == "nixl":
        from services.kvtransfer.nixl import NixlTransferBackend

        return NixlTransferBackend(agent_name, **common)
    raise TransferError(
        f"unknown kvtransfer backend {kind!r}; choose one of {TRANSFER_BACKEND_KINDS}"
    )


def create_pool(kind: str, layout: KVLayout, num_blocks: int) -> KVPool:
    """The shm backend sends out of a pool in shared memory; the others take any pool."""
    if kind == "shm":
        return SharedKVPool.create(layout, num_blocks)
    return KVPool(layout, num_blocks)
