"""One replica's prefix cache in the simulator, in two tiers: device blocks, and host blocks that
device evictions spill to (as the engine's host tier does), each least-recently-used.

A host block is reusable but not free: it must be copied back to the device. The router
scores it as a fraction of recompute (`RouterConfig.host_hit_cost`) and the simulated prefill
charges the same fraction, so the benchmark holds the router to the cost it assumes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from services.router.index import PrefixHit


class PrefixCache:
    """Leading blocks of a prompt a replica still holds. A block is only useful after all the
    blocks before it (its KV was computed on top of theirs), so a match stops at the first
    miss. `device_blocks=None` is the unbounded oracle."""

    __slots__ = ("capacity", "host_capacity", "_device", "_host")

    def __init__(self, device_blocks: int | None, host_blocks: int = 0):
        if (device_blocks is not None and device_blocks < 0) or host_blocks < 0:
            raise ValueError("cache capacities must be >= 0")
        self.capacity = device_blocks  # None: unbounded (the oracle)
        self.host_capacity = host_blocks
        self._device: OrderedDict[int, None] = OrderedDict()
        self._host: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._device) + len(self._host)

    def match(self, block_ids: Sequence[int]) -> int:
        return self.match_kv_tiers(block_ids).blocks

    def match_kv_tiers(self, block_ids: Sequence[int]) -> PrefixHit:
        """Leading blocks held, by tier; stops at the first block held in neither."""
        device, host = self._device, self._host
        n_device = n_host = 0
        for b in block_ids:
            if b in device:
                n_device += 1
            elif b in host:
                n_host += 1
            else:
                break
        return PrefixHit(device=n_device, host=n_host)

    def insert(self, block_ids: Sequence[int]) -> None:
        """The prompt's blocks are now on the device, most recent; tail first so its head is
        the last to go (evicting a head block strands every block after it)."""
        if self.capacity == 0:
            return
        device, host = self._device, self._host
        for b in reversed(block_ids):
            if b in device:
                device.move_to_end(b)
            else:
                host.pop(b, None)
                device[b] = None
        if self.capacity is None:
            return
        while len(device) > self.capacity:
            spilled, _ = device.popitem(last=False)
            if self.host_capacity:
                host[spilled] = None
        while len(host) > self.host_capacity:
            host.popitem(last=False)
