"""KV a prefill replica pushes into this decode replica, from the blocks reserved for it to
the Decode call that continues the request.

The coordinator opens Decode the moment the first token arrives, while the prefill replica
is still pushing, so a Decode call may come before the PrepareReceive, while the blocks are
being written, or after the KV landed. Whichever comes first creates the request's entry:

    expected ──PrepareReceive──▶ receiving ──done──▶ landed ──the Decode call takes it
       │                            │ failed, timed out, aborted
       └──── no receive coming ───▶ lost ◀──┘

A Decode call waits on its entry: for a PrepareReceive at most the push's deadline, for a
receive until it ends (the control plane's watcher bounds every receive by its deadline).
It gets the blocks, or None: prefill locally. A call that stops waiting (deadline, its RPC
cancelled) or a request the coordinator aborts leaves the entry `abandoned`: KV landing
later is freed at once and a late PrepareReceive is refused. Every reserved table leaves
through exactly one of: the Decode call taking it, or `free` — and a receiving table only
once the control plane says the receive is over, so nothing still writes into freed blocks.

Only the worker's event loop touches this (gRPC handlers, the control plane's watchers and
the expiry loop all run there), so there are no locks. It lives beside the runtime every role
shares (which owns it), not in services.worker.decode: the prefill role imports the runtime, and the
two roles never import each other.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.kvcache.tables import BlockTable

# KV that landed is kept this long for its Decode call; then its blocks go back.
PARKED_KV_TTL_S = 30.0
# How long an ended request (lost, abandoned) is remembered, so that its late pieces (a
# Decode call after a failed transfer, a PrepareReceive after the Decode call gave up) are
# answered at once instead of waiting or reserving blocks nobody will use.
TOMBSTONE_TTL_S = 60.0


class Stage(enum.Enum):
    EXPECTED = "expected"  # a Decode call waits; no PrepareReceive yet
    RECEIVING = "receiving"  # blocks reserved, the data plane is writing them
    LANDED = "landed"  # the KV is complete, waiting for (or being handed to) its Decode call
    LOST = "lost"  # no KV will come: the Decode call prefills locally
    ABANDONED = "abandoned"  # nobody wants the KV any more


@dataclass
class _Entry:
    stage: Stage
    expires_at: float
    table: BlockTable | None = None  # RECEIVING, LANDED, or ABANDONED while still receiving
    reason: str = ""
    waiters: int = 0
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def move(self, stage: Stage, expires_at: float, reason: str = "") -> None:
        self.stage = stage
        self.expires_at = expires_at
        self.reason = reason or self.reason
        # A fresh event per change: every waiter wakes once and looks at the new stage.
        changed, self.changed = self.changed, asyncio.Event()
        changed.set()


class KVArrivals:
    def __init__(
        self,
        free: Callable[[BlockTable], None],
        *,
        parked_ttl_s: float = PARKED_KV_TTL_S,
        tombstone_ttl_s: float = TOMBSTONE_TTL_S,
    ):
        """``free`` gives a table's blocks back to the engine (thread-safe, never blocks)."""
        self._free = free
        self.parked_ttl_s = parked_ttl_s
        self.tombstone_ttl_s = tombstone_ttl_s
        self._entries: dict[str, _Entry] = {}

    # ------------------------------------------------------------ the control plane

    def receiving(self, request_id: str, table: BlockTable) -> bool:
        """PrepareReceive reserved ``table``. False: nobody wants this KV (the Decode call
        gave up, the sender or the coordinator aborted, a duplicate); the caller still owns
        the table and must free it and refuse the receive."""
        entry = self._entries.get(request_id)
        if entry is None:
            self._entries[request_id] = _Entry(Stage.RECEIVING, float("inf"), table)
            return True
        if entry.stage is not Stage.EXPECTED:
            return False
        entry.table = table
        entry.move(Stage.RECEIVING, float("inf"))
        return True

    def landed(self, request_id: str) -> None:
        """The receive ended DONE: the KV is complete in the table ``receiving`` got."""
        entry = self._entries.get(request_id)
        if entry is None or entry.table is None:
            return
        if entry.stage is Stage.ABANDONED:
            self._drop_table(entry)
            return
        entry.move(Stage.LANDED, self._now() + self.parked_ttl_s)

    def receive_failed(self, request_id: str, reason: str) -> None:
        """The receive ended without the KV (failed, timed out, aborted); the data plane is
        fenced, so the blocks can go back."""
        entry = self._entries.get(request_id)
        if entry is None or entry.table is None:
            return
        self._drop_table(entry)
        if entry.stage is not Stage.ABANDONED:
            entry.move(Stage.LOST, self._now() + self.tombstone_ttl_s, reason)

    def never_coming(self, request_id: str, reason: str) -> None:
        """No receive will come for the request (the sender gave up before PrepareReceive,
        or it was refused): a waiting Decode call stops waiting, a later one does not start.
        A receive already in flight is left to end through the control plane."""
        entry = self._entries.get(request_id)
        if entry is None:
            self._entries[request_id] = _Entry(
                Stage.LOST, self._now() + self.tombstone_ttl_s, reason=reason
            )
        elif entry.stage is Stage.EXPECTED:
            entry.move(Stage.LOST, self._now() + self.tombstone_ttl_s, reason)

    # ------------------------------------------------------------ the Decode call

    async def take(self, request_id: str, wait_s: float) -> BlockTable | None:
        """The request's pushed KV, once it has landed; None when it will not (prefill
        locally). Waits for a PrepareReceive at most ``wait_s``, for a receive until it ends.
        The caller owns the table it gets."""
        entry = self._entries.get(request_id)
        if entry is None:
            entry = _Entry(Stage.EXPECTED, float("inf"))
            self._entries[request_id] = entry
        deadline = self._now() + wait_s
        entry.waiters += 1
        try:
            while entry.stage in (Stage.EXPECTED, Stage.RECEIVING):
                changed = entry.changed
                if entry.stage is Stage.RECEIVING:
                    await changed.wait()
                    continue
                try:
                    await asyncio.wait_for(changed.wait(), max(0.0, deadline - self._now()))
                except TimeoutError:
                    if entry.stage is Stage.EXPECTED:
                        self._abandon(entry, "no PrepareReceive within the deadline")
        except asyncio.CancelledError:
            self._abandon(entry, "the Decode call was cancelled")
            raise
        finally:
            entry.waiters -= 1
        if entry.stage is not Stage.LANDED or self._entries.get(request_id) is not entry:
            return None
        del self._entries[request_id]
        table, entry.table = entry.table, None
        return table

    # ------------------------------------------------------------ the worker

    def cancel(self, request_id: str) -> None:
        """The coordinator aborted the request: landed KV goes back now, KV still arriving
        as soon as its receive ends; a waiting Decode call wakes with nothing."""
        entry = self._entries.get(request_id)
        if entry is not None:
            self._abandon(entry, "cancelled")

    def expire(self) -> list[str]:
        """Frees landed KV whose Decode call never came and forgets old tombstones; returns
        the request ids whose KV was dropped."""
        now = self._now()
        dropped = []
        for request_id, entry in list(self._entries.items()):
            if entry.expires_at >= now or entry.waiters:
                continue
            if entry.stage is Stage.LANDED:
                self._drop_table(entry)
                entry.move(Stage.LOST, now + self.tombstone_ttl_s, "no Decode call came in time")
                dropped.append(request_id)
            elif entry.stage in (Stage.LOST, Stage.ABANDONED) and entry.table is None:
                del self._entries[request_id]
        return dropped

    def close(self) -> None:
        """The worker stops: landed KV goes back (receives are ended by the control plane)."""
        for entry in self._entries.values():
            if entry.stage is Stage.LANDED:
                self._drop_table(entry)
                entry.move(Stage.LOST, 0.0, "the worker stopped")

    # ------------------------------------------------------------ inspection

    def stage(self, request_id: str) -> Stage | None:
        entry = self._entries.get(request_id)
        return entry.stage if entry is not None else None

    def waiting(self, request_id: str) -> int:
        """Decode calls waiting for the request's KV now."""
        entry = self._entries.get(request_id)
        return entry.waiters if entry is not None else 0

    def count(self, stage: Stage) -> int:
        return sum(1 for e in self._entries.values() if e.stage is stage)

    @property
    def num_parked(self) -> int:
        return self.count(Stage.LANDED)

    # ------------------------------------------------------------ helpers

    def _abandon(self, entry: _Entry, reason: str) -> None:
        if entry.stage is Stage.LANDED:
            self._drop_table(entry)
        if entry.stage is not Stage.ABANDONED:
            entry.move(Stage.ABANDONED, self._now() + self.tombstone_ttl_s, reason)

    def _drop_table(self, entry: _Entry) -> None:
        table, entry.table = entry.table, None
        if table is not None:
            self._free(table)

    @staticmethod
    def _now() -> float:
        return time.monotonic()
