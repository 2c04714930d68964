"""FakeTransferBackend: an in-process fake of a transfer fabric, for unit tests only.

Two fake agents in one process share a ``FakeFabric`` (passed in explicitly, so tests never
share hidden state) and copy blocks between their two ``KVPool`` objects with a direct
memcpy. Faults are injected per agent: a delay before a transfer completes, or failure of
chosen request ids. Everything happens on the polling thread, so the blocks are always
fenced the moment a handle is terminal.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from engine.kvcache.pool import KVPool
from services.kvtransfer.blockbytes import byte_view, copy_runs
from services.kvtransfer.interface import TransferBackend
from services.kvtransfer.types import (
    AgentMetadata,
    ReceiveDescriptors,
    TransferError,
    TransferHandle,
    TransferState,
)


@dataclass
class FakeFaults:
    """Faults a fake sender injects into its own transfers; mutable between sends."""

    delay_s: float = 0.0
    fail_requests: set[str] = field(default_factory=set)
    error: str = "injected failure"


@dataclass
class _FakeOp:
    remote: ReceiveDescriptors
    ready_at: float
    fail: bool


class FakeFabric:
    """The 'network' joining fake agents of one process."""

    def __init__(self) -> None:
        self._agents: dict[str, FakeTransferBackend] = {}
        self.lock = threading.RLock()

    def join(self, agent: FakeTransferBackend) -> None:
        with self.lock:
            if agent.agent_name in self._agents:
                raise TransferError(f"fake agent {agent.agent_name!r} already joined")
            self._agents[agent.agent_name] = agent

    def leave(self, agent: FakeTransferBackend) -> None:
        with self.lock:
            self._agents.pop(agent.agent_name, None)

    def agent(self, name: str) -> FakeTransferBackend | None:
        with self.lock:
            return self._agents.get(name)


class FakeTransferBackend(TransferBackend):
    name = "fake"

    def __init__(
        self,
        agent_name: str,
        fabric: FakeFabric,
        *,
        faults: FakeFaults | None = None,
        registry: CollectorRegistry | None = None,
    ):
        super().__init__(agent_name, registry=registry)
        self.fabric = fabric
        self.faults = faults if faults is not None else FakeFaults()

    def _register(self, pool: KVPool) -> bytes:
        self.fabric.join(self)
        return b""

    def _add_peer(self, name: str, metadata: AgentMetadata) -> None:
        if self.fabric.agent(name) is None:
            raise TransferError(f"fake agent {name!r} is not on this fabric")

    def _start_send(
        self, handle: TransferHandle, peer: AgentMetadata, remote: ReceiveDescriptors
    ) -> None:
        handle.private = _FakeOp(
            remote=remote,
            ready_at=time.monotonic() + self.faults.delay_s,
            fail=handle.request_id in self.faults.fail_requests,
        )

    def _progress(self, handle: TransferHandle) -> None:
        if handle.role == "send":
            self._complete_if_due(handle)

    def _complete_if_due(self, handle: TransferHandle) -> None:
        op: _FakeOp = handle.private
        if time.monotonic() < op.ready_at:
            return
        with self.fabric.lock:
            if handle.state.terminal:
                return
            receiver = self.fabric.agent(op.remote.agent_name)
            target = receiver._lookup("receive", handle.request_id) if receiver else None
            if receiver is None or target is None or target.state.terminal:
                self._finish(handle, TransferState.FAILED, "receiver is not expecting this request")
                return
            if op.fail:
                receiver._finish(target, TransferState.FAILED, self.faults.error)
                self._finish(handle, TransferState.FAILED, self.faults.error)
                return
            copy_runs(
                byte_view(self.pool.tensor),
                byte_view(receiver.pool.tensor),
                handle.block_ids,
                op.remote.block_ids,
                self.pool.layout.block_bytes,
            )
            target.peer = self.agent_name
            receiver._finish(target, TransferState.DONE)
            self._finish(handle, TransferState.DONE)

    def _cancel(self, handle: TransferHandle) -> None:
        # Like a real sender's stop notification: the receiver learns the transfer is over.
        if handle.role != "send" or handle.private is None:
            return
        op: _FakeOp = handle.private
        with self.fabric.lock:
            receiver = self.fabric.agent(op.remote.agent_name)
            target = receiver._lookup("receive", handle.request_id) if receiver else None
            if receiver is not None and target is not None:
                receiver._finish(target, TransferState.FAILED, f"sender ended: {handle.error}")

    def _wait_fenced(self, handle: TransferHandle, timeout_s: float) -> bool:
        return True

    def _close(self) -> None:
        self.fabric.leave(self)
