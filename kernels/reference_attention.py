"""Plain torch references the Triton kernels are tested against.

Written for obviousness, not speed: one sequence and one token at a time, positions resolved
through the block table by hand, softmax in float64. Same semantics as the engine's torch path
(`kernels.torch_attention`): query i of a sequence with `q_len` new tokens and `ctx` context
tokens sits at position ctx - q_len + i and sees keys 0..ctx - q_len + i.
"""

from __future__ import annotations

import torch


def gather_context(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: list[int],
    context_len: int,
) -> torch.Tensor:  # [context_len, num_kv_heads, head_dim]
    block_size = cache.shape[1]
    rows = [cache[block_table[pos // block_size], pos % block_size] for pos in range(context_len)]
    return torch.stack(rows)


def reference_paged_attention(
    q: torch.Tensor,  # [tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    scale: float,
) -> torch.Tensor:  # [tokens, num_heads, head_dim], q's dtype
    """Attention of each sequence's new queries over its whole paged context (K/V already
    written), causal among the new queries. Covers decode, verify and chunked prefill."""
    num_heads = q.shape[1]
    group = num_heads // key_cache.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    start = 0
    for q_len, ctx, table in zip(query_lens, context_lens, block_tables, strict=True):
        keys = gather_context(key_cache, table, ctx).double().repeat_interleave(group, dim=1)
        values = gather_context(value_cache, table, ctx).double().repeat_interleave(group, dim=1)
        queries = q[start : start + q_len].double()
        scores = torch.einsum("qhd,khd->hqk", queries, keys) * scale
        q_pos = torch.arange(ctx - q_len, ctx)[:, None]
        visible = torch.arange(ctx)[None, :] <= q_pos  # [q_len, ctx]
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start : start + q_len] = torch.einsum("hqk,khd->qhd", probs, values)
        start += q_len
    return out.to(q.dtype)


def reference_write_kv(
    k: torch.Tensor,  # [tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_blocks: list[int],  # block of each token; a negative block means "skip this token"
    slot_offsets: list[int],  # offset of each token inside its block
) -> None:
    for token, (block, offset) in enumerate(zip(slot_blocks, slot_offsets, strict=True)):
        if block < 0:
            continue
        key_cache[block, offset] = k[token].to(key_cache.dtype)
        value_cache[block, offset] = v[token].to(value_cache.dtype)
