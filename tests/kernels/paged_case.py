"""Random paged-attention inputs laid out like the engine's: block-major pool views, shuffled
block tables, queries sliced out of a fused QKV projection (strided)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.attention_metadata import AttentionMetadata
from kernels.triton_batch import PagedBatch


@dataclass
class PagedCase:
    q: torch.Tensor  # [tokens, num_heads, head_dim], strided
    k_new: torch.Tensor  # [tokens, kv_heads, head_dim], the step's new keys
    v_new: torch.Tensor
    pool: torch.Tensor  # [num_blocks, layers, 2, block_size, kv_heads, head_dim]
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    block_size: int

    @property
    def key_cache(self) -> torch.Tensor:
        return self.pool[:, 1, 0]

    @property
    def value_cache(self) -> torch.Tensor:
        return self.pool[:, 1, 1]

    @property
    def query_starts(self) -> list[int]:
        starts = [0]
        for q_len in self.query_lens[:-1]:
            starts.append(starts[-1] + q_len)
        return starts

    def metadata(self, trees: list[tuple[int, ...] | None] | None = None) -> AttentionMetadata:
        return AttentionMetadata(
            query_lens=self.query_lens,
            context_lens=self.context_lens,
            block_tables=self.block_tables,
            block_size=self.block_size,
            trees=trees,
        )

    def batch(self) -> PagedBatch:
        return PagedBatch.build(
            self.query_starts,
            self.query_lens,
            self.context_lens,
            self.block_tables,
            self.block_size,
            "cpu",
        )


def make_case(
    query_lens: list[int],
    context_lens: list[int],
    *,
    head_dim: int,
    group: int,
    block_size: int,
    kv_heads: int = 2,
    cache_dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> PagedCase:
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [(ctx + block_size - 1) // block_size for ctx in context_lens]
    # Spare blocks, shuffled: tables are scattered and never in pool order.
    num_blocks = sum(blocks_needed) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in blocks_needed:
        tables.append(order[used : used + n])
        used += n
    shape = (num_blocks, 2, 2, block_size, kv_heads, head_dim)
    pool = torch.randn(shape, generator=gen).to(cache_dtype)
    tokens = sum(query_lens)
    heads = kv_heads * group
    qkv = torch.randn((tokens, heads + 2 * kv_heads, head_dim), generator=gen)
    return PagedCase(
        q=qkv[:, :heads],
        k_new=qkv[:, heads : heads + kv_heads],
        v_new=qkv[:, heads + kv_heads :],
        pool=pool,
        query_lens=query_lens,
        context_lens=context_lens,
        block_tables=tables,
        block_size=block_size,
    )
