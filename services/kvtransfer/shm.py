"""ShmTransferBackend: same-host transfers as one memcpy out of a shared-memory pool.

The prefill replica builds its pool with ``SharedKVPool.create`` (the pool tensor itself is
a /dev/shm file); the decode replica maps that file when it adds the prefill replica as a
peer. A Unix socket per transfer (abstract namespace, so nothing to clean up) carries the
request and the completion ack; the bytes never touch it.

Direction: READ by decode (PULL). The copy runs on the decode replica's thread, which
keeps it off the compute-bound prefill replica, and only the source pool has to live in
shared memory, so the decode pool stays an ordinary (later: device) allocation. Because the
decode side reads the prefill's memory, a cancelled prefill only half-closes the socket and
waits for decode to hang up; decode checks for that hang-up between copy chunks, so it
stops reading within one chunk and the prefill blocks are fenced before they are reused.
"""

from __future__ import annotations

import json
import os
import select
import socket
import uuid

from prometheus_client import CollectorRegistry

from engine.kvcache.pool import KVPool
from services.kvtransfer import wire
from services.kvtransfer.blockbytes import byte_view, copy_runs
from services.kvtransfer.shm_pool import SharedKVPool
from services.kvtransfer.stream import StreamTransferBackend
from services.kvtransfer.types import AgentMetadata, ReceiveHandle, TransferError


class ShmTransferBackend(StreamTransferBackend):
    name = "shm"
    kind = wire.Kind.PULL
    sender_shutdown = socket.SHUT_WR

    def __init__(
        self,
        agent_name: str,
        *,
        registry: CollectorRegistry | None = None,
        fence_grace_s: float = 2.0,
        auth_key: bytes | None = None,
    ):
        super().__init__(
            agent_name, registry=registry, fence_grace_s=fence_grace_s, auth_key=auth_key
        )
        self._socket_name = f"splitserve-kvx-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._mapped: dict[str, SharedKVPool] = {}

    def _listen(self) -> socket.socket:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind("\0" + self._socket_name)
        listener.listen(128)
        return listener

    def _address_payload(self, listener: socket.socket, pool: KVPool) -> bytes:
        segment = str(pool.path) if isinstance(pool, SharedKVPool) else None
        return json.dumps({"socket": self._socket_name, "segment": segment}).encode()

    def _add_peer(self, name: str, metadata: AgentMetadata) -> None:
        segment = json.loads(metadata.payload).get("segment")
        if segment is None:
            return  # a peer that only receives from us
        try:
            self._mapped[name] = SharedKVPool.attach(segment, metadata.layout, metadata.num_blocks)
        except FileNotFoundError as exc:
            raise TransferError(
                f"peer {name!r} has its KV pool in {segment}, which is not on this host"
            ) from exc

    def _remove_peer(self, name: str) -> None:
        self._mapped.pop(name, None)

    def _check_send(self) -> None:
        if not isinstance(self.pool, SharedKVPool):
            raise TransferError(
                "the shm backend sends from a pool in shared memory; build it with "
                "SharedKVPool.create() instead of KVPool()"
            )

    def _connect(self, peer: AgentMetadata, timeout_s: float) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        try:
            sock.connect("\0" + json.loads(peer.payload)["socket"])
        except OSError:
            sock.close()
            raise
        return sock

    def _receive_payload(
        self, handle: ReceiveHandle, sock: socket.socket, req: wire.TransferRequest
    ) -> None:
        source = self._mapped.get(req.sender)
        if source is None:
            raise ConnectionError(
                f"sender {req.sender!r} is not a peer with a shared-memory pool on this host"
            )

        def keep_going() -> bool:
            return not handle.state.terminal and _peer_still_there(sock)

        def progress(nbytes: int) -> None:
            handle.moved_bytes += nbytes

        copy_runs(
            byte_view(source.tensor),
            byte_view(self.pool.tensor),
            req.src_ids,
            req.dst_ids,
            self.pool.layout.block_bytes,
            keep_going,
            progress,
        )

    def _close(self) -> None:
        super()._close()
        self._mapped.clear()


def _peer_still_there(sock: socket.socket) -> bool:
    """False once the sender hung up. The sender sends nothing after its request, so a
    readable socket can only mean end-of-stream or a reset."""
    readable, _, _ = select.select([sock], [], [], 0)
    return not readable
