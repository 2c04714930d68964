"""The KV cache an engine serves from, built from its config and the model's KV layout: the
pool, the host and disk KV tiers below it, and the block manager over them."""

from __future__ import annotations

from collections.abc import Callable

from engine.core.config import EngineConfig
from engine.kvcache.block_manager import BlockManager
from engine.kvcache.disk_kv_tier import DiskKVTier
from engine.kvcache.host_kv_tier import HostKVTier
from engine.kvcache.pool import KVLayout, KVPool
from shared.kvblocks.events import KVEvent
from shared.modelfile.config import ModelConfig
from shared.tokenizer.tokenizer import Tokenizer


def kv_pool(config: EngineConfig, layout: KVLayout, given: KVPool | None = None) -> KVPool:
    """The pool given (a transfer backend's shared one, say), else one of `num_blocks`, else
    one sized from the byte budget."""
    if given is not None:
        if given.layout != layout:
            raise ValueError(f"KV pool layout {given.layout} does not match the model's {layout}")
        return given
    if config.num_blocks is not None:
        return KVPool(layout, config.num_blocks, config.device)
    return KVPool.from_budget(layout, config.kv_cache_bytes, config.device)


def host_kv_tier(config: EngineConfig, layout: KVLayout) -> HostKVTier | None:
    """The host KV tier cold blocks spill to (with a disk KV tier below it), if configured."""
    if config.host_cache_bytes <= 0:
        return None
    disk = None
    if config.disk_cache_bytes > 0 and config.disk_cache_dir:
        disk = DiskKVTier(
            config.disk_cache_dir, max(1, config.disk_cache_bytes // layout.block_bytes)
        )
    return HostKVTier(
        max(1, config.host_cache_bytes // layout.block_bytes),
        layout.block_shape,
        layout.dtype,
        disk,
    )


def block_salt(tokenizer: Tokenizer | None, kv_salt: bytes | None, model: ModelConfig) -> bytes:
    """What block hashes are salted with. They must agree across replicas and with the
    router: the tokenizer's fingerprint (same ids mean the same text) unless told otherwise."""
    return kv_salt or (tokenizer.fingerprint if tokenizer else repr(model)).encode()


def block_manager(
    config: EngineConfig,
    pool: KVPool,
    model: ModelConfig,
    salt: bytes,
    event_sink: Callable[[KVEvent], None] | None,
) -> BlockManager:
    return BlockManager(
        pool.num_blocks,
        config.block_size,
        salt=salt,
        host_kv_tier=host_kv_tier(config, pool.layout),
        pool=pool,
        event_sink=event_sink,
        # Only where every layer slides can old blocks go: a global layer reads them all.
        window_tokens=model.max_window,
    )
