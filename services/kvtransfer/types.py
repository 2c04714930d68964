"""Values that cross the KV-transfer boundary: states, peer metadata, block descriptors, handles."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import Any, Literal

import torch

from engine.kvcache.pool import KVLayout

Role = Literal["send", "receive"]


class TransferState(StrEnum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"
    TIMED_OUT = "timed_out"
    ABORTED = "aborted"

    @property
    def terminal(self) -> bool:
        return self is not TransferState.PENDING


class TransferError(RuntimeError):
    """A transfer could not be started (bad peer, bad descriptors); caller-fixable."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown KV dtype {name!r}")
    return dtype


def layout_mismatch(ours: KVLayout, theirs: KVLayout, ours_label: str, theirs_label: str) -> str:
    """Names every field on which two layouts differ; empty when blocks can be exchanged."""
    diffs = []
    for f in fields(KVLayout):
        a, b = getattr(ours, f.name), getattr(theirs, f.name)
        if a != b:
            if isinstance(a, torch.dtype):
                a, b = dtype_name(a), dtype_name(b)
            diffs.append(f"{f.name}: {ours_label}={a} {theirs_label}={b}")
    if not diffs:
        return ""
    return "KV layout mismatch (" + "; ".join(diffs) + ")"


@dataclass(frozen=True)
class AgentMetadata:
    """How a peer reaches one registered pool; shipped over the control plane."""

    backend: str
    agent_name: str
    layout: KVLayout
    num_blocks: int
    # Backend-specific reachability: a TCP address, a shared-memory segment and socket,
    # or NIXL's own serialized agent metadata.
    payload: bytes
    # The replica this agent serves, stable across its restarts ("" = unnamed): an agent
    # of the same replica under a new name is its next process, and replaces it at peers.
    replica: str = ""


@dataclass(frozen=True)
class BlockDescriptor:
    block_id: int
    # A byte offset into the pool for tcp/shm/fake, the registered virtual address for NIXL.
    addr: int
    nbytes: int


@dataclass(frozen=True)
class ReceiveDescriptors:
    """What the decode side hands the prefill side: where each of its blocks should land."""

    request_id: str
    agent_name: str
    blocks: tuple[BlockDescriptor, ...]

    @property
    def block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.blocks)


@dataclass(frozen=True)
class TransferStats:
    nbytes: int
    seconds: float


@dataclass(eq=False, kw_only=True)
class TransferHandle:
    """One side of one transfer. Background threads and the poller race to finish it;
    ``finish`` makes the first terminal state stick."""

    request_id: str
    role: Role
    backend: str
    peer: str
    block_ids: tuple[int, ...]
    nbytes: int
    deadline: float  # time.monotonic()
    started: float = field(default_factory=time.monotonic)
    state: TransferState = TransferState.PENDING
    error: str = ""
    finished: float | None = None
    # Bytes this side has moved so far, where the backend can tell (tcp, shm): progress for
    # operators looking at a slow transfer, and for tests that kill a peer mid-transfer.
    moved_bytes: int = 0
    # Per-backend bookkeeping (sockets, threads, NIXL handles); opaque to everyone else.
    private: Any = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def finish(self, state: TransferState, error: str = "") -> bool:
        """Moves a pending handle to ``state``; False if it had already finished."""
        if not state.terminal:
            raise ValueError(f"finish() needs a terminal state, got {state}")
        with self._lock:
            if self.state.terminal:
                return False
            self.state = state
            self.error = error
            self.finished = time.monotonic()
            return True

    @property
    def lock(self) -> threading.Lock:
        return self._lock

    @property
    def remaining_s(self) -> float:
        return self.deadline - time.monotonic()

    @property
    def seconds(self) -> float:
        end = self.finished if self.finished is not None else time.monotonic()
        return end - self.started

    @property
    def stats(self) -> TransferStats:
        done = self.state is TransferState.DONE
        return TransferStats(nbytes=self.nbytes if done else 0, seconds=self.seconds)


@dataclass(eq=False, kw_only=True)
class ReceiveHandle(TransferHandle):
    descriptors: ReceiveDescriptors
