"""The KV index: which replica holds which block hash, in which tier, from the workers' events.

Each replica's events carry a sequence number that grows by one per event. A batch that
skips a number means events were lost in flight: that replica's view is no longer
trustworthy, so its entries are dropped and it is marked stale until it sends a snapshot
(the worker is told to through its heartbeat). A stale replica is scored as holding nothing,
which costs a cache hit at worst and never routes on a prefix it may have evicted.

Everything here is a function of each replica's own event stream, never of how streams from
different replicas interleave, so coordinators fed the same events hold the same index.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from shared.kvblocks.events import KVEvent, KVTier


@dataclass(frozen=True)
class PrefixHit:
    """Leading blocks of a prompt a replica holds, counted by the tier each one is in."""

    device: int = 0
    host: int = 0
    disk: int = 0

    @property
    def blocks(self) -> int:
        return self.device + self.host + self.disk


@dataclass
class ReplicaView:
    held: dict[int, KVTier] = field(default_factory=dict)
    last_seq: int = 0
    stale: bool = False  # a gap was seen; waiting for a snapshot


@dataclass(frozen=True)
class ApplyResult:
    applied: int  # events taken
    gap: bool  # this batch revealed lost events; the replica needs a snapshot


class KVIndex:
    def __init__(self) -> None:
        self._replicas: dict[str, ReplicaView] = {}
        self._holders: dict[int, dict[str, KVTier]] = {}

    # -- feeding ---------------------------------------------------------------------------

    def apply(self, replica: str, events: Iterable[KVEvent], snapshot: bool = False) -> ApplyResult:
        """Take one batch of a replica's events, in the order it emitted them.

        A snapshot replaces everything known about the replica; its events all carry the
        sequence number the snapshot was taken at, and later events continue from there.
        """
        events = list(events)
        if snapshot:
            self.drop(replica)
            view = self._replicas.setdefault(replica, ReplicaView())
            for e in events:
                if e.kind == "stored":
                    self._store(replica, view, e)
                else:
                    self._remove(replica, view, e)
            view.last_seq = max((e.seq for e in events), default=view.last_seq)
            return ApplyResult(len(events), gap=False)
        view = self._replicas.setdefault(replica, ReplicaView())
        applied = 0
        for e in events:
            if view.stale:
                break
            if e.seq <= view.last_seq:
                continue  # already covered (by an earlier batch or a snapshot)
            if e.seq != view.last_seq + 1:
                self._mark_stale(replica, view)
                return ApplyResult(applied, gap=True)
            if e.kind == "stored":
                self._store(replica, view, e)
            else:
                self._remove(replica, view, e)
            view.last_seq = e.seq
            applied += 1
        return ApplyResult(applied, gap=view.stale)

    def drop(self, replica: str) -> None:
        """Forget a replica at once (it died, or a snapshot replaces its view)."""
        view = self._replicas.pop(replica, None)
        if view is None:
            return
        for h in view.held:
            holders = self._holders.get(h)
            if holders is not None:
                holders.pop(replica, None)
                if not holders:
                    del self._holders[h]

    def _store(self, replica: str, view: ReplicaView, e: KVEvent) -> None:
        for h in e.block_hashes:
            view.held[h] = e.kv_tier
            self._holders.setdefault(h, {})[replica] = e.kv_tier

    def _remove(self, replica: str, view: ReplicaView, e: KVEvent) -> None:
        # A block moving device -> host is "stored host" then "removed device" (or the other
        # way round): only a removal from the tier we have it in forgets it.
        for h in e.block_hashes:
            if view.held.get(h) != e.kv_tier:
                continue
            del view.held[h]
            holders = self._holders[h]
            del holders[replica]
            if not holders:
                del self._holders[h]

    def _mark_stale(self, replica: str, view: ReplicaView) -> None:
        last = view.last_seq
        self.drop(replica)
        self._replicas[replica] = ReplicaView(last_seq=last, stale=True)

    # -- reading ---------------------------------------------------------------------------

    def last_seq(self, replica: str) -> int:
        view = self._replicas.get(replica)
        return view.last_seq if view else 0

    def is_stale(self, replica: str) -> bool:
        view = self._replicas.get(replica)
        return view is not None and view.stale

    def replicas(self) -> list[str]:
        return sorted(self._replicas)

    def held(self, replica: str) -> dict[int, KVTier]:
        view = self._replicas.get(replica)
        return dict(view.held) if view else {}

    def num_held(self, replica: str) -> int:
        view = self._replicas.get(replica)
        return len(view.held) if view else 0

    def holders(self, block_hash: int) -> dict[str, KVTier]:
        return dict(self._holders.get(block_hash, {}))

    def prefix(self, replica: str, block_hashes: Sequence[int]) -> PrefixHit:
        """The prompt's leading blocks this replica holds: a block's KV was computed on top of
        the blocks before it, so the count stops at the first one it lacks."""
        view = self._replicas.get(replica)
        if view is None or view.stale:
            return PrefixHit()
        counts = {"device": 0, "host": 0, "disk": 0}
        for h in block_hashes:
            kv_tier = view.held.get(h)
            if kv_tier is None:
                break
            counts[kv_tier] += 1
        return PrefixHit(**counts)

    def check_integrity(self) -> None:
        """The per-hash map is exactly the inverse of the per-replica maps."""
        inverse: dict[int, dict[str, KVTier]] = {}
        for replica, view in self._replicas.items():
            if view.stale and view.held:
                raise AssertionError(f"stale replica {replica} still holds {len(view.held)}")
            for h, kv_tier in view.held.items():
                inverse.setdefault(h, {})[replica] = kv_tier
        if inverse != self._holders:
            raise AssertionError("KV index: hash -> holders disagrees with the replicas' views")
