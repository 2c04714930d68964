"""The transfer interface every backend implements, and the bookkeeping they share.

One request's KV moves in four steps (the SGLang disaggregation connector and NIXL have the
same shape): the decode side allocates blocks and calls ``prepare_receive``; the descriptors
travel to the prefill side over the control plane; the prefill side calls ``send``; both
sides ``poll`` their handle until it is terminal and then ``release`` the request. Which side
actually moves the bytes (WRITE by prefill or READ by decode) is each backend's choice and
is explained in its module.

Deadlines are relative seconds from the call. Give the receiving side a longer one than the
sender (the control plane adds a grace period) so a sender that stops at its deadline has
stopped touching the receiver's blocks before the receiver gives them back.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

from prometheus_client import CollectorRegistry

from engine.kvcache.pool import KVPool
from services.kvtransfer.metrics import transfer_metrics
from services.kvtransfer.types import (
    AgentMetadata,
    BlockDescriptor,
    ReceiveDescriptors,
    ReceiveHandle,
    Role,
    TransferError,
    TransferHandle,
    TransferState,
    layout_mismatch,
)

log = logging.getLogger(__name__)


class TransferBackend(ABC):
    """Moves KV blocks between this process's pool and peers' pools."""

    name: ClassVar[str]

    def __init__(
        self,
        agent_name: str,
        *,
        registry: CollectorRegistry | None = None,
        fence_grace_s: float = 2.0,
    ):
        if not agent_name:
            raise ValueError("a transfer agent needs a non-empty name")
        self.agent_name = agent_name
        self.fence_grace_s = fence_grace_s
        self._metrics = transfer_metrics(registry)
        self._pool: KVPool | None = None
        self._metadata: AgentMetadata | None = None
        self._peers: dict[str, AgentMetadata] = {}
        self._handles: dict[tuple[Role, str], TransferHandle] = {}
        self._lock = threading.Lock()
        self._closed = False

    # ----------------------------------------------------------------- public API

    @property
    def pool(self) -> KVPool:
        if self._pool is None:
            raise TransferError(f"{self.name} agent {self.agent_name!r} has no pool registered")
        return self._pool

    @property
    def metadata(self) -> AgentMetadata:
        if self._metadata is None:
            raise TransferError(f"{self.name} agent {self.agent_name!r} has no pool registered")
        return self._metadata

    def register_pool(self, pool: KVPool, *, replica: str = "") -> AgentMetadata:
        """Make `pool` reachable; peers learn it (as `replica`, if named) from the metadata."""
        if self._pool is not None:
            raise TransferError(f"agent {self.agent_name!r} already has a pool registered")
        if not pool.tensor.is_contiguous():
            raise TransferError("the KV pool tensor must be contiguous to move blocks as bytes")
        payload = self._register(pool)
        self._pool = pool
        self._metadata = AgentMetadata(
            backend=self.name,
            agent_name=self.agent_name,
            layout=pool.layout,
            num_blocks=pool.num_blocks,
            payload=payload,
            replica=replica,
        )
        return self._metadata

    def add_peer(self, name: str, metadata: AgentMetadata) -> None:
        if metadata.backend != self.name:
            raise TransferError(
                f"peer {name!r} uses the {metadata.backend!r} backend, "
                f"this agent uses {self.name!r}"
            )
        if name != metadata.agent_name:
            raise TransferError(
                f"peer name {name!r} differs from its agent name {metadata.agent_name!r}"
            )
        mismatch = layout_mismatch(self.pool.layout, metadata.layout, self.agent_name, name)
        if mismatch:
            raise TransferError(mismatch)
        with self._lock:
            known = self._peers.get(name)
            earlier = [
                n
                for n, md in self._peers.items()
                if metadata.replica and md.replica == metadata.replica and n != name
            ]
        if known == metadata:
            return
        # A restarted replica: what was kept about its earlier process (a mapping of its
        # pool, its address) is stale. Transfers still running hold their own references.
        for old in earlier:
            log.info("kvtransfer peer %r replaces %r (replica %s)", name, old, metadata.replica)
            self.remove_peer(old)
        if known is not None:
            self.remove_peer(name)
        self._add_peer(name, metadata)
        with self._lock:
            self._peers[name] = metadata

    @property
    def peer_names(self) -> list[str]:
        with self._lock:
            return sorted(self._peers)

    def remove_peer(self, name: str) -> None:
        with self._lock:
            known = self._peers.pop(name, None)
        if known is not None:
            self._remove_peer(name)

    def prepare_receive(
        self, request_id: str, block_ids: Sequence[int], deadline_s: float
    ) -> ReceiveHandle:
        """Decode side: announce the blocks this request's KV should land in."""
        ids = self._check_blocks(block_ids, "destination")
        block_bytes = self.pool.layout.block_bytes
        descriptors = ReceiveDescriptors(
            request_id=request_id,
            agent_name=self.agent_name,
            blocks=tuple(BlockDescriptor(i, self._block_addr(i), block_bytes) for i in ids),
        )
        handle = ReceiveHandle(
            request_id=request_id,
            role="receive",
            backend=self.name,
            peer="",
            block_ids=ids,
            nbytes=len(ids) * block_bytes,
            deadline=time.monotonic() + deadline_s,
            descriptors=descriptors,
        )
        self._track(handle)
        self._start_receive(handle)
        return handle

    def send(
        self,
        request_id: str,
        src_block_ids: Sequence[int],
        remote: ReceiveDescriptors,
        deadline_s: float,
    ) -> TransferHandle:
        """Prefill side: move ``src_block_ids`` into the blocks ``remote`` describes."""
        ids = self._check_blocks(src_block_ids, "source")
        with self._lock:
            peer = self._peers.get(remote.agent_name)
        if peer is None:
            raise TransferError(f"unknown peer {remote.agent_name!r}: call add_peer first")
        if remote.request_id != request_id:
            raise TransferError(
                f"descriptors are for request {remote.request_id!r}, not {request_id!r}"
            )
        if len(remote.blocks) != len(ids):
            raise TransferError(
                f"request {request_id!r} has {len(ids)} source blocks but the receiver "
                f"prepared {len(remote.blocks)}"
            )
        block_bytes = self.pool.layout.block_bytes
        for b in remote.blocks:
            if b.nbytes != block_bytes or not 0 <= b.block_id < peer.num_blocks:
                raise TransferError(f"bad remote block descriptor {b} for peer {peer.agent_name!r}")
        handle = TransferHandle(
            request_id=request_id,
            role="send",
            backend=self.name,
            peer=remote.agent_name,
            block_ids=ids,
            nbytes=len(ids) * block_bytes,
            deadline=time.monotonic() + deadline_s,
        )
        self._track(handle)
        try:
            self._start_send(handle, peer, remote)
        except TransferError:
            with self._lock:
                self._handles.pop((handle.role, request_id), None)
            raise
        except Exception as exc:  # a transport error is the transfer's outcome, not the caller's
            log.warning("kvtransfer %s: send of %s failed to start: %s", self.name, request_id, exc)
            self._finish(handle, TransferState.FAILED, f"could not start: {exc}")
        return handle

    def poll(self, handle: TransferHandle) -> TransferState:
        if handle.state.terminal:
            return handle.state
        self._progress(handle)
        if not handle.state.terminal and time.monotonic() >= handle.deadline:
            self._finish(handle, TransferState.TIMED_OUT, "deadline passed")
        return handle.state

    def abort(self, handle: TransferHandle) -> None:
        self._finish(handle, TransferState.ABORTED, "aborted")

    def release(self, request_id: str) -> None:
        """Forgets the request; on return the peer no longer touches its blocks on this side
        (or the fence grace period ran out, which is logged), so they can be reused."""
        with self._lock:
            keys = [k for k in self._handles if k[1] == request_id]
            handles = [self._handles.pop(k) for k in keys]
        for handle in handles:
            if not handle.state.terminal:
                self._finish(handle, TransferState.ABORTED, "released while pending")
            if not self._wait_fenced(handle, self.fence_grace_s):
                log.warning(
                    "kvtransfer %s: peer %r may still touch the blocks of %s (%s); releasing "
                    "after the %.1fs grace period",
                    self.name,
                    handle.peer,
                    request_id,
                    handle.role,
                    self.fence_grace_s,
                )
            self._forget(handle)

    def close(self) -> None:
        if self._closed:
            return
        with self._lock:
            request_ids = {rid for _, rid in self._handles}
        for rid in request_ids:
            self.release(rid)
        for name in list(self._peers):
            self.remove_peer(name)
        self._closed = True
        self._close()

    def __enter__(self) -> TransferBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------- for the subclasses

    def _finish(self, handle: TransferHandle, state: TransferState, error: str = "") -> bool:
        if not handle.finish(state, error):
            return False
        self._metrics.observe(handle)
        if state is not TransferState.DONE:
            self._cancel(handle)
        return True

    def _lookup(self, role: Role, request_id: str) -> TransferHandle | None:
        with self._lock:
            return self._handles.get((role, request_id))

    def _block_addr(self, block_id: int) -> int:
        return block_id * self.pool.layout.block_bytes

    def _track(self, handle: TransferHandle) -> None:
        key = (handle.role, handle.request_id)
        with self._lock:
            if self._closed:
                raise TransferError(f"agent {self.agent_name!r} is closed")
            if key in self._handles:
                raise TransferError(
                    f"request {handle.request_id!r} already has a {handle.role} in flight; "
                    "release it first"
                )
            self._handles[key] = handle

    def _check_blocks(self, block_ids: Sequence[int], what: str) -> tuple[int, ...]:
        ids = tuple(int(i) for i in block_ids)
        n = self.pool.num_blocks
        if not ids:
            raise ValueError(f"a transfer needs at least one {what} block")
        if len(set(ids)) != len(ids):
            raise ValueError(f"{what} block ids repeat: {list(ids)}")
        bad = [i for i in ids if not 0 <= i < n]
        if bad:
            raise ValueError(f"{what} block ids {bad} are outside the pool of {n} blocks")
        return ids

    @abstractmethod
    def _register(self, pool: KVPool) -> bytes:
        """Makes the pool reachable; returns the backend payload of this agent's metadata."""

    @abstractmethod
    def _add_peer(self, name: str, metadata: AgentMetadata) -> None: ...

    def _remove_peer(self, name: str) -> None:
        return None

    def _start_receive(self, handle: ReceiveHandle) -> None:
        return None

    @abstractmethod
    def _start_send(
        self, handle: TransferHandle, peer: AgentMetadata, remote: ReceiveDescriptors
    ) -> None: ...

    def _progress(self, handle: TransferHandle) -> None:
        """Advances a pending handle; backends driven by their own threads need nothing."""
        return None

    @abstractmethod
    def _cancel(self, handle: TransferHandle) -> None:
        """Stops local work on a handle that ended without DONE. Idempotent, never blocks."""

    @abstractmethod
    def _wait_fenced(self, handle: TransferHandle, timeout_s: float) -> bool:
        """Waits until nothing (local thread or remote peer) touches the handle's blocks."""

    def _forget(self, handle: TransferHandle) -> None:
        return None

    def _close(self) -> None:
        return None
