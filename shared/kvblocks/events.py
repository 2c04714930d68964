"""KV events: which block hashes entered or left which tier, in one numbered stream.

Workers publish these so the router's block-hash index knows where each prefix lives; the
index applies the same record (`shared.wire.convert` carries it over the wire).
One stream per block manager covers all its tiers; ``seq`` only ever grows, so a consumer
that sees a gap knows it missed events and must resynchronize.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

KVTier = Literal["device", "host", "disk"]
EventKind = Literal["stored", "removed"]


@dataclass(frozen=True)
class KVEvent:
    kind: EventKind
    block_hashes: tuple[int, ...]
    kv_tier: KVTier
    seq: int


class KVEventLog:
    """Numbers events, hands each to an optional sink and keeps the most recent ones."""

    def __init__(self, sink: Callable[[KVEvent], None] | None = None, history: int = 4096) -> None:
        if history <= 0:
            raise ValueError(f"event history must be positive, got {history}")
        self._sink = sink
        self._recent: deque[KVEvent] = deque(maxlen=history)
        self._last_seq = 0

    @property
    def last_seq(self) -> int:
        """Sequence number of the newest event; 0 before the first one."""
        return self._last_seq

    def emit(self, kind: EventKind, kv_tier: KVTier, block_hashes: list[int]) -> KVEvent | None:
        if not block_hashes:
            return None
        self._last_seq += 1
        event = KVEvent(
            kind=kind, block_hashes=tuple(block_hashes), kv_tier=kv_tier, seq=self._last_seq
        )
        self._recent.append(event)
        if self._sink is not None:
            self._sink(event)
        return event

    def emit_changes(self, kv_tier: KVTier, changes: list[tuple[EventKind, int]]) -> None:
        """Emit ordered (kind, hash) changes, one event per run of the same kind.

        Order matters: a hash removed and then stored again in one batch must end up stored.
        """
        run: list[int] = []
        for i, (kind, block_hash_) in enumerate(changes):
            run.append(block_hash_)
            if i + 1 == len(changes) or changes[i + 1][0] != kind:
                self.emit(kind, kv_tier, run)
                run = []

    def events_since(self, seq: int) -> list[KVEvent]:
        """Retained events with ``event.seq > seq``; older ones may have been dropped."""
        return [event for event in self._recent if event.seq > seq]
