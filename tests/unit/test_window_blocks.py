"""Blocks behind a sliding window: released early, still reusable, and handled by every
operation that walks a table (truncate, free, swap out/in, integrity)."""

from __future__ import annotations

import pytest
import torch

from engine.kvcache.block_manager import BlockManager
from engine.kvcache.host_kv_tier import HostKVTier
from engine.kvcache.pool import KVLayout, KVPool
from engine.kvcache.tables import RELEASED
from shared.kvblocks.events import KVEvent

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4)


def _manager(window: int | None, device: int = 8, host: int = 8):
    pool = KVPool(LAYOUT, device)
    kv_tier = HostKVTier(host, LAYOUT.block_shape, LAYOUT.dtype)
    events: list[KVEvent] = []
    manager = BlockManager(device, 4, b"salt", kv_tier, pool, events.append, window_tokens=window)
    return manager, pool, events


def test_release_keeps_what_the_window_reaches_and_the_blocks_stay_cached():
    m, _, events = _manager(window=6)
    tokens = list(range(22))  # 5 full blocks + 2 tokens
    alloc = m.allocate(tokens)
    assert alloc is not None
    m.commit_full_blocks(alloc.table, tokens)
    table = alloc.table
    before = list(table.block_ids)
    # The next query, at 22, sees keys 17..21: blocks 0..3 (tokens 0..15) are behind it.
    assert m.release_outside_window(table, 22) == 4
    assert table.num_released == 4 and table.block_ids[:4] == [RELEASED] * 4
    assert table.live_block_ids == before[4:]
    assert table.attention_block_ids() == [before[4]] * 4 + before[4:]
    assert m.release_outside_window(table, 22) == 0  # idempotent
    m.check_integrity()
    # Released blocks went back to the cache: no "removed" event, and a new prompt with
    # the same prefix reuses all of them.
    assert not [e for e in events if e.kind == "removed"]
    assert m.num_cached_blocks == 4
    again = m.allocate(tokens[:17])
    assert again is not None and again.num_cached_tokens == 16
    m.free(again.table)
    with pytest.raises(ValueError, match="released"):
        m.truncate(table, 15)
    assert m.truncate(table, 20)
    m.free(table)
    m.check_integrity()
    assert m.num_available_blocks == m.num_blocks


def test_without_a_window_nothing_is_released():
    m, _, _ = _manager(window=None)
    tokens = list(range(22))
    alloc = m.allocate(tokens)
    assert alloc is not None
    m.commit_full_blocks(alloc.table, tokens)
    assert m.release_outside_window(alloc.table, 22) == 0
    assert alloc.table.num_released == 0


def test_uncommitted_and_last_live_blocks_are_never_released():
    m, _, _ = _manager(window=1)
    tokens = list(range(12))
    alloc = m.allocate(tokens)
    assert alloc is not None
    m.commit_full_blocks(alloc.table, tokens[:4])  # only block 0 is committed
    assert m.release_outside_window(alloc.table, 12) == 1
    m.commit_full_blocks(alloc.table, tokens)
    # Blocks 1 and 2 are committed now; window 1 at position 12 would drop all three, but
    # the last live block stays (released positions are indexed through it).
    assert m.release_outside_window(alloc.table, 12) == 1
    assert len(alloc.table.live_block_ids) == 1
    m.check_integrity()


def test_swap_round_trip_keeps_released_positions_released():
    m, pool, _ = _manager(window=6)
    gen = torch.Generator().manual_seed(0)
    tokens = list(range(22))
    alloc = m.allocate(tokens)
    assert alloc is not None
    pool.tensor.copy_(torch.randn(pool.tensor.shape, generator=gen))
    m.commit_full_blocks(alloc.table, tokens)
    m.release_outside_window(alloc.table, 22)
    live = pool.read_blocks(alloc.table.live_block_ids)
    swapped = m.swap_out(alloc.table)
    assert swapped is not None and len(swapped.host_slots) == 2
    m.check_integrity()
    pool.tensor.zero_()
    # Evict the cached copies too, so swap-in must copy back from the host slots.
    filler = m.allocate(list(range(100, 132)))
    assert filler is not None
    m.free(filler.table)
    table = m.swap_in(swapped)
    assert table is not None and table.num_released == 4 and table.num_tokens == 22
    assert table.block_ids[:4] == [RELEASED] * 4
    assert torch.equal(pool.read_blocks(table.live_block_ids), live)
    m.check_integrity()
    m.free(table)
    m.check_integrity()
