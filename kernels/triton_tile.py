"""Device functions every Triton attention kernel here shares: a paged K/V tile load and one
online-softmax step over it. Inlined into the kernels that call them."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _load_paged_tile(
    cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    table_row_ptr,  # [max_blocks] int32: this sequence's block table
    n,  # [BLOCK_N] key positions
    n_valid,  # [BLOCK_N]
    d,  # [BLOCK_D]
    d_valid,  # [BLOCK_D]
    kv_head,
    stride_b,
    stride_s,
    stride_h,
    PAGE_SIZE: tl.constexpr,
):
    """[BLOCK_N, BLOCK_D] keys or values for positions `n`, which may span several pages."""
    # int64 before multiplying: block * stride_b overflows int32 on a large block-major pool.
    page = tl.load(table_row_ptr + n // PAGE_SIZE, mask=n_valid, other=0).to(tl.int64)
    offs = page * stride_b + (n % PAGE_SIZE) * stride_s + kv_head * stride_h
    return tl.load(
        cache_ptr + offs[:, None] + d[None, :], mask=n_valid[:, None] & d_valid[None, :], other=0.0
    )


@triton.jit
def _online_softmax_step(
    q,  # [BLOCK_M, BLOCK_D], already fp32 when DOT_FP32 else the cache dtype
    k,  # [BLOCK_N, BLOCK_D]
    v,  # [BLOCK_N, BLOCK_D]
    visible,  # [BLOCK_M, BLOCK_N] bool: query row may attend to key
    scale_log2,
    m_i,  # [BLOCK_M] running max (log2 domain)
    l_i,  # [BLOCK_M] running denominator
    acc,  # [BLOCK_M, BLOCK_D] fp32 running numerator
    DOT_FP32: tl.constexpr,
):
    if DOT_FP32:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(visible, s * scale_log2, float("-inf"))
    # m_i starts at a finite floor, so a row with no visible key here gets p = exp2(-inf) = 0
    # rather than exp2(-inf + inf) = NaN.
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_new = l_i * alpha + tl.sum(p, 1)
    if DOT_FP32:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_new, acc * alpha[:, None] + pv


@triton.jit
def _load_queries(
    q_ptr,  # [tokens, num_heads, head_dim]
    token,  # [BLOCK_M] flat token index of each row
    head,  # [BLOCK_M] query head of each row
    row_valid,  # [BLOCK_M]
    d,
    d_valid,
    stride_qt,
    stride_qh,
    cache_ptr,  # only its element type is used
    DOT_FP32: tl.constexpr,
):
    offs = token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + offs, mask=row_valid[:, None] & d_valid[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    else:
        q = q.to(cache_ptr.dtype.element_ty)
    return q
