"""The KV disk tier: KV blocks the host tier had to let go of, one file per block hash.

Each block is written to a temporary name and renamed into place, so a reader never sees a
half-written block. The index lives in memory only: files left by an earlier process are
removed at start, because nothing records the layout, dtype or model they were written for.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path

import torch

from engine.kvcache.stats import KVTierStats
from engine.kvcache.tables import KVIntegrityError
from shared.kvblocks.events import KVEventLog

_SUFFIX = ".kv"


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (works for dtypes numpy lacks, e.g. bf16)."""
    return tensor.reshape(-1).view(torch.uint8)


class DiskKVTier:
    def __init__(self, directory: str | os.PathLike[str], capacity_blocks: int):
        if capacity_blocks <= 0:
            raise ValueError(f"disk tier needs capacity_blocks > 0, got {capacity_blocks}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        for stale in self.directory.iterdir():
            if stale.suffix == _SUFFIX or stale.name.endswith(_SUFFIX + ".tmp"):
                stale.unlink()
        self.capacity_blocks = capacity_blocks
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._events: KVEventLog | None = None
        self.stats = KVTierStats()

    def cached_hashes(self) -> list[int]:
        return list(self._lru)

    def attach_events(self, events: KVEventLog) -> None:
        self._events = events

    def _path(self, block_hash: int) -> Path:
        return self.directory / f"{block_hash:016x}{_SUFFIX}"

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._lru

    @property
    def num_blocks(self) -> int:
        return len(self._lru)

    def store(self, block_hash: int, data: torch.Tensor) -> None:
        """Keep a copy of one block's data, evicting the least recently used file if full."""
        if block_hash in self._lru:
            self._lru.move_to_end(block_hash)
            return
        if len(self._lru) >= self.capacity_blocks:
            victim, _ = self._lru.popitem(last=False)
            self._path(victim).unlink()
            self.stats.evicted_blocks += 1
            if self._events is not None:
                self._events.emit("removed", "disk", [victim])
        path = self._path(block_hash)
        tmp = path.with_name(path.name + ".tmp")
        payload = _as_bytes(data.detach().to("cpu").contiguous()).numpy()
        # No fsync: this is a cache for this process's lifetime; atomic rename is what
        # readers rely on, durability across a crash is not needed.
        try:
            with open(tmp, "wb") as f:
                f.write(memoryview(payload))
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        self._lru[block_hash] = None
        self.stats.stored_blocks += 1
        self.stats.bytes_written += payload.nbytes
        if self._events is not None:
            self._events.emit("stored", "disk", [block_hash])

    def load_into(self, block_hash: int, out: torch.Tensor) -> None:
        """Read one block into ``out`` (a contiguous CPU tensor of the block's shape)."""
        if block_hash not in self._lru:
            raise KeyError(f"block {block_hash:#x} is not on disk")
        target = _as_bytes(out).numpy()
        with open(self._path(block_hash), "rb") as f:
            read = f.readinto(memoryview(target))
            trailing = f.read(1)
        if read != target.nbytes or trailing:
            raise KVIntegrityError(
                f"disk block {block_hash:#x} does not hold {target.nbytes} bytes (read {read})"
            )
        self._lru.move_to_end(block_hash)
        self.stats.loaded_blocks += 1
        self.stats.bytes_read += target.nbytes

    def check_integrity(self) -> None:
        if len(self._lru) > self.capacity_blocks:
            raise KVIntegrityError(
                f"disk tier holds {len(self._lru)} blocks, capacity {self.capacity_blocks}"
            )
        on_disk = {p.name for p in self.directory.iterdir() if p.suffix == _SUFFIX}
        indexed = {self._path(h).name for h in self._lru}
        if on_disk != indexed:
            raise KVIntegrityError(
                f"disk files and index differ: unindexed {sorted(on_disk - indexed)}, "
                f"missing {sorted(indexed - on_disk)}"
            )
