"""Block manager: prefix reuse, LRU eviction, rollback, and a stateful invariant test."""

from __future__ import annotations

import shutil
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.kvcache.block_manager import BlockManager
from engine.kvcache.host_kv_tier import DiskKVTier, HostKVTier
from engine.kvcache.pool import KVLayout, KVPool
from engine.kvcache.tables import BlockTable, KVIntegrityError, SwappedBlocks
from shared.kvblocks.events import KVEvent
from shared.kvblocks.hashing import block_hash, hash_prompt_blocks

BS = 4


def snapshot(m: BlockManager) -> tuple:
    """Everything an operation that reports failure must leave untouched."""
    dev = m._device
    state: tuple = (
        list(dev._free),
        list(dev._idle),
        dict(dev._hash_to_block),
        [(b.ref_count, b.hash, b.last_access) for b in dev.blocks],
        m.events.last_seq,
        {i: (list(t.block_ids), t.num_tokens, list(t.block_hashes)) for i, t in m._tables.items()},
    )
    if m.host_kv_tier is not None:
        host = m.host_kv_tier
        state += (list(host._lru.items()), list(host._free_slots), set(host._reserved))
        if host.disk is not None:
            state += (list(host.disk._lru),)
    return state


def removed_on_device(events: list[KVEvent]) -> list[int]:
    return [
        h for e in events if e.kind == "removed" and e.kv_tier == "device" for h in e.block_hashes
    ]


# -- hashing ---------------------------------------------------------------------------------


def test_block_hash_is_a_stable_digest_not_pythons_hash():
    # Golden values: the router and every worker process must compute the same numbers.
    first = block_hash(None, [1, 2, 3, 4], b"smollm2")
    assert first == 7538413165617186023
    assert block_hash(first, [5, 6, 7, 8], b"smollm2") == 14946527031891136177
    assert hash_prompt_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, b"smollm2") == [
        7538413165617186023,
        14946527031891136177,
    ]


def test_block_hash_depends_on_parent_tokens_and_salt():
    base = block_hash(None, [1, 2, 3, 4], b"m")
    assert block_hash(None, [1, 2, 3, 4], b"other-model") != base
    assert block_hash(None, [1, 2, 3, 5], b"m") != base
    assert block_hash(base, [1, 2, 3, 4], b"m") != base
    # Same block after different prefixes must differ: that is what makes the chain a prefix key.
    assert (
        hash_prompt_blocks([9, 9, 9, 9, 1, 2, 3, 4], 4, b"m")[1]
        != (hash_prompt_blocks([8, 9, 9, 9, 1, 2, 3, 4], 4, b"m")[1])
    )
    assert hash_prompt_blocks([1, 2, 3], 4, b"m") == []


# -- prefix reuse ----------------------------------------------------------------------------


def test_sequences_sharing_a_three_block_prefix_share_block_ids():
    m = BlockManager(num_blocks=16, block_size=BS)
    prompt_a = list(range(14))
    a = m.allocate(prompt_a)
    assert a is not None and a.num_cached_tokens == 0
    assert m.commit_full_blocks(a.table, prompt_a) == hash_prompt_blocks(prompt_a, BS, b"")
    b = m.allocate(prompt_a[:12] + [77, 78, 79])
    assert b is not None
    assert b.num_cached_tokens == 12 and b.prefix.num_device_blocks == 3
    assert b.table.block_ids[:3] == a.table.block_ids[:3]
    assert b.table.block_ids[3] not in a.table.block_ids
    assert [m.ref_count(i) for i in a.table.block_ids[:3]] == [2, 2, 2]
    assert m.ref_count(a.table.block_ids[3]) == 1
    assert m.stats.device_hit_blocks == 3
    m.check_integrity()
    m.free(a.table)
    assert [m.ref_count(i) for i in b.table.block_ids[:3]] == [1, 1, 1]
    m.free(b.table)
    assert m.num_cached_blocks == 3 and m.usage == 0.0
    m.check_integrity()


def test_fully_cached_prompt_still_computes_its_last_block():
    m = BlockManager(num_blocks=8, block_size=BS)
    prompt = list(range(8))
    first = m.allocate(prompt)
    assert first is not None
    m.commit_full_blocks(first.table, prompt)
    again = m.allocate(prompt)
    assert again is not None
    # Both blocks are cached, but the last prompt token's logits are needed.
    assert again.num_cached_tokens == 4 < len(prompt)
    longer = m.allocate(prompt + [8])
    assert longer is not None and longer.num_cached_tokens == 8
    assert m.match_prefix(prompt).num_device_blocks == 2
    m.check_integrity()


def test_match_prefix_changes_nothing():
    m = BlockManager(num_blocks=4, block_size=BS)
    a = m.allocate(list(range(9)))
    assert a is not None
    m.commit_full_blocks(a.table, list(range(9)))
    before = snapshot(m)
    match = m.match_prefix(list(range(12)))
    assert match.num_blocks == 2 and match.num_tokens == 8 and match.kv_tiers == ("device",) * 2
    assert snapshot(m) == before


def test_lookahead_reserves_capacity():
    m = BlockManager(num_blocks=8, block_size=BS)
    a = m.allocate([1, 2, 3, 4, 5], num_lookahead_tokens=4)
    assert a is not None
    assert len(a.table.block_ids) == 3 and a.table.num_tokens == 5 and a.table.capacity == 12
    free_before = m.num_free_blocks
    assert m.append_slots(a.table, 9)
    assert m.num_free_blocks == free_before and a.table.num_tokens == 9


# -- eviction --------------------------------------------------------------------------------


def test_cached_blocks_are_evicted_least_recently_used_tail_first():
    events: list[KVEvent] = []
    m = BlockManager(num_blocks=8, block_size=BS, event_sink=events.append)
    prompts = {name: list(range(base, base + 9)) for name, base in (("a", 0), ("b", 100))}
    hashes = {name: hash_prompt_blocks(p, BS, b"") for name, p in prompts.items()}
    for name in ("a", "b"):
        alloc = m.allocate(prompts[name])
        assert alloc is not None
        m.commit_full_blocks(alloc.table, prompts[name])
        m.free(alloc.table)
    # Reusing "a" makes it more recent than "b".
    again = m.allocate(prompts["a"])
    assert again is not None and again.prefix.num_device_blocks == 2
    m.free(again.table)
    assert m.num_cached_blocks == 4 and m.num_free_blocks == 4

    big = m.allocate(list(range(1000, 1024)))  # six blocks: four free, two evicted
    assert big is not None
    assert removed_on_device(events) == [hashes["b"][1], hashes["b"][0]]
    assert m.match_prefix(prompts["b"]).num_blocks == 0
    assert m.match_prefix(prompts["a"]).num_blocks == 2

    small = m.allocate([5000])
    assert small is not None
    # Within a prefix the tail goes first, so what stays is still a usable prefix.
    assert removed_on_device(events)[2:] == [hashes["a"][1]]
    assert m.match_prefix(prompts["a"]).num_blocks == 1
    m.check_integrity()


def test_allocate_returns_none_without_changing_state():
    m = BlockManager(num_blocks=4, block_size=BS)
    a = m.allocate(list(range(9)))
    assert a is not None
    m.commit_full_blocks(a.table, list(range(9)))
    m.free(a.table)
    b = m.allocate([50, 51, 52, 53, 54])
    assert b is not None
    before = snapshot(m)
    # Needs 4 blocks; 2 are held by b, the cached ones would be hit and count once only.
    assert m.allocate(list(range(8)) + [9, 9, 9, 9, 9]) is None
    assert m.allocate([7] * 13) is None
    assert not m.can_allocate(3) and m.can_allocate(2)
    assert snapshot(m) == before
    assert not m.append_slots(b.table, 17)
    assert snapshot(m) == before
    m.check_integrity()


# -- rollback --------------------------------------------------------------------------------


def test_truncate_releases_blocks_and_unregisters_a_reopened_private_block():
    events: list[KVEvent] = []
    m = BlockManager(num_blocks=8, block_size=BS, event_sink=events.append)
    tokens = list(range(10))
    a = m.allocate(tokens)
    assert a is not None
    hashes = m.commit_full_blocks(a.table, tokens)
    assert m.append_slots(a.table, 16) and len(a.table.block_ids) == 4
    free_before = m.num_free_blocks
    assert m.truncate(a.table, 9)
    assert len(a.table.block_ids) == 3 and m.num_free_blocks == free_before + 1
    assert a.table.block_hashes == hashes
    assert m.truncate(a.table, 6)  # block 1 becomes partial: the sequence will rewrite it
    assert a.table.block_hashes == hashes[:1] and len(a.table.block_ids) == 2
    assert removed_on_device(events) == [hashes[1]]
    assert m.match_prefix(tokens).num_blocks == 1
    m.check_integrity()
    assert m.truncate(a.table, 0) and a.table.block_ids == []
    m.check_integrity()


def test_truncate_into_a_shared_block_copies_it_first():
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=2, block_size=BS)
    pool = KVPool(layout, 8)
    pool.tensor.copy_(torch.randn(pool.tensor.shape))
    m = BlockManager(num_blocks=8, block_size=BS, pool=pool)
    tokens = list(range(13))
    a = m.allocate(tokens)
    assert a is not None
    m.commit_full_blocks(a.table, tokens)
    b = m.allocate(tokens[:12] + [99])
    assert b is not None and b.table.block_ids[:3] == a.table.block_ids[:3]
    shared = a.table.block_ids[1]
    assert m.truncate(b.table, 6)
    private = b.table.block_ids[1]
    assert private != shared and m.ref_count(shared) == 1 and m.ref_count(private) == 1
    assert torch.equal(pool.tensor[private], pool.tensor[shared])
    assert m.ref_count(a.table.block_ids[2]) == 1  # b released its share of block 2
    assert m.match_prefix(tokens).num_blocks == 3  # a's registered blocks are untouched
    m.check_integrity()


def test_truncate_needing_a_copy_fails_cleanly_when_no_block_is_free():
    m = BlockManager(num_blocks=5, block_size=BS)
    tokens = list(range(13))
    a = m.allocate(tokens)
    assert a is not None
    m.commit_full_blocks(a.table, tokens)
    b = m.allocate(tokens[:12] + [99])
    assert b is not None and m.truncate(b.table, 12)
    assert m.allocate([1]) is not None and m.num_available_blocks == 0
    before = snapshot(m)
    assert not m.truncate(b.table, 10)
    assert snapshot(m) == before
    m.check_integrity()


def test_misuse_is_refused():
    m = BlockManager(num_blocks=4, block_size=BS)
    a = m.allocate([1, 2, 3])
    assert a is not None
    with pytest.raises(ValueError):
        m.allocate([])
    with pytest.raises(ValueError):
        m.append_slots(a.table, 2)
    with pytest.raises(ValueError):
        m.commit_full_blocks(a.table, [1, 2, 3, 4])
    m.free(a.table)
    with pytest.raises(ValueError):
        m.free(a.table)
    foreign = BlockTable(table_id=a.table.table_id, block_size=BS, block_ids=[0], num_tokens=1)
    with pytest.raises(ValueError):
        m.append_slots(foreign, 2)


def test_check_integrity_reports_corruption():
    m = BlockManager(num_blocks=4, block_size=BS)
    a = m.allocate(list(range(5)))
    assert a is not None
    m.commit_full_blocks(a.table, list(range(5)))
    m.check_integrity()
    m._device.blocks[a.table.block_ids[0]].ref_count += 1
    with pytest.raises(KVIntegrityError, match="ref_count"):
        m.check_integrity()
    m._device.blocks[a.table.block_ids[0]].ref_count -= 1
    m._device._free.append(a.table.block_ids[1])
    with pytest.raises(KVIntegrityError, match="free"):
        m.check_integrity()
    m._device._free.pop()
    m._device.blocks[a.table.block_ids[1]].hash = 12345
    with pytest.raises(KVIntegrityError, match="hash"):
        m.check_integrity()


# -- stateful: random operations against a small pool with host and disk tiers --------------

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, block_size=BS)
TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=18)


def fingerprints(tokens: list[int]) -> list[float]:
    """Stand-in KV: each position's value depends on the whole prefix up to it, like real KV."""
    out, fp = [], 0
    for tok in tokens:
        fp = (fp * 31 + tok + 1) % 1_000_003  # exact in float32
        out.append(float(fp))
    return out


class KVCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.directory = tempfile.mkdtemp(prefix="kvdisk-")
        self.pool = KVPool(LAYOUT, 6)
        host = HostKVTier(4, LAYOUT.block_shape, LAYOUT.dtype, DiskKVTier(self.directory, 6))
        self.events: list[KVEvent] = []
        self.m = BlockManager(6, BS, b"t", host, self.pool, self.events.append)
        self.live: list[tuple[BlockTable, list[int]]] = []
        self.swapped: list[tuple[SwappedBlocks, list[int]]] = []
        self.history: list[list[int]] = []  # every sequence seen, to come back to later

    def teardown(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)

    def _write(self, table: BlockTable, tokens: list[int], start: int) -> None:
        values = fingerprints(tokens)
        for pos in range(start, len(tokens)):
            block, offset = table.slot(pos)
            self.pool.tensor[block, :, :, offset] = values[pos]

    def _check_data(self, table: BlockTable, tokens: list[int], upto: int) -> None:
        values = fingerprints(tokens)
        for pos in range(upto):
            block, offset = table.slot(pos)
            got = self.pool.tensor[block, :, :, offset]
            assert torch.all(got == values[pos]), (table, pos, got, values[pos])

    def _allocate(self, prompt: list[int], lookahead: int, commit: bool) -> None:
        before = snapshot(self.m)
        alloc = self.m.allocate(prompt, lookahead)
        if alloc is None:
            assert snapshot(self.m) == before
            return
        assert alloc.num_cached_tokens % BS == 0 and alloc.num_cached_tokens < len(prompt)
        self._check_data(alloc.table, prompt, alloc.num_cached_tokens)  # reused KV is right
        self._write(alloc.table, prompt, alloc.num_cached_tokens)
        if commit:
            self.m.commit_full_blocks(alloc.table, prompt)
        self.live.append((alloc.table, prompt))
        self.history.append(prompt)

    @precondition(lambda self: len(self.live) < 3)
    @rule(prompt=TOKENS, lookahead=st.integers(0, 3), commit=st.booleans())
    def allocate(self, prompt, lookahead, commit):
        self._allocate(prompt, lookahead, commit)

    @precondition(lambda self: 0 < len(self.live) < 3)
    @rule(data=st.data(), suffix=TOKENS, commit=st.booleans())
    def share_prefix(self, data, suffix, commit):
        _, tokens = data.draw(st.sampled_from(self.live))
        keep = data.draw(st.integers(0, len(tokens)))
        self._allocate(tokens[:keep] + suffix, 0, commit)

    @precondition(lambda self: self.history and len(self.live) < 3)
    @rule(data=st.data(), suffix=st.lists(st.integers(0, 2), max_size=3))
    def return_to_old_conversation(self, data, suffix):
        """Old prefixes are the ones that have been pushed down to the host and disk tiers."""
        tokens = data.draw(st.sampled_from(self.history[:3]))  # the oldest are the coldest
        self._allocate(tokens + suffix if suffix else tokens, 0, True)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), new=st.lists(st.integers(0, 2), min_size=1, max_size=6))
    def append(self, data, new):
        i = data.draw(st.integers(0, len(self.live) - 1))
        table, tokens = self.live[i]
        before = snapshot(self.m)
        if not self.m.append_slots(table, len(tokens) + len(new)):
            assert snapshot(self.m) == before
            return
        self.live[i] = (table, tokens + new)
        self._write(table, tokens + new, len(tokens))
        self.history.append(tokens + new)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def commit(self, data):
        table, tokens = data.draw(st.sampled_from(self.live))
        self.m.commit_full_blocks(table, tokens[: data.draw(st.integers(0, len(tokens)))])

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def truncate(self, data):
        i = data.draw(st.integers(0, len(self.live) - 1))
        table, tokens = self.live[i]
        keep = data.draw(st.integers(0, len(tokens)))
        before = snapshot(self.m)
        if self.m.truncate(table, keep):
            self.live[i] = (table, tokens[:keep])
        else:
            assert snapshot(self.m) == before

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        table, _ = self.live.pop(data.draw(st.integers(0, len(self.live) - 1)))
        self.m.free(table)

    @precondition(lambda self: self.live and len(self.swapped) < 2)
    @rule(data=st.data())
    def swap_out(self, data):
        i = data.draw(st.integers(0, len(self.live) - 1))
        table, tokens = self.live[i]
        swapped = self.m.swap_out(table)
        if swapped is not None:
            self.live.pop(i)
            self.swapped.append((swapped, tokens))

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        i = data.draw(st.integers(0, len(self.swapped) - 1))
        swapped, tokens = self.swapped[i]
        table = self.m.swap_in(swapped)
        if table is not None:
            self.swapped.pop(i)
            self._check_data(table, tokens, len(tokens))
            self.live.append((table, tokens))

    @invariant()
    def integrity_holds(self):
        self.m.check_integrity()

    @invariant()
    def live_kv_is_intact(self):
        for table, tokens in self.live:
            assert table.num_tokens == len(tokens)
            self._check_data(table, tokens, len(tokens))

    @invariant()
    def events_describe_every_tier(self):
        assert [e.seq for e in self.events] == list(range(1, len(self.events) + 1))
        index: dict[str, set[int]] = {"device": set(), "host": set(), "disk": set()}
        for e in self.events:
            if e.kind == "stored":
                index[e.kv_tier].update(e.block_hashes)
            else:
                index[e.kv_tier].difference_update(e.block_hashes)
        host = self.m.host_kv_tier
        assert host is not None and host.disk is not None
        assert index["device"] == set(self.m._device._hash_to_block)
        assert index["host"] == set(host._lru)
        assert index["disk"] == set(host.disk._lru)


KVCacheMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_block_manager_state_machine = KVCacheMachine.TestCase
