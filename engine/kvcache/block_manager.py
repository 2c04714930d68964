"""The paged KV cache's block manager: block tables, prefix reuse, and the tier hierarchy.

Sequences get blocks through :class:`BlockTable` objects; full blocks whose KV is written
are *committed* (registered under their chained hash) so later prompts with the same prefix
reuse them. Unreferenced committed blocks stay cached on the device and are evicted LRU only
when a block is needed; an evicted block's data is first copied to the host tier (which in
turn spills to disk), and a prompt whose prefix lives there gets it copied back.

Rules worth knowing:

- A registered block is never written again. ``truncate`` that cuts into a committed block
  either unregisters it (only this sequence holds it) or copies it into a private block
  first (it is shared) — copy-on-write.
- Every operation that can run out of blocks checks first and returns ``None``/``False``
  without changing anything.
- ``num_cached_tokens`` of an allocation is always below the prompt length: the engine
  needs the last prompt token's logits, so a fully cached prompt recomputes its last block.
- With a ``window_tokens`` (a model whose every layer attends a sliding window), a table's
  leading committed blocks that no future query can see are released early
  (``release_outside_window``): back to the cache, still registered and reusable. Prefix
  reuse still needs every block from the first one (the router's rule too, so the two
  agree); a hybrid model (some global layers) passes no window and keeps every block.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

import torch

from engine.kvcache.device_blocks import DeviceBlocks
from engine.kvcache.host_kv_tier import HostKVTier
from engine.kvcache.pool import KVPool
from engine.kvcache.stats import PrefixCacheStats
from engine.kvcache.swap import SwapSpace
from engine.kvcache.tables import (
    RELEASED,
    Allocation,
    BlockTable,
    KVIntegrityError,
    PrefixMatch,
    SwappedBlocks,
)
from shared.kvblocks.events import KVEvent, KVEventLog, KVTier
from shared.kvblocks.hashing import block_hash, hash_prompt_blocks


def _blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        salt: bytes = b"",
        host_kv_tier: HostKVTier | None = None,
        pool: KVPool | None = None,
        event_sink: Callable[[KVEvent], None] | None = None,
        event_history: int = 4096,
        window_tokens: int | None = None,
    ):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if pool is not None and (
            pool.num_blocks != num_blocks or pool.layout.block_size != block_size
        ):
            raise ValueError(
                f"KV pool has {pool.num_blocks} blocks of {pool.layout.block_size} tokens, "
                f"block manager wants {num_blocks} of {block_size}"
            )
        if host_kv_tier is not None:
            if pool is None:
                raise ValueError("a host tier needs the KV pool to copy block data through")
            if (host_kv_tier.block_shape, host_kv_tier.dtype) != (
                pool.layout.block_shape,
                pool.layout.dtype,
            ):
                raise ValueError(
                    f"host tier blocks {host_kv_tier.block_shape}/{host_kv_tier.dtype} "
                    "do not match "
                    f"the pool's {pool.layout.block_shape}/{pool.layout.dtype}"
                )
        if window_tokens is not None and window_tokens <= 0:
            raise ValueError(f"window_tokens must be positive, got {window_tokens}")
        self.block_size = block_size
        self.window_tokens = window_tokens
        self.salt = salt
        self.pool = pool
        self.host_kv_tier = host_kv_tier
        self.events = KVEventLog(event_sink, event_history)
        if host_kv_tier is not None:
            host_kv_tier.attach_events(self.events)
        self.stats = PrefixCacheStats()
        self._device = DeviceBlocks(num_blocks, self.events, self._spill if host_kv_tier else None)
        self._tables: dict[int, BlockTable] = {}
        self._swap = SwapSpace(host_kv_tier) if host_kv_tier is not None else None
        self._next_id = 0

    # -- capacity ------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return len(self._device.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks holding nothing."""
        return self._device.num_free

    @property
    def num_cached_blocks(self) -> int:
        """Unreferenced blocks kept for prefix reuse; reclaimable on demand."""
        return self._device.num_cached

    @property
    def num_available_blocks(self) -> int:
        return self._device.num_available

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by live sequences (cached blocks are reclaimable)."""
        return 1.0 - self._device.num_available / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._device.ref_count(block_id)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self._device.num_available

    def blocks_needed(self, num_tokens: int) -> int:
        return _blocks_for(num_tokens, self.block_size)

    # -- prefix lookup -------------------------------------------------------------------

    def _locate(self, block_hash_: int) -> KVTier | None:
        if self._device.lookup(block_hash_) is not None:
            return "device"
        return self.host_kv_tier.locate(block_hash_) if self.host_kv_tier is not None else None

    def _match(self, token_ids: Sequence[int], max_blocks: int) -> PrefixMatch:
        prefix = token_ids[: max_blocks * self.block_size]
        hashes: list[int] = []
        kv_tiers: list[KVTier] = []
        for h in hash_prompt_blocks(prefix, self.block_size, self.salt):
            kv_tier = self._locate(h)
            if kv_tier is None:
                break
            hashes.append(h)
            kv_tiers.append(kv_tier)
        return PrefixMatch(self.block_size, tuple(hashes), tuple(kv_tiers))

    def cached_hashes(self) -> dict[str, list[int]]:
        """Every block hash held per tier: what a router rebuilds its index from on resync."""
        out = {"device": self._device.cached_hashes(), "host": [], "disk": []}
        if self.host_kv_tier is not None:
            out.update(self.host_kv_tier.cached_hashes())
        return out

    def match_prefix(self, token_ids: Sequence[int]) -> PrefixMatch:
        """Leading full blocks of ``token_ids`` cached in any tier; changes nothing."""
        return self._match(token_ids, len(token_ids) // self.block_size)

    # -- sequence lifecycle --------------------------------------------------------------

    def allocate(
        self,
        token_ids: Sequence[int],
        num_lookahead_tokens: int = 0,
        max_reused_tokens: int | None = None,
    ) -> Allocation | None:
        """Blocks for a new sequence, reusing its cached prefix (at most `max_reused_tokens`
        of it, when given); None (no change) if short."""
        if len(token_ids) == 0:
            raise ValueError("cannot allocate a sequence with no tokens")
        if num_lookahead_tokens < 0:
            raise ValueError(f"num_lookahead_tokens must be >= 0, got {num_lookahead_tokens}")
        max_blocks = (len(token_ids) - 1) // self.block_size
        if max_reused_tokens is not None:
            max_blocks = min(max_blocks, max(0, max_reused_tokens) // self.block_size)
        match = self._match(token_ids, max_blocks)
        total = _blocks_for(len(token_ids) + num_lookahead_tokens, self.block_size)
        hits = {
            i: block_id
            for i, (h, kv_tier) in enumerate(zip(match.block_hashes, match.kv_tiers, strict=True))
            if kv_tier == "device" and (block_id := self._device.lookup(h)) is not None
        }
        if not self._can_take(total, hits):
            return None
        lower = [i for i, kv_tier in enumerate(match.kv_tiers) if kv_tier != "device"]
        # Read lower-tier data before taking blocks: evicting device blocks spills into the
        # host tier, which may push these very entries down to disk or out.
        data = self.host_kv_tier.load([match.block_hashes[i] for i in lower]) if lower else None
        block_ids = self._take(total, hits)
        if data is not None:
            self._fill(block_ids, lower, data, match.block_hashes)
        table = BlockTable(
            self._new_id(), self.block_size, block_ids, len(token_ids), list(match.block_hashes)
        )
        self._tables[table.table_id] = table
        self.stats.lookup_blocks += len(token_ids) // self.block_size
        self.stats.device_hit_blocks += match.num_device_blocks
        self.stats.host_hit_blocks += match.num_host_blocks
        self.stats.disk_hit_blocks += match.num_disk_blocks
        return Allocation(table, match)

    def allocate_fresh(self, num_tokens: int) -> BlockTable | None:
        """Private, unhashed blocks for KV that arrives from elsewhere (a prefill replica);
        None (no change) if short. Commit them once the KV has landed."""
        if num_tokens <= 0:
            raise ValueError(f"allocate_fresh needs num_tokens > 0, got {num_tokens}")
        total = _blocks_for(num_tokens, self.block_size)
        if total > self._device.num_available:
            return None
        table = BlockTable(
            self._new_id(), self.block_size, self._device.acquire_fresh(total), num_tokens, []
        )
        self._tables[table.table_id] = table
        return table

    def append_slots(self, table: BlockTable, new_num_tokens: int) -> bool:
        """Grow ``table`` to hold ``new_num_tokens``; False (no change) if blocks are short."""
        self._check_live(table)
        if new_num_tokens < table.num_tokens:
            raise ValueError(
                f"append_slots to {new_num_tokens} < current {table.num_tokens}; use truncate"
            )
        needed = _blocks_for(new_num_tokens, self.block_size) - len(table.block_ids)
        if needed > self._device.num_available:
            return False
        if needed > 0:
            table.block_ids.extend(self._device.acquire_fresh(needed))
        table.num_tokens = new_num_tokens
        return True

    def release_outside_window(self, table: BlockTable, next_position: int) -> int:
        """Release the leading committed blocks that no query at `next_position` or later
        can see (all keys older than the window); returns how many went back."""
        self._check_live(table)
        if self.window_tokens is None:
            return 0
        first_visible = max(0, next_position - self.window_tokens + 1) // self.block_size
        # Committed blocks only (their KV is final and content-addressed), and never the last
        # live one: the attention kernels index released positions through it.
        end = min(first_visible, len(table.block_hashes), len(table.block_ids) - 1)
        released = 0
        for i in range(table.num_released, end):
            self._device.release(table.block_ids[i])
            table.block_ids[i] = RELEASED
            released += 1
        table.num_released = max(table.num_released, end)
        return released

    def commit_full_blocks(self, table: BlockTable, token_ids: Sequence[int]) -> list[int]:
        """Register the full blocks of ``token_ids`` (KV already written) for reuse.

        ``token_ids`` is the sequence's whole token list so far (at most ``num_tokens``).
        Returns the hashes newly registered on the device.
        """
        self._check_live(table)
        if len(token_ids) > table.num_tokens:
            raise ValueError(f"committing {len(token_ids)} tokens > num_tokens {table.num_tokens}")
        parent = table.block_hashes[-1] if table.block_hashes else None
        entries: list[tuple[int, int]] = []
        for i in range(len(table.block_hashes), len(token_ids) // self.block_size):
            parent = block_hash(
                parent, token_ids[i * self.block_size : (i + 1) * self.block_size], self.salt
            )
            table.block_hashes.append(parent)
            block = self._device.blocks[table.block_ids[i]]
            if block.hash is not None:
                raise KVIntegrityError(
                    f"table {table.table_id}: uncommitted block {block.block_id} at index {i} "
                    f"is already registered as {block.hash:#x}"
                )
            entries.append((block.block_id, parent))
        return self._device.register(entries)

    def truncate(self, table: BlockTable, num_tokens: int) -> bool:
        """Roll ``table`` back to ``num_tokens``, releasing blocks past it.

        If the new last block is partial and was committed, the sequence will overwrite it:
        held only here, it loses its registration; shared, it is replaced by a private copy
        (which needs one free block: False, with no change, if there is none).
        """
        self._check_live(table)
        if not 0 <= num_tokens <= table.num_tokens:
            raise ValueError(f"truncate to {num_tokens} outside [0, {table.num_tokens}]")
        if num_tokens // self.block_size < table.num_released:
            raise ValueError(f"truncate to {num_tokens} cuts into released blocks")
        keep_blocks = _blocks_for(num_tokens, self.block_size)
        keep_full = num_tokens // self.block_size
        released = table.block_ids[keep_blocks:]
        reopened = (
            table.block_ids[keep_full]
            if keep_full < keep_blocks and keep_full < len(table.block_hashes)
            else None
        )
        copy_on_write = reopened is not None and self._device.ref_count(reopened) > 1
        if copy_on_write:
            freed_here = sum(1 for b in released if self._device.ref_count(b) == 1)
            if self._device.num_available + freed_here < 1:
                return False
        for block_id in reversed(released):
            self._device.release(block_id)
        del table.block_ids[keep_blocks:]
        if reopened is not None and copy_on_write:
            (private,) = self._device.acquire_fresh(1)
            if self.pool is not None:
                self.pool.write_blocks([private], self.pool.read_blocks([reopened]))
            self._device.release(reopened)
            table.block_ids[keep_full] = private
        elif reopened is not None and self._device.blocks[reopened].hash is not None:
            self._device.unregister(reopened)
        del table.block_hashes[keep_full:]
        table.num_tokens = num_tokens
        return True

    def free(self, table: BlockTable) -> None:
        """Release a finished sequence; its committed blocks stay cached for reuse."""
        self._check_live(table)
        # Last block first, so the LRU evicts a prefix's tail before its head.
        for block_id in reversed(table.live_block_ids):
            self._device.release(block_id)
        del self._tables[table.table_id]
        table.block_ids.clear()
        table.block_hashes.clear()
        table.num_tokens = 0

    # -- preemption by swapping ----------------------------------------------------------

    def swap_out(self, table: BlockTable) -> SwappedBlocks | None:
        """Copy all of ``table``'s blocks to host swap space and free it; None if no room."""
        self._check_live(table)
        if self._swap is None or self.pool is None:
            raise ValueError("swap_out needs a host tier and a KV pool")
        data = self.pool.read_blocks(table.live_block_ids)
        swapped = self._swap.park(
            self._new_id(), data, table.num_tokens, table.block_hashes, table.num_released
        )
        if swapped is not None:
            self.free(table)
        return swapped

    def swap_in(self, swapped: SwappedBlocks) -> BlockTable | None:
        """Bring a swapped sequence back; None (it stays swapped) if blocks are short.

        Committed blocks still cached on the device are shared instead of copied.
        """
        if self._swap is None:
            raise ValueError("swap_in needs a host tier")
        self._swap.check_parked(swapped)
        total = len(swapped.host_slots)
        skip = swapped.num_released  # released before the swap: they stay released
        hits = {
            i: b
            for i, h in enumerate(swapped.block_hashes[skip:])
            if (b := self._device.lookup(h)) is not None
        }
        if not self._can_take(total, hits):
            return None
        block_ids = self._take(total, hits)
        copied = [i for i in range(total) if i not in hits]
        if copied:
            data = self._swap.read(swapped, copied)
            self._fill(block_ids, copied, data, swapped.block_hashes[skip:])
        self._swap.release(swapped)
        hashes = list(swapped.block_hashes)
        table = BlockTable(
            self._new_id(),
            self.block_size,
            [RELEASED] * skip + block_ids,
            swapped.num_tokens,
            hashes,
            num_released=skip,
        )
        self._tables[table.table_id] = table
        return table

    def discard_swapped(self, swapped: SwappedBlocks) -> None:
        """Drop a swapped sequence that will not resume (aborted), releasing its host slots."""
        if self._swap is None:
            raise ValueError("discard_swapped needs a host tier")
        self._swap.release(swapped)

    # -- internals -----------------------------------------------------------------------

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _check_live(self, table: BlockTable) -> None:
        if self._tables.get(table.table_id) is not table:
            raise ValueError(f"block table {table.table_id} is not live (freed or foreign)")

    def _can_take(self, total: int, hits: dict[int, int]) -> bool:
        """Whether ``total`` blocks fit when ``hits`` (index -> cached block) are reused."""
        idle_hits = sum(1 for b in hits.values() if self._device.ref_count(b) == 0)
        return total - len(hits) <= self._device.num_available - idle_hits

    def _take(self, total: int, hits: dict[int, int]) -> list[int]:
        # Reference the hits first so taking fresh blocks cannot evict them.
        for block_id in hits.values():
            self._device.acquire_cached(block_id)
        fresh = iter(self._device.acquire_fresh(total - len(hits)))
        return [hits[i] if i in hits else next(fresh) for i in range(total)]

    def _fill(
        self,
        block_ids: list[int],
        indices: list[int],
        data: torch.Tensor,
        block_hashes: Sequence[int],
    ) -> None:
        """Write ``data`` into ``block_ids[indices]`` and register those that are committed."""
        assert self.pool is not None
        data = data.to(self.pool.tensor.device)  # lower tiers hand back host tensors
        self.pool.write_blocks([block_ids[i] for i in indices], data)
        committed = [i for i in indices if i < len(block_hashes)]
        self._device.register([(block_ids[i], block_hashes[i]) for i in committed])

    def _spill(self, hashes: list[int], block_ids: list[int]) -> None:
        assert self.host_kv_tier is not None and self.pool is not None
        self.host_kv_tier.store(hashes, self.pool.read_blocks(block_ids))
        self.stats.spilled_blocks += len(hashes)

    def check_integrity(self) -> None:
        """Raise KVIntegrityError describing the first broken invariant, if any."""
        refs: Counter[int] = Counter()
        for table_id, table in self._tables.items():
            if table.table_id != table_id or table.block_size != self.block_size:
                raise KVIntegrityError(f"table {table} is registered as {table_id}")
            table.check_shape()
            refs.update(table.live_block_ids)
            for i, block_id in enumerate(table.block_ids):
                if i < table.num_released:
                    continue
                h = self._device.blocks[block_id].hash
                if h is not None and (i >= len(table.block_hashes) or table.block_hashes[i] != h):
                    raise KVIntegrityError(
                        f"table {table}: block {block_id} at index {i} is registered as {h:#x}, "
                        "which is not this table's committed hash there"
                    )
        self._device.check_integrity(refs)
        if self._swap is not None:
            self._swap.check_integrity()
