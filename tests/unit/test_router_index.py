"""The KV index against a reference: every surviving replica's true holdings, whatever the
interleaving across replicas, lost batches (gap -> resync snapshot) and replica deaths."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from services.router.index import KVIndex, PrefixHit
from shared.kvblocks.events import KVEvent

REPLICAS = ("r0", "r1", "r2")
KV_TIERS = ("device", "host", "disk")


class TrueReplica:
    """A worker's block manager as far as events go: numbered changes to what it holds."""

    def __init__(self, name: str):
        self.name = name
        self.held: dict[int, str] = {}
        self.seq = 0
        self.outbox: list[KVEvent] = []

    def change(self, kind: str, hashes: tuple[int, ...], kv_tier: str) -> None:
        self.seq += 1
        for h in hashes:
            if kind == "stored":
                self.held[h] = kv_tier
            elif self.held.get(h) == kv_tier:
                del self.held[h]
        self.outbox.append(KVEvent(kind, hashes, kv_tier, self.seq))  # type: ignore[arg-type]

    def snapshot(self) -> list[KVEvent]:
        by_tier: dict[str, list[int]] = {}
        for h, kv_tier in sorted(self.held.items()):
            by_tier.setdefault(kv_tier, []).append(h)
        events = [KVEvent("stored", tuple(hs), t, self.seq) for t, hs in by_tier.items()]  # type: ignore[arg-type]
        return events or [KVEvent("stored", (), "device", self.seq)]


change = st.tuples(
    st.sampled_from(REPLICAS),
    st.sampled_from(("stored", "stored", "removed")),
    st.lists(st.integers(0, 12), min_size=1, max_size=3, unique=True).map(tuple),
    st.sampled_from(KV_TIERS),
)
step = st.one_of(
    st.tuples(st.just("change"), change),
    st.tuples(st.just("deliver"), st.sampled_from(REPLICAS), st.booleans()),  # bool: lost
    st.tuples(st.just("die"), st.sampled_from(REPLICAS)),
)


def run(steps) -> tuple[KVIndex, dict[str, TrueReplica]]:
    index = KVIndex()
    truth = {name: TrueReplica(name) for name in REPLICAS}
    for s in steps:
        if s[0] == "change":
            name, kind, hashes, kv_tier = s[1]
            if name in truth:
                truth[name].change(kind, hashes, kv_tier)
        elif s[0] == "deliver":
            _, name, lost = s
            if name not in truth:
                continue
            batch, truth[name].outbox = truth[name].outbox, []
            if not lost:
                result = index.apply(name, batch)
                if result.gap:  # the heartbeat asks for a resync; the worker sends a snapshot
                    index.apply(name, truth[name].snapshot(), snapshot=True)
        else:  # death: entries dropped at once; a restart registers afresh
            index.drop(s[1])
            truth[s[1]] = TrueReplica(s[1])
    # The end of the run: every replica flushes and the heartbeat catches a lost tail.
    for name, replica in truth.items():
        result = index.apply(name, replica.outbox)
        replica.outbox = []
        if result.gap or index.last_seq(name) < replica.seq:
            index.apply(name, replica.snapshot(), snapshot=True)
    return index, truth


@settings(max_examples=300, deadline=None)
@given(st.lists(step, max_size=60))
def test_index_equals_the_replicas_true_holdings(steps):
    index, truth = run(steps)
    index.check_integrity()
    for name, replica in truth.items():
        assert index.held(name) == replica.held
        assert not index.is_stale(name)
    for h in range(13):
        expected = {n: r.held[h] for n, r in truth.items() if h in r.held}
        assert index.holders(h) == expected


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(change, st.integers(0, 2)), max_size=40))
def test_interleaving_across_replicas_does_not_matter(changes):
    """Two coordinators get each replica's batches in order, interleaved differently."""
    truth = {name: TrueReplica(name) for name in REPLICAS}
    batches: dict[str, list[list[KVEvent]]] = {name: [] for name in REPLICAS}
    for (name, kind, hashes, kv_tier), cut in changes:
        truth[name].change(kind, hashes, kv_tier)
        if cut:
            batches[name].append(truth[name].outbox)
            truth[name].outbox = []
    for name in REPLICAS:
        batches[name].append(truth[name].outbox)

    def feed(order_seed: int) -> KVIndex:
        queues = {n: list(b) for n, b in batches.items()}
        index = KVIndex()
        pick = random.Random(order_seed)
        while any(queues.values()):
            name = pick.choice(sorted(n for n, q in queues.items() if q))
            index.apply(name, queues[name].pop(0))
        return index

    a, b = feed(1), feed(2)
    for name in REPLICAS:
        assert a.held(name) == b.held(name) == truth[name].held


def test_a_gap_makes_the_view_stale_until_a_snapshot():
    index = KVIndex()
    index.apply("r0", [KVEvent("stored", (1, 2), "device", 1)])
    assert index.prefix("r0", [1, 2]) == PrefixHit(device=2)
    result = index.apply("r0", [KVEvent("stored", (3,), "device", 3)])  # seq 2 was lost
    assert result.gap and index.is_stale("r0")
    assert index.prefix("r0", [1, 2]) == PrefixHit()  # never route on a view we cannot trust
    assert index.apply("r0", [KVEvent("stored", (4,), "device", 4)]).applied == 0
    index.apply("r0", [KVEvent("stored", (1, 2, 3), "host", 3)], snapshot=True)
    assert not index.is_stale("r0")
    assert index.prefix("r0", [1, 2, 3, 9]) == PrefixHit(host=3)
    index.apply("r0", [KVEvent("removed", (2,), "host", 4)])
    assert index.prefix("r0", [1, 2, 3]) == PrefixHit(host=1)


def test_duplicates_are_ignored_and_a_tier_move_keeps_the_block():
    index = KVIndex()
    index.apply("r0", [KVEvent("stored", (5,), "device", 1)])
    index.apply("r0", [KVEvent("stored", (5,), "device", 1)])  # replayed batch
    # Spilled to host: stored there, then removed from device. Only the device copy goes.
    index.apply(
        "r0",
        [KVEvent("stored", (5,), "host", 2), KVEvent("removed", (5,), "device", 3)],
    )
    assert index.holders(5) == {"r0": "host"}
    assert index.last_seq("r0") == 3
    index.drop("r0")
    assert index.holders(5) == {} and index.replicas() == []
