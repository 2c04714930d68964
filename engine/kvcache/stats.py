"""Counters the KV cache exposes for metrics and benchmarks."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class KVTierStats:
    """Traffic of one lower tier (host or disk); bytes are payload bytes copied."""

    stored_blocks: int = 0
    loaded_blocks: int = 0
    evicted_blocks: int = 0  # pushed out to make room (spilled below, or dropped)
    spilled_blocks: int = 0  # of the evicted, those handed to the next tier down
    bytes_written: int = 0
    bytes_read: int = 0


@dataclass
class PrefixCacheStats:
    """What allocations found: blocks looked up and where each reused one came from."""

    lookup_blocks: int = 0
    device_hit_blocks: int = 0
    host_hit_blocks: int = 0
    disk_hit_blocks: int = 0
    spilled_blocks: int = 0  # device blocks copied to the host tier on eviction
