"""TcpTransferBackend: the portable fallback, plain sockets between any two hosts.

Direction: WRITE by prefill (PUSH). Once the receiver has accepted the request header, the
prefill side streams each block's bytes straight out of its pool (``sendall`` on a
memoryview of the pool, no staging copy) and the decode side ``recv_into``s them straight
into the destination blocks. Each side only ever touches its own memory, so either side can
stop the transfer on its own by shutting the socket, and fencing is just waiting for the
local thread. Pushing also means the prefill replica frees its blocks the moment the last
byte is acknowledged.

No encryption: bind it to loopback or a private cluster network. With an ``auth_key`` (the
deployment's internal token) every request header is signed, and unsigned ones refused.
"""

from __future__ import annotations

import json
import socket

from prometheus_client import CollectorRegistry

from engine.kvcache.pool import KVPool
from services.kvtransfer import wire
from services.kvtransfer.blockbytes import byte_view, chunks, runs
from services.kvtransfer.stream import Refused, StreamTransferBackend
from services.kvtransfer.types import AgentMetadata, ReceiveHandle, TransferHandle


class TcpTransferBackend(StreamTransferBackend):
    name = "tcp"
    kind = wire.Kind.PUSH

    def __init__(
        self,
        agent_name: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        socket_buffer_bytes: int | None = None,
        registry: CollectorRegistry | None = None,
        fence_grace_s: float = 2.0,
        auth_key: bytes | None = None,
    ):
        """``socket_buffer_bytes`` pins SO_SNDBUF/SO_RCVBUF. Leave it None: setting them turns
        off the kernel's autotuning, which reaches far larger buffers (net.ipv4.tcp_rmem)
        than an explicit value may (net.core.rmem_max). Tests use a tiny one to slow a
        transfer down enough to kill a peer in the middle of it."""
        super().__init__(
            agent_name, registry=registry, fence_grace_s=fence_grace_s, auth_key=auth_key
        )
        self.host = host
        self.port = port
        self.advertise_host = advertise_host or host
        self.socket_buffer_bytes = socket_buffer_bytes

    def _listen(self) -> socket.socket:
        family, kind, proto, _, address = socket.getaddrinfo(
            self.host, self.port, type=socket.SOCK_STREAM
        )[0]
        listener = socket.socket(family, kind, proto)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._tune(listener)  # before listen(): accepted sockets inherit the buffer sizes
        listener.bind(address)
        listener.listen(128)
        return listener

    def _address_payload(self, listener: socket.socket, pool: KVPool) -> bytes:
        port = listener.getsockname()[1]
        return json.dumps({"host": self.advertise_host, "port": port}).encode()

    def _add_peer(self, name: str, metadata: AgentMetadata) -> None:
        address = json.loads(metadata.payload)
        if not isinstance(address.get("host"), str) or not isinstance(address.get("port"), int):
            raise ValueError(f"peer {name!r} has a bad tcp address: {address!r}")

    def _connect(self, peer: AgentMetadata, timeout_s: float) -> socket.socket:
        address = json.loads(peer.payload)
        sock = socket.socket(
            socket.AF_INET6 if ":" in address["host"] else socket.AF_INET, socket.SOCK_STREAM
        )
        self._tune(sock)
        sock.settimeout(timeout_s)
        try:
            sock.connect((address["host"], address["port"]))
        except OSError:
            sock.close()
            raise
        return sock

    def _send_payload(self, handle: TransferHandle, sock: socket.socket) -> None:
        # Wait for the receiver's go-ahead: a refusal then costs one round trip instead of
        # streaming the whole payload into a connection about to be reset.
        ready, message = wire.read_ack(sock)
        if not ready:
            raise Refused(message)
        pool_bytes = memoryview(byte_view(self.pool.tensor).numpy())
        block_bytes = self.pool.layout.block_bytes
        for run in runs(handle.block_ids, handle.block_ids):
            for start, size in chunks(run.src * block_bytes, run.count * block_bytes):
                sock.sendall(pool_bytes[start : start + size])
                handle.moved_bytes += size

    def _receive_payload(
        self, handle: ReceiveHandle, sock: socket.socket, req: wire.TransferRequest
    ) -> None:
        sock.sendall(wire.encode_ack(True, "ready"))
        pool_bytes = memoryview(byte_view(self.pool.tensor).numpy())
        block_bytes = self.pool.layout.block_bytes
        for run in runs(req.dst_ids, req.dst_ids):
            for start, size in chunks(run.dst * block_bytes, run.count * block_bytes):
                wire.recv_into_exact(sock, pool_bytes[start : start + size])
                handle.moved_bytes += size

    def _tune(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.socket_buffer_bytes is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.socket_buffer_bytes)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.socket_buffer_bytes)
