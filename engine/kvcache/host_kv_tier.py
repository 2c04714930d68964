"""The KV host tier: evicted device blocks parked in preallocated host memory, by block hash.

Blocks arrive here when the device reuses a cached block, and go back to the device when a
new prompt's prefix matches them. The tier is LRU within ``capacity_blocks`` slots; its own
victims spill to an optional ``DiskKVTier`` instead of being dropped. Copies are inclusive:
loading a block back to the device keeps the host copy, so spilling it again costs nothing.

A few slots can also be *reserved* for swapped-out sequences; reserved slots are outside
the LRU (never evicted) until released, and count against the same memory budget.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Literal

import torch

from engine.kvcache.disk_kv_tier import DiskKVTier
from engine.kvcache.stats import KVTierStats
from engine.kvcache.tables import KVIntegrityError
from shared.kvblocks.events import EventKind, KVEventLog

__all__ = ["DiskKVTier", "HostKVTier"]

_log = logging.getLogger(__name__)


class HostKVTier:
    def __init__(
        self,
        capacity_blocks: int,
        block_shape: Sequence[int],
        dtype: torch.dtype,
        disk: DiskKVTier | None = None,
        pin_memory: bool = False,
    ):
        if capacity_blocks <= 0:
            raise ValueError(f"host tier needs capacity_blocks > 0, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self.block_shape = tuple(block_shape)
        self.dtype = dtype
        self.disk = disk
        # Pinned memory makes device<->host copies asynchronous-capable; CPU-only hosts can't.
        # Uninitialised on purpose: a slot is read only after a block was copied into it, and
        # zeros would make the whole budget resident at start (512 MiB by default) for nothing.
        self.tensor = torch.empty(
            (capacity_blocks, *self.block_shape), dtype=dtype, pin_memory=pin_memory
        )
        self.block_bytes = self.tensor[0].numel() * self.tensor.element_size()
        self._lru: OrderedDict[int, int] = OrderedDict()  # block hash -> slot
        self._free_slots: deque[int] = deque(range(capacity_blocks))
        self._reserved: set[int] = set()
        self._events: KVEventLog | None = None
        self.stats = KVTierStats()

    def attach_events(self, events: KVEventLog) -> None:
        if self._events is not None and self._events is not events:
            raise ValueError("this host tier already reports to another block manager")
        self._events = events
        if self.disk is not None:
            self.disk.attach_events(events)

    def _emit(self, changes: list[tuple[EventKind, int]]) -> None:
        if self._events is not None:
            self._events.emit_changes("host", changes)

    @property
    def num_blocks(self) -> int:
        """Cached blocks held (reserved swap slots not included)."""
        return len(self._lru)

    @property
    def num_reserved_slots(self) -> int:
        return len(self._reserved)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._lru

    def cached_hashes(self) -> dict[str, list[int]]:
        """Every hash this tier (and its disk tier) holds, for a router resync snapshot."""
        out = {"host": list(self._lru)}
        if self.disk is not None:
            out["disk"] = self.disk.cached_hashes()
        return out

    def locate(self, block_hash: int) -> Literal["host", "disk"] | None:
        """Which tier below the device holds a block; does not count as a use."""
        if block_hash in self._lru:
            return "host"
        if self.disk is not None and block_hash in self.disk:
            return "disk"
        return None

    def _take_slot(self, changes: list[tuple[EventKind, int]]) -> int | None:
        if self._free_slots:
            return self._free_slots.popleft()
        if not self._lru:
            return None  # every slot is reserved for swapped sequences
        victim, slot = self._lru.popitem(last=False)
        self.stats.evicted_blocks += 1
        if self.disk is not None:
            try:
                self.disk.store(victim, self.tensor[slot])
                self.stats.spilled_blocks += 1
            except OSError as exc:
                # A full or failing disk must not fail the request that needed the slot;
                # the block is dropped like any cache victim.
                _log.warning("dropping KV block %#x: disk tier write failed: %s", victim, exc)
        changes.append(("removed", victim))
        return slot

    def store(self, block_hashes: Sequence[int], data: torch.Tensor) -> None:
        """Keep copies of blocks ``data[i]`` under ``block_hashes[i]``.

        A block that cannot get a slot (all reserved) is dropped: this is a cache.
        """
        if data.shape != (len(block_hashes), *self.block_shape):
            raise ValueError(
                f"host tier expects blocks of shape {self.block_shape}, got {tuple(data.shape)} "
                f"for {len(block_hashes)} hashes"
            )
        changes: list[tuple[EventKind, int]] = []
        for i, block_hash in enumerate(block_hashes):
            if block_hash in self._lru:
                self._lru.move_to_end(block_hash)
                continue
            slot = self._take_slot(changes)
            if slot is None:
                continue
            self.tensor[slot].copy_(data[i])
            self._lru[block_hash] = slot
            changes.append(("stored", block_hash))
            self.stats.stored_blocks += 1
            self.stats.bytes_written += self.block_bytes
        self._emit(changes)

    def load(self, block_hashes: Sequence[int]) -> torch.Tensor:
        """Copies ``[len(block_hashes), *block_shape]`` of blocks held here or on disk."""
        out = torch.empty((len(block_hashes), *self.block_shape), dtype=self.dtype)
        for i, block_hash in enumerate(block_hashes):
            slot = self._lru.get(block_hash)
            if slot is not None:
                out[i].copy_(self.tensor[slot])
                self._lru.move_to_end(block_hash)
                self.stats.loaded_blocks += 1
                self.stats.bytes_read += self.block_bytes
            elif self.disk is not None and block_hash in self.disk:
                self.disk.load_into(block_hash, out[i])
            else:
                raise KeyError(f"block {block_hash:#x} is in neither the host nor the disk tier")
        return out

    def reserve_slots(self, count: int) -> list[int] | None:
        """``count`` slots outside the LRU, evicting cached blocks; None (no change) if short."""
        if count > self.capacity_blocks - len(self._reserved):
            return None
        changes: list[tuple[EventKind, int]] = []
        slots = [self._take_slot(changes) for _ in range(count)]
        self._emit(changes)
        assert all(slot is not None for slot in slots)
        self._reserved.update(slots)  # type: ignore[arg-type]
        return slots  # type: ignore[return-value]

    def write_slots(self, slots: Sequence[int], data: torch.Tensor) -> None:
        self._check_reserved(slots)
        index = torch.tensor(list(slots), dtype=torch.long)
        self.tensor.index_copy_(0, index, data.to(device="cpu", dtype=self.dtype))
        self.stats.bytes_written += len(slots) * self.block_bytes

    def read_slots(self, slots: Sequence[int]) -> torch.Tensor:
        self._check_reserved(slots)
        self.stats.bytes_read += len(slots) * self.block_bytes
        return self.tensor.index_select(0, torch.tensor(list(slots), dtype=torch.long))

    def release_slots(self, slots: Sequence[int]) -> None:
        self._check_reserved(slots)
        self._reserved.difference_update(slots)
        self._free_slots.extend(slots)

    def _check_reserved(self, slots: Sequence[int]) -> None:
        if not self._reserved.issuperset(slots):
            raise KVIntegrityError(f"host slots {set(slots) - self._reserved} are not reserved")

    def check_integrity(self, expected_reserved: set[int]) -> None:
        cached = list(self._lru.values())
        free = list(self._free_slots)
        everything = cached + free + list(self._reserved)
        if sorted(everything) != list(range(self.capacity_blocks)):
            raise KVIntegrityError(
                f"host slots are not a partition: cached {cached}, free {free}, "
                f"reserved {sorted(self._reserved)}, capacity {self.capacity_blocks}"
            )
        if self._reserved != expected_reserved:
            raise KVIntegrityError(
                f"reserved host slots {sorted(self._reserved)} != slots held by swapped "
                f"sequences {sorted(expected_reserved)}"
            )
        if self.disk is not None:
            self.disk.check_integrity()
