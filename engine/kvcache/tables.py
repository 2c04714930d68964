"""What the block manager hands to its callers: block tables, prefix matches, allocations."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.kvblocks.events import KVTier


class KVIntegrityError(AssertionError):
    """A block-manager invariant is broken; only a bug can cause this."""


# A table position whose block went back because no layer's window reaches it any more.
RELEASED = -1


@dataclass(eq=False)
class BlockTable:
    """One sequence's blocks. Owned by the manager's bookkeeping: read it, never mutate it.

    ``num_tokens`` is the length the sequence has declared (allocate / append_slots /
    truncate); ``block_hashes`` are the chained hashes of its committed full blocks, i.e.
    the leading blocks whose KV is written and known to the prefix cache.
    """

    table_id: int
    block_size: int
    block_ids: list[int]
    num_tokens: int
    block_hashes: list[int] = field(default_factory=list)
    # Leading positions released (`RELEASED` in block_ids): only in models where every layer
    # slides, once the window has moved past them. Always committed blocks.
    num_released: int = 0

    @property
    def live_block_ids(self) -> list[int]:
        return self.block_ids[self.num_released :]

    def attention_block_ids(self) -> list[int]:
        """block_ids for an attention kernel: released positions point at a live block, whose
        keys there the window masks out anyway (a kernel needs a valid index everywhere)."""
        if not self.num_released:
            return self.block_ids
        live = self.block_ids[self.num_released :]
        return [live[0]] * self.num_released + live

    @property
    def capacity(self) -> int:
        """Tokens the allocated blocks can hold (num_tokens plus any lookahead slack)."""
        return len(self.block_ids) * self.block_size

    def check_shape(self) -> None:
        """Invariants of the table alone (the manager checks it against the blocks)."""
        if self.capacity < self.num_tokens:
            raise KVIntegrityError(f"{self}: capacity below num_tokens")
        if len(self.block_hashes) > self.num_tokens // self.block_size:
            raise KVIntegrityError(f"{self}: more committed blocks than full blocks")
        live = self.live_block_ids
        if len(set(live)) != len(live) or RELEASED in live:
            raise KVIntegrityError(f"{self}: a block appears twice")
        if any(b != RELEASED for b in self.block_ids[: self.num_released]):
            raise KVIntegrityError(f"{self}: a released position still names a block")
        if self.num_released > len(self.block_hashes) or (live == [] and self.num_released):
            raise KVIntegrityError(f"{self}: released blocks must be committed, one kept live")

    def slot(self, position: int) -> tuple[int, int]:
        """(block id, offset in block) where the KV of token ``position`` lives."""
        if not 0 <= position < self.capacity:
            raise IndexError(f"position {position} outside capacity {self.capacity}")
        return self.block_ids[position // self.block_size], position % self.block_size


@dataclass(frozen=True)
class PrefixMatch:
    """Leading full blocks of a prompt found in some tier, in prompt order."""

    block_size: int
    block_hashes: tuple[int, ...]
    kv_tiers: tuple[KVTier, ...]

    @property
    def num_blocks(self) -> int:
        return len(self.kv_tiers)

    @property
    def num_tokens(self) -> int:
        return len(self.kv_tiers) * self.block_size

    @property
    def num_device_blocks(self) -> int:
        return self.kv_tiers.count("device")

    @property
    def num_host_blocks(self) -> int:
        return self.kv_tiers.count("host")

    @property
    def num_disk_blocks(self) -> int:
        return self.kv_tiers.count("disk")

    def head(self, num_blocks: int) -> PrefixMatch:
        return PrefixMatch(
            self.block_size, self.block_hashes[:num_blocks], self.kv_tiers[:num_blocks]
        )


@dataclass(frozen=True)
class Allocation:
    """A new sequence's table and the part of its prompt that is already computed."""

    table: BlockTable
    prefix: PrefixMatch

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens whose KV is in place; a multiple of block_size, < prompt length."""
        return self.prefix.num_tokens


@dataclass(frozen=True)
class SwappedBlocks:
    """A preempted sequence's whole KV (partial last block included) parked in host slots."""

    swap_id: int
    host_slots: tuple[int, ...]  # one per live block, from position num_released on
    num_tokens: int
    block_hashes: tuple[int, ...]
    num_released: int = 0
