"""Host and disk tiers: evicted blocks spill down and come back bit-identical."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.kvcache.block_manager import BlockManager
from engine.kvcache.host_kv_tier import DiskKVTier, HostKVTier
from engine.kvcache.pool import KVLayout, KVPool
from shared.kvblocks.events import KVEvent, KVEventLog
from shared.kvblocks.hashing import hash_prompt_blocks

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4)
SALT = b"test-model"


DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")),
]


def make_manager(tmp_path: Path, device=4, host=2, disk=3, where="cpu"):
    pool = KVPool(LAYOUT, device, device=where)
    kv_tier = HostKVTier(host, LAYOUT.block_shape, LAYOUT.dtype, DiskKVTier(tmp_path / "kv", disk))
    events: list[KVEvent] = []
    manager = BlockManager(device, LAYOUT.block_size, SALT, kv_tier, pool, events.append)
    return manager, pool, kv_tier, events


def run_and_free(m: BlockManager, pool: KVPool, prompt: list[int], gen: torch.Generator):
    """Prefill ``prompt`` with random KV, commit it, finish; returns {hash: block data}."""
    alloc = m.allocate(prompt)
    assert alloc is not None
    for block_id in alloc.table.block_ids[alloc.num_cached_tokens // LAYOUT.block_size :]:
        data = torch.randn((1, *LAYOUT.block_shape), generator=gen)
        pool.write_blocks([block_id], data.to(pool.tensor.device))
    m.commit_full_blocks(alloc.table, prompt)
    hashes = alloc.table.block_hashes
    blocks = alloc.table.block_ids[: len(hashes)]
    data = {h: pool.tensor[b].clone() for h, b in zip(hashes, blocks, strict=True)}
    m.free(alloc.table)
    m.check_integrity()
    return data


def replay(events: list[KVEvent]) -> dict[str, set[int]]:
    """What a router's index would believe after consuming the events."""
    index: dict[str, set[int]] = {"device": set(), "host": set(), "disk": set()}
    for e in events:
        (index[e.kv_tier].update if e.kind == "stored" else index[e.kv_tier].difference_update)(
            e.block_hashes
        )
    return index


@pytest.mark.parametrize("where", DEVICES)
def test_evicted_blocks_spill_to_host_then_disk_and_come_back_bit_identical(tmp_path, where):
    m, pool, host, events = make_manager(tmp_path, where=where)
    gen = torch.Generator().manual_seed(0)
    prompts = [list(range(100 * k, 100 * k + 9)) for k in range(1, 5)]  # 2 full blocks each
    expected: dict[int, torch.Tensor] = {}
    for prompt in prompts:
        expected |= run_and_free(m, pool, prompt, gen)
    h = [hash_prompt_blocks(p, LAYOUT.block_size, SALT) for p in prompts]

    # Device holds 4 blocks, host 2, disk 3; LRU with a prefix's tail evicted first.
    assert [m.match_prefix(p).kv_tiers for p in prompts] == [
        ("disk", "disk"),
        ("host", "disk"),
        ("device", "host"),
        ("device", "device"),
    ]
    assert replay(events) == {
        "device": {h[2][0], h[3][1], h[3][0]},
        "host": {h[1][0], h[2][1]},
        "disk": {h[0][1], h[0][0], h[1][1]},
    }
    block_bytes = LAYOUT.block_bytes
    assert m.stats.spilled_blocks == 5 and host.stats.stored_blocks == 5
    assert host.stats.bytes_written == 5 * block_bytes
    assert host.stats.spilled_blocks == 3 and host.disk.stats.stored_blocks == 3
    assert host.disk.stats.bytes_written == 3 * block_bytes

    # Prompt 2's first block is on the host, its second on disk.
    alloc = m.allocate(prompts[1] + [7])
    assert alloc is not None and alloc.num_cached_tokens == 8
    assert (alloc.prefix.num_host_blocks, alloc.prefix.num_disk_blocks) == (1, 1)
    for i in range(2):
        assert torch.equal(pool.tensor[alloc.table.block_ids[i]], expected[h[1][i]])
    assert (m.stats.host_hit_blocks, m.stats.disk_hit_blocks) == (1, 1)
    assert host.stats.loaded_blocks == 1 and host.stats.bytes_read == block_bytes
    assert host.disk.stats.loaded_blocks == 1 and host.disk.stats.bytes_read == block_bytes
    # Brought-back blocks are registered on the device again, and the router hears of it.
    assert m.match_prefix(prompts[1]).kv_tiers == ("device", "device")
    index = replay(events)
    assert {h[1][0], h[1][1]} <= index["device"]
    assert index["device"] == set(m._device._hash_to_block)
    assert index["host"] == set(host._lru) and index["disk"] == set(host.disk._lru)
    m.check_integrity()

    # Capacities hold, and the disk directory holds exactly the indexed blocks.
    assert host.num_blocks <= 2 and host.disk.num_blocks == 3
    files = sorted(p.name for p in (tmp_path / "kv").iterdir())
    assert len(files) == 3 and all(name.endswith(".kv") for name in files)

    # Evicting again and coming back once more still yields the original bytes.
    m.free(alloc.table)
    for prompt in prompts[2:]:
        run_and_free(m, pool, prompt + [1], gen)
    again = m.allocate(prompts[1] + [8])
    assert again is not None and again.num_cached_tokens == 8
    for i in range(2):
        assert torch.equal(pool.tensor[again.table.block_ids[i]], expected[h[1][i]])
    m.check_integrity()


def test_event_sequence_numbers_increase_and_are_retained(tmp_path):
    m, pool, _, events = make_manager(tmp_path)
    gen = torch.Generator().manual_seed(1)
    for k in range(4):
        run_and_free(m, pool, list(range(10 * k, 10 * k + 9)), gen)
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert m.events.last_seq == len(events)
    assert m.events.events_since(2) == events[2:]
    assert {e.kv_tier for e in events} == {"device", "host", "disk"}


def test_event_log_keeps_order_within_a_batch():
    log = KVEventLog(history=2)
    log.emit_changes("host", [("stored", 1), ("stored", 2), ("removed", 1), ("stored", 1)])
    assert [(e.kind, e.block_hashes) for e in log.events_since(0)] == [
        ("removed", (1,)),
        ("stored", (1,)),
    ]  # history=2 dropped the first of the three events
    assert log.last_seq == 3


@pytest.mark.parametrize("where", DEVICES)
def test_swap_out_and_in_keeps_the_partial_block(tmp_path, where):
    m, pool, host, _ = make_manager(tmp_path, device=4, host=3, disk=2, where=where)
    gen = torch.Generator().manual_seed(2)
    tokens = list(range(10))  # two full blocks + a partial one
    alloc = m.allocate(tokens)
    assert alloc is not None
    pool.tensor.copy_(torch.randn(pool.tensor.shape, generator=gen))  # copy_ crosses devices
    m.commit_full_blocks(alloc.table, tokens)
    before = pool.read_blocks(alloc.table.block_ids)
    hashes = list(alloc.table.block_hashes)

    swapped = m.swap_out(alloc.table)
    assert swapped is not None and host.num_reserved_slots == 3
    assert m.usage == 0.0
    m.check_integrity()
    # Fill the device with something else so nothing of the old sequence stays there.
    other = m.allocate(list(range(500, 516)))
    assert other is not None
    pool.tensor.zero_()
    assert m.swap_in(swapped) is None  # no room: still swapped, nothing changed
    m.check_integrity()
    m.free(other.table)

    table = m.swap_in(swapped)
    assert table is not None and table.num_tokens == 10
    assert table.block_hashes == hashes and len(hashes) == 2
    assert torch.equal(pool.read_blocks(table.block_ids), before)
    assert host.num_reserved_slots == 0
    m.check_integrity()
    with pytest.raises(ValueError):
        m.swap_in(swapped)


def test_swap_in_shares_committed_blocks_still_on_device(tmp_path):
    m, pool, host, _ = make_manager(tmp_path, device=6, host=3, disk=2)
    tokens = list(range(10))
    alloc = m.allocate(tokens)
    assert alloc is not None
    m.commit_full_blocks(alloc.table, tokens)
    ids = list(alloc.table.block_ids)
    swapped = m.swap_out(alloc.table)
    assert swapped is not None and m.num_cached_blocks == 2
    table = m.swap_in(swapped)
    assert table is not None and table.block_ids[:2] == ids[:2]
    m.check_integrity()


def test_swap_out_refuses_when_host_cannot_reserve(tmp_path):
    m, _, host, _ = make_manager(tmp_path, device=4, host=2, disk=2)
    alloc = m.allocate(list(range(10)))  # three blocks, host has two slots
    assert alloc is not None
    assert m.swap_out(alloc.table) is None
    assert host.num_reserved_slots == 0 and len(alloc.table.block_ids) == 3
    m.check_integrity()


def test_host_tier_drops_blocks_when_every_slot_is_reserved():
    host = HostKVTier(2, LAYOUT.block_shape, LAYOUT.dtype)
    data = torch.randn((2, *LAYOUT.block_shape))
    host.store([1, 2], data)
    slots = host.reserve_slots(2)
    assert slots is not None and host.num_blocks == 0  # cached blocks gave way (no disk)
    assert host.stats.evicted_blocks == 2 and host.stats.spilled_blocks == 0
    host.store([3], data[:1])
    assert 3 not in host and host.locate(3) is None
    assert host.reserve_slots(1) is None
    host.release_slots(slots)
    host.store([3], data[:1])
    assert torch.equal(host.load([3])[0], data[0])
    host.check_integrity(set())
    with pytest.raises(KeyError):
        host.load([4])


def test_a_failing_disk_drops_blocks_instead_of_failing(tmp_path, monkeypatch):
    disk = DiskKVTier(tmp_path / "kv", capacity_blocks=4)
    host = HostKVTier(1, LAYOUT.block_shape, LAYOUT.dtype, disk)
    data = torch.randn((2, *LAYOUT.block_shape))

    def disk_full(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("engine.kvcache.disk_kv_tier.os.replace", disk_full)
    host.store([1, 2], data)  # storing 2 evicts 1, whose spill to disk fails
    assert host.locate(1) is None and host.locate(2) == "host"
    assert host.stats.evicted_blocks == 1 and host.stats.spilled_blocks == 0
    assert list((tmp_path / "kv").iterdir()) == []  # no half-written leftovers
    host.check_integrity(set())


def test_disk_tier_round_trips_bf16_and_evicts_lru(tmp_path):
    directory = tmp_path / "disk"
    directory.mkdir()
    (directory / "00000000000000ff.kv").write_bytes(b"left over by an earlier process")
    (directory / "notes.txt").write_text("not ours")
    disk = DiskKVTier(directory, capacity_blocks=2)
    assert sorted(p.name for p in directory.iterdir()) == ["notes.txt"]

    shape = (2, 3, 5)
    blocks = {h: torch.randn(shape).to(torch.bfloat16) for h in (10, 11, 12)}
    disk.store(10, blocks[10])
    disk.store(11, blocks[11])
    out = torch.empty(shape, dtype=torch.bfloat16)
    disk.load_into(10, out)  # 10 becomes most recently used
    assert torch.equal(out, blocks[10])
    disk.store(12, blocks[12])
    assert 11 not in disk and 10 in disk and 12 in disk
    assert disk.stats.bytes_written == 3 * blocks[10].numel() * 2
    assert disk.stats.evicted_blocks == 1
    assert not any(p.name.endswith(".tmp") for p in directory.iterdir())
    disk.check_integrity()
    with pytest.raises(KeyError):
        disk.load_into(11, out)


def test_incompatible_tiers_are_refused(tmp_path):
    pool = KVPool(LAYOUT, 4)
    wrong = HostKVTier(2, (1, 2, 4, 2, 4), LAYOUT.dtype)
    with pytest.raises(ValueError, match="do not match"):
        BlockManager(4, LAYOUT.block_size, host_kv_tier=wrong, pool=pool)
    with pytest.raises(ValueError, match="needs the KV pool"):
        BlockManager(
            4, LAYOUT.block_size, host_kv_tier=HostKVTier(2, LAYOUT.block_shape, LAYOUT.dtype)
        )
    with pytest.raises(ValueError, match="blocks of"):
        BlockManager(8, LAYOUT.block_size, pool=pool)
