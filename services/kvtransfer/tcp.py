"""TcpTransferBackend: the portable fallback, plain sockets between any two hosts.

Direction: WRITE by prefill (PUSH). The prefill side streams each block's bytes straight
out of its pool (``sendall`` on a memoryview of the pool, no staging copy) and the decode
side ``recv_into``s them straight into the destination blocks. Each side only ever touches
its own memory, so either side can stop the transfer on its own by shutting the socket,
and fencing is just waiting for the local thread. Pushing also means the prefill replica
frees its blocks the moment the last byte is acknowledged.

No authentication or encryption: bind it to loopback or a private cluster network.
"""

from __future__ import annotations

import json
import socket

from prometheus_client import CollectorRegistry

from services.kvtransfer import wire
from services.kvtransfer.blockbytes import byte_view, runs
from services.kvtransfer.stream import StreamBackend
from services.kvtransfer.types import AgentMetadata, ReceiveHandle, TransferHandle
from shared.kvcache.pool import KVPool


class TcpTransferBackend(StreamBackend):
    name = "tcp"
    kind = wire.Kind.PUSH

    def __init__(
        self,
        agent_name: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        registry: CollectorRegistry | None = None,
        fence_grace_s: float = 2.0,
    ):
        super().__init__(agent_name, registry=registry, fence_grace_s=fence_grace_s)
        self.host = host
        self.port = port
        self.advertise_host = advertise_host or host

    def _listen(self) -> socket.socket:
        return socket.create_server((self.host, self.port), backlog=128)

    def _address_payload(self, listener: socket.socket, pool: KVPool) -> bytes:
        port = listener.getsockname()[1]
        return json.dumps({"host": self.advertise_host, "port": port}).encode()

    def _add_peer(self, name: str, metadata: AgentMetadata) -> None:
        address = json.loads(metadata.payload)
        if not isinstance(address.get("host"), str) or not isinstance(address.get("port"), int):
            raise ValueError(f"peer {name!r} has a bad tcp address: {address!r}")

    def _connect(self, peer: AgentMetadata, timeout_s: float) -> socket.socket:
        address = json.loads(peer.payload)
        sock = socket.create_connection((address["host"], address["port"]), timeout=timeout_s)
        _tune(sock)
        return sock

    def _send_payload(self, handle: TransferHandle, sock: socket.socket) -> None:
        pool_bytes = memoryview(byte_view(self.pool.tensor).numpy())
        block_bytes = self.pool.layout.block_bytes
        for run in runs(handle.block_ids, handle.block_ids):
            start = run.src * block_bytes
            sock.sendall(pool_bytes[start : start + run.count * block_bytes])

    def _receive_payload(
        self, handle: ReceiveHandle, sock: socket.socket, req: wire.TransferRequest
    ) -> None:
        _tune(sock)
        pool_bytes = memoryview(byte_view(self.pool.tensor).numpy())
        block_bytes = self.pool.layout.block_bytes
        for run in runs(req.dst_ids, req.dst_ids):
            start = run.dst * block_bytes
            wire.recv_into_exact(sock, pool_bytes[start : start + run.count * block_bytes])


def _tune(sock: socket.socket) -> None:
    # Buffer sizes are left to the kernel's autotuning: setting SO_SNDBUF/SO_RCVBUF turns it
    # off and caps them at net.core.[rw]mem_max, which is far below what autotuning reaches.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
