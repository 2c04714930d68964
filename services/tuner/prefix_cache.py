"""One replica's prefix cache in the simulator: block ids with least-recently-used eviction."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class PrefixCache:
    """Leading blocks of a prompt that a replica still holds. A block is only useful after all
    the blocks before it (its KV was computed on top of theirs), so a match stops at the first
    miss. `capacity_blocks=None` is the unbounded oracle."""

    __slots__ = ("capacity", "_blocks")

    def __init__(self, capacity_blocks: int | None):
        if capacity_blocks is not None and capacity_blocks < 0:
            raise ValueError("capacity_blocks must be >= 0")
        self.capacity = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, block_ids: Sequence[int]) -> int:
        """How many leading blocks of `block_ids` are cached (no change to recency)."""
        blocks = self._blocks
        n = 0
        for b in block_ids:
            if b not in blocks:
                break
            n += 1
        return n

    def insert(self, block_ids: Sequence[int]) -> None:
        """The prompt's blocks were computed (or reused) here: most recent, oldest evicted.

        Inserted tail first, so that a prompt's head ends up the most recent: evicting a
        tail block loses one block, evicting a head block would strand all that follow."""
        if self.capacity == 0:
            return
        blocks = self._blocks
        for b in reversed(block_ids):
            if b in blocks:
                blocks.move_to_end(b)
            else:
                blocks[b] = None
        if self.capacity is not None:
            while len(blocks) > self.capacity:
                blocks.popitem(last=False)
