"""The framed binary protocol the stream backends (tcp, shm) speak, one connection per transfer.

Sender -> receiver: a fixed header, the request id and sender name (UTF-8), the source and
destination block ids (little-endian uint32), then for ``PUSH`` the raw bytes of every
block in destination order, sent only after the receiver acked the header ("ready", or a
refusal). ``PULL`` carries no payload: the receiver copies the blocks out of the sender's
shared-memory pool itself. Either way the receiver ends with one ack frame: done or why not.

In a deployment with an internal token the request (before any payload) ends with an
HMAC-SHA256 of everything before it, under a key derived from the token
(shared/rpc/auth.py), and flag FLAG_AUTHENTICATED set: a receiver holding a key refuses a
request without a valid one, so nobody who merely reaches the port writes into a KV pool.
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import struct
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

_REQUEST_MAGIC = b"KVX1"
_ACK_MAGIC = b"KVXA"
# magic, kind, flags (reserved), request-id length, sender-name length, blocks, block bytes
_REQUEST = struct.Struct("<4sBBHHIQ")
# magic, ok, message length
_ACK = struct.Struct("<4sBH")
# Refuse frames no real transfer needs; a garbage header must not make us allocate GiBs.
MAX_BLOCKS = 1 << 22
MAX_NAME_BYTES = 4096
FLAG_AUTHENTICATED = 1
_MAC_BYTES = hashlib.sha256().digest_size


class Kind(IntEnum):
    PUSH = 1
    PULL = 2


class ProtocolError(ConnectionError):
    """The peer sent something that is not this protocol."""


class Unauthenticated(ProtocolError):
    """The request lacks a valid MAC under this deployment's key."""


@dataclass(frozen=True)
class TransferRequest:
    kind: Kind
    request_id: str
    sender: str
    block_bytes: int
    src_ids: tuple[int, ...]
    dst_ids: tuple[int, ...]

    @property
    def payload_bytes(self) -> int:
        return len(self.dst_ids) * self.block_bytes if self.kind is Kind.PUSH else 0


def encode_request(req: TransferRequest, key: bytes | None = None) -> bytes:
    rid = req.request_id.encode()
    sender = req.sender.encode()
    if len(rid) > MAX_NAME_BYTES or len(sender) > MAX_NAME_BYTES:
        raise ValueError("request id or sender name too long for the wire")
    if len(req.src_ids) != len(req.dst_ids) or not 0 < len(req.dst_ids) <= MAX_BLOCKS:
        raise ValueError(f"bad block lists: {len(req.src_ids)} source, {len(req.dst_ids)} dest")
    flags = FLAG_AUTHENTICATED if key is not None else 0
    header = _REQUEST.pack(
        _REQUEST_MAGIC, req.kind, flags, len(rid), len(sender), len(req.dst_ids), req.block_bytes
    )
    ids = np.asarray(req.src_ids + req.dst_ids, dtype="<u4").tobytes()
    signed = header + rid + sender + ids
    return signed + _mac(key, signed) if key is not None else signed


def _mac(key: bytes, signed: bytes) -> bytes:
    return hmac.new(key, signed, hashlib.sha256).digest()


def read_request(sock: socket.socket, key: bytes | None = None) -> TransferRequest:
    """The next request; with `key`, Unauthenticated unless it carries a valid MAC."""
    head = recv_exact(sock, _REQUEST.size)
    magic, kind, flags, rid_len, sender_len, n, block_bytes = _REQUEST.unpack(head)
    if magic != _REQUEST_MAGIC:
        raise ProtocolError(f"bad request magic {magic!r}")
    if kind not in (Kind.PUSH, Kind.PULL) or not 0 < n <= MAX_BLOCKS:
        raise ProtocolError(f"bad request header: kind={kind} blocks={n}")
    if rid_len > MAX_NAME_BYTES or sender_len > MAX_NAME_BYTES:
        raise ProtocolError("request id or sender name too long")
    body = recv_exact(sock, rid_len + sender_len + 8 * n)
    tag = recv_exact(sock, _MAC_BYTES) if flags & FLAG_AUTHENTICATED else None
    if key is not None and (tag is None or not hmac.compare_digest(tag, _mac(key, head + body))):
        raise Unauthenticated("the request carries no valid MAC under this deployment's key")
    rid = body[:rid_len].decode()
    sender = body[rid_len : rid_len + sender_len].decode()
    ids = np.frombuffer(body[rid_len + sender_len :], dtype="<u4").tolist()
    return TransferRequest(Kind(kind), rid, sender, block_bytes, tuple(ids[:n]), tuple(ids[n:]))


def encode_ack(ok: bool, message: str = "") -> bytes:
    msg = message.encode()[:65535]
    return _ACK.pack(_ACK_MAGIC, int(ok), len(msg)) + msg


def read_ack(sock: socket.socket) -> tuple[bool, str]:
    magic, ok, msg_len = _ACK.unpack(recv_exact(sock, _ACK.size))
    if magic != _ACK_MAGIC:
        raise ProtocolError(f"bad ack magic {magic!r}")
    return bool(ok), recv_exact(sock, msg_len).decode(errors="replace")


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_into_exact(sock, memoryview(buf))
    return bytes(buf)


def recv_into_exact(sock: socket.socket, view: memoryview) -> None:
    """Fills ``view`` from the socket; the kernel writes straight into the caller's memory."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError(f"peer closed the connection after {got} of {len(view)} bytes")
        got += n
