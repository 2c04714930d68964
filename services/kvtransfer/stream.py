"""What the tcp and shm backends share: a listener, one connection and thread per transfer.

A connection per transfer keeps failures isolated (one broken transfer never poisons
another) and makes cancellation a ``shutdown`` of that one socket. The receiving side
serves each connection on its own thread; the sending side runs each transfer on its own
thread. Each thread holds the handle's I/O lock while it may touch blocks, which is what
``_wait_fenced`` waits for before ``release`` lets the block manager reuse them.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from abc import abstractmethod
from dataclasses import dataclass, field

from engine.kvcache.pool import KVPool
from services.kvtransfer import wire
from services.kvtransfer.interface import TransferBackend
from services.kvtransfer.types import (
    AgentMetadata,
    ReceiveDescriptors,
    ReceiveHandle,
    TransferHandle,
    TransferState,
)

log = logging.getLogger(__name__)

# A peer that connected must send its header promptly; a stuck one must not pin a thread.
HEADER_TIMEOUT_S = 10.0


class Refused(Exception):
    """The receiver said no before any payload moved; the message says why."""


@dataclass
class _Io:
    lock: threading.Lock = field(default_factory=threading.Lock)
    conn: socket.socket | None = None


class StreamTransferBackend(TransferBackend):
    kind: wire.Kind
    # How a cancelled sender hangs up: a pushing sender only reads its own memory and can
    # drop the connection at once; a sender whose blocks the peer is reading only half-closes
    # and waits for the peer to hang up, which is the peer's promise that it stopped reading.
    sender_shutdown = socket.SHUT_RDWR

    def __init__(self, agent_name: str, *, auth_key: bytes | None = None, **kwargs):
        """``auth_key``: requests are signed with it, and unsigned ones refused (wire.py)."""
        super().__init__(agent_name, **kwargs)
        self.auth_key = auth_key
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None

    # ------------------------------------------------------------ transport hooks

    @abstractmethod
    def _listen(self) -> socket.socket:
        """A bound, listening socket."""

    @abstractmethod
    def _address_payload(self, listener: socket.socket, pool: KVPool) -> bytes: ...

    @abstractmethod
    def _connect(self, peer: AgentMetadata, timeout_s: float) -> socket.socket: ...

    def _check_send(self) -> None:
        """Raises TransferError when this agent cannot send at all."""

    def _send_payload(self, handle: TransferHandle, sock: socket.socket) -> None:
        return None

    @abstractmethod
    def _receive_payload(
        self, handle: ReceiveHandle, sock: socket.socket, req: wire.TransferRequest
    ) -> None: ...

    # ------------------------------------------------------------------ backend

    def _register(self, pool: KVPool) -> bytes:
        listener = self._listen()
        self._listener = listener
        self._acceptor = threading.Thread(
            target=self._accept_loop,
            args=(listener,),
            daemon=True,
            name=f"kvx-{self.name}-accept-{self.agent_name}",
        )
        self._acceptor.start()
        return self._address_payload(listener, pool)

    def _start_receive(self, handle: ReceiveHandle) -> None:
        handle.private = _Io()

    def _start_send(
        self, handle: TransferHandle, peer: AgentMetadata, remote: ReceiveDescriptors
    ) -> None:
        self._check_send()
        handle.private = _Io()
        req = wire.TransferRequest(
            kind=self.kind,
            request_id=handle.request_id,
            sender=self.agent_name,
            block_bytes=self.pool.layout.block_bytes,
            src_ids=handle.block_ids,
            dst_ids=tuple(remote.block_ids),
        )
        threading.Thread(
            target=self._run_send,
            args=(handle, peer, req),
            daemon=True,
            name=f"kvx-{self.name}-send-{handle.request_id}",
        ).start()

    def _cancel(self, handle: TransferHandle) -> None:
        io: _Io | None = handle.private
        if io is None:
            return
        with handle.lock:
            conn = io.conn
        if conn is not None:
            how = self.sender_shutdown if handle.role == "send" else socket.SHUT_RDWR
            try:
                conn.shutdown(how)
            except OSError:
                pass  # already closed by its thread

    def _wait_fenced(self, handle: TransferHandle, timeout_s: float) -> bool:
        io: _Io | None = handle.private
        if io is None:
            return True
        if not io.lock.acquire(timeout=timeout_s):
            return False
        io.lock.release()
        return True

    def _close(self) -> None:
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept() on Linux
            except OSError:
                pass
            self._listener.close()
        if self._acceptor is not None:
            self._acceptor.join(timeout=2.0)

    # ------------------------------------------------------------- sender side

    def _run_send(self, handle: TransferHandle, peer: AgentMetadata, req: wire.TransferRequest):
        io: _Io = handle.private
        with io.lock:
            try:
                sock = self._connect(peer, max(handle.remaining_s, 0.001))
            except OSError as exc:
                self._fail(handle, f"cannot reach {peer.agent_name!r}: {exc}")
                return
            with sock:
                with handle.lock:
                    if handle.state.terminal:
                        return
                    io.conn = sock
                try:
                    sock.settimeout(max(handle.remaining_s, 0.001))
                    sock.sendall(wire.encode_request(req, self.auth_key))
                    self._send_payload(handle, sock)
                    ok, message = wire.read_ack(sock)
                except Refused as exc:
                    ok, message = False, str(exc)
                except OSError as exc:
                    self._fail(handle, f"transfer to {peer.agent_name!r} broke: {exc}")
                    return
                finally:
                    with handle.lock:
                        io.conn = None
            if ok:
                self._finish(handle, TransferState.DONE)
            else:
                self._finish(handle, TransferState.FAILED, f"receiver refused: {message}")

    def _fail(self, handle: TransferHandle, error: str) -> None:
        late = time.monotonic() >= handle.deadline
        self._finish(handle, TransferState.TIMED_OUT if late else TransferState.FAILED, error)

    # ----------------------------------------------------------- receiver side

    def _accept_loop(self, listener: socket.socket) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # listener shut down by close()
            threading.Thread(
                target=self._serve,
                args=(conn,),
                daemon=True,
                name=f"kvx-{self.name}-serve-{self.agent_name}",
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(HEADER_TIMEOUT_S)
            try:
                req = wire.read_request(conn, self.auth_key)
            except wire.Unauthenticated as exc:
                log.warning(
                    "kvtransfer %s: refused an unauthenticated transfer: %s", self.name, exc
                )
                self._reply(conn, False, "unauthenticated")
                return
            except (OSError, ValueError) as exc:  # ValueError: undecodable names
                log.warning("kvtransfer %s: dropped a bad connection: %s", self.name, exc)
                return
            handle = self._lookup("receive", req.request_id)
            problem = self._refusal(handle, req)
            if problem or handle is None:
                self._reply(conn, False, problem)
                return
            assert isinstance(handle, ReceiveHandle)
            ok, message = self._serve_prepared(handle, conn, req)
            self._reply(conn, ok, message)

    def _serve_prepared(
        self, handle: ReceiveHandle, conn: socket.socket, req: wire.TransferRequest
    ) -> tuple[bool, str]:
        io: _Io = handle.private
        with io.lock:
            with handle.lock:
                if handle.state.terminal:
                    return False, f"receiver already {handle.state.value}"
                io.conn = conn
                handle.peer = req.sender
            try:
                conn.settimeout(max(handle.remaining_s, 0.001))
                self._receive_payload(handle, conn, req)
            except (OSError, InterruptedError) as exc:
                self._fail(handle, f"receive from {req.sender!r} broke: {exc}")
                return False, str(exc)
            finally:
                with handle.lock:
                    io.conn = None
        if not self._finish(handle, TransferState.DONE):
            return False, f"receiver already {handle.state.value}"
        return True, ""

    def _refusal(self, handle: TransferHandle | None, req: wire.TransferRequest) -> str:
        if req.kind is not self.kind:
            return f"{self.name} receiver got a {req.kind.name} request"
        if handle is None:
            return f"no transfer prepared for request {req.request_id!r}"
        if req.dst_ids != handle.block_ids:
            return f"destination blocks {list(req.dst_ids)} differ from the prepared ones"
        if req.block_bytes != self.pool.layout.block_bytes:
            return f"block size {req.block_bytes} differs from {self.pool.layout.block_bytes}"
        return ""

    @staticmethod
    def _reply(conn: socket.socket, ok: bool, message: str) -> None:
        try:
            conn.sendall(wire.encode_ack(ok, message))
        except OSError:
            pass  # the sender is gone; its own side already failed
