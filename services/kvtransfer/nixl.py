"""NixlTransferBackend: NIXL with its UCX backend (RDMA, NVLink, shared memory or TCP,
whichever UCX finds between the two agents).

The whole pool tensor is registered once; per-block descriptor lists are prepared once for
the local pool and once per peer, so a transfer is only a list of block indices.

Direction: WRITE by prefill. The decode replica allocated its blocks before it answered
PrepareReceive, so there is nothing to wait for: prefill pushes as soon as its KV is ready
and frees its blocks the moment NIXL reports the write complete, which is what keeps the
prefill pool (the scarce one under long prompts) turning over. NIXL delivers the transfer's
notification only after the data has landed, so decode learns of completion with no extra
round trip; READ by decode would cost one more message (prefill says "ready", decode pulls,
decode says "done") before prefill could free anything.

The price of WRITE is that decode cannot stop a remote writer by itself. So a sender that
ends without DONE releases (cancels) its NIXL request and then sends a ``stop``
notification; a decode side that gives up waits for that, or for the fence grace period,
before its blocks are reused.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry

from engine.kvcache.pool import KVPool
from services.kvtransfer.interface import TransferBackend
from services.kvtransfer.types import (
    AgentMetadata,
    ReceiveDescriptors,
    ReceiveHandle,
    TransferError,
    TransferHandle,
    TransferState,
)

_DONE = b"kvx:done:"
_STOP = b"kvx:stop:"
_INFO_LEN = struct.Struct("<I")


class NixlUnavailableError(RuntimeError):
    """NIXL (or its UCX plugin) is not installed in this environment."""


def nixl_import_error() -> str:
    """Why ``import nixl._api`` fails, or '' if it works. Checked in a child interpreter so
    NIXL's bundled native libraries (protobuf, abseil) never load into the caller, where they
    can crash other extensions such as grpc_tools' protoc."""
    probe = subprocess.run(
        [sys.executable, "-c", "import nixl._api"], capture_output=True, text=True, timeout=120
    )
    if probe.returncode == 0:
        return ""
    lines = probe.stderr.strip().splitlines()
    return lines[-1] if lines else f"exit status {probe.returncode}"


@dataclass
class _Peer:
    remote_name: Any  # what nixl_agent.add_remote_agent returned
    prepped: Any
    base: int


@dataclass
class _Xfer:
    request: Any | None
    peer: _Peer


class NixlTransferBackend(TransferBackend):
    name = "nixl"

    def __init__(
        self,
        agent_name: str,
        *,
        registry: CollectorRegistry | None = None,
        fence_grace_s: float = 2.0,
    ):
        super().__init__(agent_name, registry=registry, fence_grace_s=fence_grace_s)
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as exc:
            raise NixlUnavailableError(
                f"the nixl backend needs the `nixl` package (pip install nixl): {exc}"
            ) from exc
        self._agent = nixl_agent(agent_name, nixl_agent_config(backends=["UCX"]))
        if "UCX" not in self._agent.backends:
            raise NixlUnavailableError("NIXL is installed but its UCX plugin could not start")
        # The agent is built without NIXL's own thread safety (no listener thread), and the
        # poller, the control plane and release() may call it from different threads.
        self._agent_lock = threading.Lock()
        self._registered: Any = None
        self._local: Any = None
        self._base = 0
        self._nixl_peers: dict[str, _Peer] = {}
        self._expecting: set[str] = set()
        self._notified: dict[str, bytes] = {}

    # ----------------------------------------------------------- registration

    def _register(self, pool: KVPool) -> bytes:
        with self._agent_lock:
            self._registered = self._agent.register_memory(pool.tensor)
            self._base = pool.tensor.data_ptr()
            rows = _block_rows(self._base, pool.layout.block_bytes, pool.num_blocks)
            self._local = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", rows, "DRAM")
            nixl_md = self._agent.get_agent_metadata()
        info = json.dumps({"base": self._base}).encode()
        return _INFO_LEN.pack(len(info)) + info + nixl_md

    def _block_addr(self, block_id: int) -> int:
        return self._base + block_id * self.pool.layout.block_bytes

    def _add_peer(self, name: str, metadata: AgentMetadata) -> None:
        (info_len,) = _INFO_LEN.unpack_from(metadata.payload)
        info = json.loads(metadata.payload[_INFO_LEN.size : _INFO_LEN.size + info_len])
        nixl_md = metadata.payload[_INFO_LEN.size + info_len :]
        rows = _block_rows(info["base"], metadata.layout.block_bytes, metadata.num_blocks)
        with self._agent_lock:
            remote = self._agent.add_remote_agent(nixl_md)
            prepped = self._agent.prep_xfer_dlist(remote, rows, "DRAM")
        self._nixl_peers[name] = _Peer(remote_name=remote, prepped=prepped, base=info["base"])

    def _remove_peer(self, name: str) -> None:
        peer = self._nixl_peers.pop(name, None)
        if peer is not None:
            with self._agent_lock:
                self._agent.release_dlist_handle(peer.prepped)
                self._agent.remove_remote_agent(peer.remote_name)

    # -------------------------------------------------------------- transfers

    def _start_receive(self, handle: ReceiveHandle) -> None:
        with self._agent_lock:
            self._expecting.add(handle.request_id)

    def _start_send(
        self, handle: TransferHandle, peer: AgentMetadata, remote: ReceiveDescriptors
    ) -> None:
        nixl_peer = self._nixl_peers[peer.agent_name]
        block_bytes = self.pool.layout.block_bytes
        for b in remote.blocks:
            if b.addr != nixl_peer.base + b.block_id * block_bytes:
                raise TransferError(f"descriptor {b} does not match peer {peer.agent_name!r}")
        with self._agent_lock:
            request = self._agent.make_prepped_xfer(
                "WRITE",
                self._local,
                list(handle.block_ids),
                nixl_peer.prepped,
                remote.block_ids,
                notif_msg=_DONE + handle.request_id.encode(),
            )
            handle.private = _Xfer(request=request, peer=nixl_peer)
            status = self._agent.transfer(request)
        self._apply(handle, status)

    def _progress(self, handle: TransferHandle) -> None:
        if handle.role == "send":
            xfer: _Xfer = handle.private
            with self._agent_lock:
                if xfer.request is None:
                    return
                status = self._agent.check_xfer_state(xfer.request)
            self._apply(handle, status)
            return
        self._drain_notifications()
        with self._agent_lock:
            event = self._notified.get(handle.request_id)
        if event == _DONE:
            self._finish(handle, TransferState.DONE)
        elif event == _STOP:
            self._finish(handle, TransferState.FAILED, "sender stopped before completing")

    def _apply(self, handle: TransferHandle, status: str) -> None:
        if status == "DONE":
            self._finish(handle, TransferState.DONE)
        elif status == "ERR":
            self._finish(handle, TransferState.FAILED, "NIXL reported a transfer error")

    def _cancel(self, handle: TransferHandle) -> None:
        if handle.role != "send" or handle.private is None:
            return
        xfer: _Xfer = handle.private
        self._try_release(xfer)
        try:
            with self._agent_lock:
                self._agent.send_notif(xfer.peer.remote_name, _STOP + handle.request_id.encode())
        except Exception:  # the peer may be gone; its own deadline covers it
            pass

    def _wait_fenced(self, handle: TransferHandle, timeout_s: float) -> bool:
        end = time.monotonic() + timeout_s
        while True:
            if handle.role == "send":
                if handle.private is None or self._try_release(handle.private):
                    return True
            elif handle.state is TransferState.DONE or self._peer_said(handle.request_id):
                return True
            if time.monotonic() >= end:
                return False
            time.sleep(0.001)

    def _forget(self, handle: TransferHandle) -> None:
        if handle.role == "receive":
            with self._agent_lock:
                self._expecting.discard(handle.request_id)
                self._notified.pop(handle.request_id, None)
        elif handle.private is not None:
            self._try_release(handle.private)

    def _close(self) -> None:
        with self._agent_lock:
            if self._local is not None:
                self._agent.release_dlist_handle(self._local)
            if self._registered is not None:
                self._agent.deregister_memory(self._registered)
            self._local = self._registered = None

    # ---------------------------------------------------------------- helpers

    def _try_release(self, xfer: _Xfer) -> bool:
        """Releases (and so cancels) the NIXL request; False while NIXL cannot cancel it yet."""
        with self._agent_lock:
            if xfer.request is None:
                return True
            try:
                self._agent.release_xfer_handle(xfer.request)
            except Exception:
                return False
            xfer.request = None
            return True

    def _peer_said(self, request_id: str) -> bool:
        self._drain_notifications()
        with self._agent_lock:
            return request_id in self._notified

    def _drain_notifications(self) -> None:
        with self._agent_lock:
            for messages in self._agent.get_new_notifs().values():
                for msg in messages:
                    for prefix in (_DONE, _STOP):
                        if msg.startswith(prefix):
                            rid = msg[len(prefix) :].decode(errors="replace")
                            # Late news about released requests is dropped, not hoarded.
                            if rid in self._expecting:
                                self._notified.setdefault(rid, prefix)


def _block_rows(base: int, block_bytes: int, num_blocks: int) -> np.ndarray:
    """NIXL's Nx3 descriptor array (address, length, device id) with one row per block."""
    rows = np.zeros((num_blocks, 3), dtype=np.uint64)
    rows[:, 0] = base + np.arange(num_blocks, dtype=np.uint64) * np.uint64(block_bytes)
    rows[:, 1] = block_bytes
    return rows
