"""Swap space: whole sequences (partial last block included) parked in host-tier slots.

Preemption usually needs no swap space, because a freed sequence's full blocks stay cached
and spill to the host tier on their own. Swapping also keeps the uncommitted tail, so the
sequence resumes without recomputing anything. The slots are reserved in the host tier's
memory, so swapped sequences and cached blocks share one budget.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.kvcache.host_kv_tier import HostKVTier
from engine.kvcache.tables import KVIntegrityError, SwappedBlocks


class SwapSpace:
    def __init__(self, host_kv_tier: HostKVTier):
        self.host_kv_tier = host_kv_tier
        self._swapped: dict[int, SwappedBlocks] = {}

    def __len__(self) -> int:
        return len(self._swapped)

    def park(
        self,
        swap_id: int,
        data: torch.Tensor,
        num_tokens: int,
        block_hashes: Sequence[int],
        num_released: int = 0,
    ) -> SwappedBlocks | None:
        """Copy ``data`` (one row per block) into reserved slots; None (no change) if full."""
        slots = self.host_kv_tier.reserve_slots(data.shape[0])
        if slots is None:
            return None
        if slots:
            self.host_kv_tier.write_slots(slots, data)
        swapped = SwappedBlocks(
            swap_id, tuple(slots), num_tokens, tuple(block_hashes), num_released
        )
        self._swapped[swap_id] = swapped
        return swapped

    def check_parked(self, swapped: SwappedBlocks) -> None:
        if self._swapped.get(swapped.swap_id) is not swapped:
            raise ValueError(f"swap {swapped.swap_id} is not swapped out here")

    def read(self, swapped: SwappedBlocks, indices: Sequence[int]) -> torch.Tensor:
        """Copies of the parked blocks at ``indices`` (positions in the sequence)."""
        self.check_parked(swapped)
        return self.host_kv_tier.read_slots([swapped.host_slots[i] for i in indices])

    def release(self, swapped: SwappedBlocks) -> None:
        self.check_parked(swapped)
        self.host_kv_tier.release_slots(swapped.host_slots)
        del self._swapped[swapped.swap_id]

    def check_integrity(self) -> None:
        slots = [slot for s in self._swapped.values() for slot in s.host_slots]
        if len(set(slots)) != len(slots):
            raise KVIntegrityError(f"two swapped sequences share host slots: {sorted(slots)}")
        self.host_kv_tier.check_integrity(set(slots))
