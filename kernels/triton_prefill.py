"""Chunked-prefill attention over a cached paged prefix.

A chunk of `query_len` new tokens (their K/V already written to the pool) attends to the
sequence's cached prefix and causally to itself: query i sits at position ctx - query_len + i.
The queries are many, so this is the flash-attention forward: one program per (sequence,
BLOCK_M query tile, query head), K/V streamed through the online softmax. A tile stops at the
last key its latest query can see, so the diagonal's upper triangle is never loaded.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.triton_batch import PagedBatch, check_attention_inputs, dot_in_fp32
from kernels.triton_tile import _load_paged_tile, _load_queries, _online_softmax_step


@triton.jit
def _chunked_prefill_kernel(
    q_ptr,  # [tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table_ptr,  # [seqs, max_blocks] int32
    query_start_ptr,  # [seqs] int32
    query_len_ptr,  # [seqs] int32
    context_len_ptr,  # [seqs] int32
    out_ptr,  # [tokens, num_heads, head_dim]
    scale_log2,  # softmax scale * log2(e)
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM rounded up to a power of two
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_M: tl.constexpr,  # query tokens per program
    BLOCK_N: tl.constexpr,  # keys per inner iteration
    PAGE_SIZE: tl.constexpr,  # tokens per KV block
    DOT_FP32: tl.constexpr,
):
    seq = tl.program_id(0)
    m_start = tl.program_id(1) * BLOCK_M
    head = tl.program_id(2)
    kv_head = head // GROUP
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_len_ptr + seq)
    ctx = tl.load(context_len_ptr + seq)

    tok = m_start + tl.arange(0, BLOCK_M)
    row_valid = tok < q_len
    q_pos = ctx - q_len + tok
    d = tl.arange(0, BLOCK_D)
    d_valid = d < HEAD_DIM
    heads = tl.zeros([BLOCK_M], dtype=tl.int32) + head
    q = _load_queries(
        q_ptr, q_start + tok, heads, row_valid, d, d_valid, stride_qt, stride_qh, k_cache_ptr,
        DOT_FP32,
    )  # fmt: skip
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # The grid is padded to the longest chunk; a tile past this one's end attends to nothing.
    last_visible = tl.minimum(ctx, ctx - q_len + m_start + BLOCK_M)
    kv_end = tl.where(m_start < q_len, last_visible, 0)
    table_row = block_table_ptr + seq * stride_bt
    for n_start in range(0, kv_end, BLOCK_N):
        n = n_start + tl.arange(0, BLOCK_N)
        n_valid = n < kv_end
        k = _load_paged_tile(
            k_cache_ptr, table_row, n, n_valid, d, d_valid, kv_head,
            stride_kb, stride_ks, stride_kh, PAGE_SIZE,
        )  # fmt: skip
        v = _load_paged_tile(
            v_cache_ptr, table_row, n, n_valid, d, d_valid, kv_head,
            stride_vb, stride_vs, stride_vh, PAGE_SIZE,
        )  # fmt: skip
        visible = n_valid[None, :] & (n[None, :] <= q_pos[:, None])
        m_i, l_i, acc = _online_softmax_step(q, k, v, visible, scale_log2, m_i, l_i, acc, DOT_FP32)

    result = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_offs = (q_start + tok)[:, None] * stride_ot + head * stride_oh + d[None, :]
    o_mask = row_valid[:, None] & d_valid[None, :]
    tl.store(out_ptr + o_offs, result.to(out_ptr.dtype.element_ty), mask=o_mask)


def chunked_prefill_attention(
    q: torch.Tensor,  # [tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    out: torch.Tensor,  # [tokens, num_heads, head_dim]; the batch's rows are written
    batch: PagedBatch,
    scale: float,
    block_m: int | None = None,
    block_n: int | None = None,
) -> None:
    """Attention of each sequence's query chunk over its cached prefix and, causally, itself."""
    group = check_attention_inputs(q, key_cache, value_cache, out, batch)
    _, page_size, _, head_dim = key_cache.shape
    block_d = max(16, triton.next_power_of_2(head_dim))
    # 64x64 tiles keep Q, K, V and the fp32 accumulator of a 128-wide head in one SM's
    # registers with 4 warps; wider heads halve the key tile.
    block_m = block_m or 64
    block_n = block_n or (64 if block_d <= 128 else 32)
    for name, size in (("block_m", block_m), ("block_n", block_n)):
        if size < 16 or size & (size - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {size}")
    grid = (batch.num_seqs, triton.cdiv(batch.max_query_len, block_m), q.shape[1])
    _chunked_prefill_kernel[grid](
        q, key_cache, value_cache, batch.block_table,
        batch.query_start, batch.query_len, batch.context_len, out,
        scale * math.log2(math.e),
        q.stride(0), q.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        batch.block_table.stride(0),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=block_d, GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n,
        PAGE_SIZE=page_size, DOT_FP32=dot_in_fp32(q, key_cache),
        num_warps=4 if block_m * block_d <= 64 * 128 else 8, num_stages=2,
    )  # fmt: skip
