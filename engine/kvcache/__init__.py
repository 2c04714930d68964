"""The paged KV cache: the pool of blocks, the block manager (tables, prefix reuse by chained
block hashes), and the host and disk KV tiers cold blocks spill to."""
