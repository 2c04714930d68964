"""Device block bookkeeping: ref counts, the free list, and the LRU cache of idle blocks.

Every block is in exactly one state:

- free: no references, no hash, in ``_free``;
- cached: no references but a registered hash, in ``_idle`` (LRU order), reusable by hash
  and evicted only when a free block is needed;
- referenced: held by at least one block table; may or may not carry a hash.

A hash maps to at most one block. A full block whose hash is already registered elsewhere
(two sequences computed the same prefix concurrently) simply stays unregistered and goes
back to the free list when released.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from itertools import islice

from engine.kvcache.tables import KVIntegrityError
from shared.kvblocks.events import KVEventLog

# Called with (hashes, block ids) of cached blocks about to be reused, before their data
# is overwritten, so a lower tier can keep a copy.
SpillFn = Callable[[list[int], list[int]], None]


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    last_access: int = 0


class DeviceBlocks:
    def __init__(self, num_blocks: int, events: KVEventLog, spill: SpillFn | None = None):
        if num_blocks <= 0:
            raise ValueError(f"need at least one KV block, got num_blocks={num_blocks}")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))
        self._idle: OrderedDict[int, None] = OrderedDict()
        self._hash_to_block: dict[int, int] = {}
        self._events = events
        self._spill = spill
        self._tick = 0
        self.evicted_blocks = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._idle)

    @property
    def num_available(self) -> int:
        """Blocks that can be handed out now, evicting cached ones if needed."""
        return len(self._free) + len(self._idle)

    def cached_hashes(self) -> list[int]:
        return list(self._hash_to_block)

    def lookup(self, block_hash: int) -> int | None:
        return self._hash_to_block.get(block_hash)

    def ref_count(self, block_id: int) -> int:
        return self.blocks[block_id].ref_count

    def _hash_of(self, block_id: int) -> int:
        block_hash = self.blocks[block_id].hash
        if block_hash is None:
            raise KVIntegrityError(f"cached block {block_id} has no hash")
        return block_hash

    def _touch(self, block: Block) -> None:
        self._tick += 1
        block.last_access = self._tick

    def acquire_cached(self, block_id: int) -> None:
        """Add a reference to a block found by hash (idle or already shared)."""
        block = self.blocks[block_id]
        if block.hash is None:
            raise KVIntegrityError(f"block {block_id} is not registered; cannot share it")
        if block.ref_count == 0:
            del self._idle[block_id]
        block.ref_count += 1
        self._touch(block)

    def acquire_fresh(self, count: int) -> list[int]:
        """``count`` unregistered blocks with one reference each; caller checked availability."""
        if count > self.num_available:
            raise KVIntegrityError(f"asked for {count} blocks, only {self.num_available} available")
        # Victims are chosen before anything changes: if spilling raises, they stay cached.
        victims = list(islice(self._idle, max(0, count - len(self._free))))
        if victims:
            hashes = [self._hash_of(b) for b in victims]
            if self._spill is not None:
                self._spill(hashes, victims)
            for block_id, block_hash in zip(victims, hashes, strict=True):
                del self._idle[block_id]
                del self._hash_to_block[block_hash]
                self.blocks[block_id].hash = None
            self.evicted_blocks += len(victims)
            self._events.emit("removed", "device", hashes)
        taken = [self._free.popleft() for _ in range(count - len(victims))]
        for block_id in taken + victims:
            block = self.blocks[block_id]
            block.ref_count = 1
            self._touch(block)
        return taken + victims

    def release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise KVIntegrityError(f"releasing block {block_id} with ref_count {block.ref_count}")
        block.ref_count -= 1
        if block.ref_count > 0:
            return
        self._touch(block)
        if block.hash is None:
            self._free.append(block_id)
        else:
            self._idle[block_id] = None

    def register(self, entries: list[tuple[int, int]]) -> list[int]:
        """Register (block id, hash) pairs of referenced full blocks; returns hashes stored.

        A hash already registered to another block is skipped: that block already serves it.
        """
        stored: list[int] = []
        for block_id, block_hash in entries:
            block = self.blocks[block_id]
            if block.ref_count <= 0 or block.hash is not None:
                raise KVIntegrityError(
                    f"registering block {block_id} (ref_count={block.ref_count}, "
                    f"hash={block.hash}); only referenced unregistered blocks can be"
                )
            if block_hash in self._hash_to_block:
                continue
            block.hash = block_hash
            self._hash_to_block[block_hash] = block_id
            stored.append(block_hash)
        self._events.emit("stored", "device", stored)
        return stored

    def unregister(self, block_id: int) -> None:
        """Drop the hash of a block its only holder is about to overwrite."""
        block = self.blocks[block_id]
        if block.ref_count != 1 or block.hash is None:
            raise KVIntegrityError(
                f"unregistering block {block_id} (ref_count={block.ref_count}, hash={block.hash})"
            )
        del self._hash_to_block[block.hash]
        self._events.emit("removed", "device", [block.hash])
        block.hash = None

    def check_integrity(self, expected_refs: Counter[int]) -> None:
        n = len(self.blocks)
        unknown = set(expected_refs) - set(range(n))
        if unknown:
            raise KVIntegrityError(f"tables hold unknown block ids {sorted(unknown)}")
        free, idle = list(self._free), list(self._idle)
        if len(set(free)) != len(free):
            raise KVIntegrityError(f"free list has duplicates: {free}")
        if set(free) & set(idle):
            raise KVIntegrityError(f"blocks both free and cached: {set(free) & set(idle)}")
        last_tick = -1
        for block_id in idle:
            if self.blocks[block_id].last_access < last_tick:
                raise KVIntegrityError(f"cached block {block_id} is out of LRU order: {idle}")
            last_tick = self.blocks[block_id].last_access
        free_set, idle_set = set(free), set(idle)
        for block in self.blocks:
            where = f"block {block}"
            if block.ref_count != expected_refs.get(block.block_id, 0):
                raise KVIntegrityError(
                    f"{where}: ref_count != {expected_refs.get(block.block_id, 0)} live holders"
                )
            in_free, in_idle = block.block_id in free_set, block.block_id in idle_set
            if block.ref_count > 0 and (in_free or in_idle):
                raise KVIntegrityError(f"{where} is referenced but on the free/cached list")
            if block.ref_count == 0 and block.hash is None and not in_free:
                raise KVIntegrityError(f"{where} is unreferenced and unhashed but not free")
            if block.ref_count == 0 and block.hash is not None and not in_idle:
                raise KVIntegrityError(f"{where} is unreferenced and hashed but not cached")
            if block.hash is not None and self._hash_to_block.get(block.hash) != block.block_id:
                raise KVIntegrityError(f"{where} has a hash the hash map does not point back to")
        for block_hash, block_id in self._hash_to_block.items():
            if self.blocks[block_id].hash != block_hash:
                raise KVIntegrityError(f"hash map {block_hash:#x} -> {block_id} is stale")
