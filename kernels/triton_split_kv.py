"""Split-KV (flash-decoding) paged attention for decode and speculative verify.

A decode or verify step has few query rows per sequence, so one program per (sequence, KV head)
leaves most of a GPU idle at small batch: 8 sequences x 8 KV heads is 64 programs on a 132-SM
H100. Splitting each sequence's context into `num_splits` key ranges multiplies the programs;
each writes a partial output with its log-sum-exp and a second kernel combines them.

One program covers one (sequence, KV head, split) and *all* of that KV head's query rows: every
query token (1 for decode, 2-16 for verify) times every query head of the GQA group, packed as
rows `token * GROUP + head`. So each K/V tile is read from HBM once for all of them, and the
verify case takes the same split path as decode instead of falling back to an unsplit kernel.
Keys are visible to query token i when their position <= context_len - query_len + i.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.triton_batch import PagedBatch, check_attention_inputs, dot_in_fp32
from kernels.triton_tile import _load_paged_tile, _load_queries, _online_softmax_step

# Fewer keys than this per split and the split's fixed cost (loading Q, writing a partial,
# the combine) outweighs the parallelism it adds.
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 64
# Programs per SM the split count aims for: two waves hide one program's tail behind another.
PROGRAMS_PER_SM = 2
MAX_QUERY_TOKENS = 16


@triton.jit
def _split_kv_attention_kernel(
    q_ptr,  # [tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table_ptr,  # [seqs, max_blocks] int32
    query_start_ptr,  # [seqs] int32
    query_len_ptr,  # [seqs] int32
    context_len_ptr,  # [seqs] int32
    out_ptr,  # [tokens, num_heads, head_dim]; written directly when DIRECT_OUT
    part_out_ptr,  # [seqs, query_tokens, num_heads, num_splits, head_dim] fp32
    part_lse_ptr,  # [seqs, query_tokens, num_heads, num_splits] fp32, log2 domain
    scale_log2,  # softmax scale * log2(e): the kernel works with exp2
    split_tokens,  # keys per split, a multiple of BLOCK_N
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
    stride_ps,
    stride_pt,
    stride_ph,
    stride_pp,
    stride_ls,
    stride_lt,
    stride_lh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM rounded up to a power of two
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_M: tl.constexpr,  # >= max query tokens * GROUP, power of two, >= 16
    BLOCK_N: tl.constexpr,  # keys per inner iteration (may span several pages)
    PAGE_SIZE: tl.constexpr,  # tokens per KV block
    DIRECT_OUT: tl.constexpr,  # a single split: normalise and write `out`, no combine pass
    DOT_FP32: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_len_ptr + seq)
    ctx = tl.load(context_len_ptr + seq)

    rows = tl.arange(0, BLOCK_M)
    tok = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = tok < q_len
    q_pos = ctx - q_len + tok  # absolute position of each row's query token
    d = tl.arange(0, BLOCK_D)
    d_valid = d < HEAD_DIM

    q = _load_queries(
        q_ptr, q_start + tok, head, row_valid, d, d_valid, stride_qt, stride_qh, k_cache_ptr,
        DOT_FP32,
    )  # fmt: skip
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    table_row = block_table_ptr + seq * stride_bt
    split_start = split * split_tokens
    split_end = tl.minimum(split_start + split_tokens, ctx)
    for n_start in range(split_start, split_end, BLOCK_N):
        n = n_start + tl.arange(0, BLOCK_N)
        n_valid = n < split_end
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

    # l_i == 0 only for padding rows or rows this split shows no key to; both get weight 0.
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    result = acc / l_safe[:, None]
    store_mask = row_valid[:, None] & d_valid[None, :]
    if DIRECT_OUT:
        o_offs = (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(out_ptr + o_offs, result.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        # int64: a large split batch's partials pass 2**31 elements.
        p_offs = seq.to(tl.int64) * stride_ps + tok * stride_pt + head * stride_ph
        p_offs += split * stride_pp
        tl.store(part_out_ptr + p_offs[:, None] + d[None, :], result, mask=store_mask)
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        l_offs = seq * stride_ls + tok * stride_lt + head * stride_lh + split
        tl.store(part_lse_ptr + l_offs, lse, mask=row_valid)


@triton.jit
def _combine_splits_kernel(
    part_out_ptr,  # [seqs, query_tokens, num_heads, num_splits, head_dim] fp32
    part_lse_ptr,  # [seqs, query_tokens, num_heads, num_splits] fp32, log2 domain
    query_start_ptr,  # [seqs] int32
    token_seq_ptr,  # [batch_tokens] int32
    token_index_ptr,  # [batch_tokens] int32
    out_ptr,  # [tokens, num_heads, head_dim]
    num_heads,
    num_splits,
    stride_ps,
    stride_pt,
    stride_ph,
    stride_pp,
    stride_ls,
    stride_lt,
    stride_lh,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,  # heads per program
    BLOCK_SPLITS: tl.constexpr,  # num_splits rounded up to a power of two
):
    seq = tl.load(token_seq_ptr + tl.program_id(0)).to(tl.int64)
    tok = tl.load(token_index_ptr + tl.program_id(0))
    head = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_valid = head < num_heads
    splits = tl.arange(0, BLOCK_SPLITS)
    d = tl.arange(0, BLOCK_D)
    hs_valid = head_valid[:, None] & (splits < num_splits)[None, :]  # [BLOCK_H, BLOCK_SPLITS]

    l_offs = seq * stride_ls + tok * stride_lt + head[:, None] * stride_lh + splits[None, :]
    lse = tl.load(part_lse_ptr + l_offs, mask=hs_valid, other=float("-inf"))
    # Split 0 always holds key 0, which every query sees, so the max is finite for valid heads.
    lse_max = tl.max(lse, 1)
    lse_max = tl.where(lse_max > float("-inf"), lse_max, 0.0)
    weight = tl.exp2(lse - lse_max[:, None])
    weight = weight / tl.maximum(tl.sum(weight, 1), 1e-30)[:, None]

    p_offs = seq * stride_ps + tok * stride_pt + head[:, None] * stride_ph
    p_offs = p_offs + splits[None, :] * stride_pp  # [BLOCK_H, BLOCK_SPLITS]
    hsd_valid = hs_valid[:, :, None] & (d < HEAD_DIM)[None, None, :]
    parts = tl.load(part_out_ptr + p_offs[:, :, None] + d[None, None, :], mask=hsd_valid, other=0.0)
    result = tl.sum(parts * weight[:, :, None], 1)  # [BLOCK_H, BLOCK_D]
    q_start = tl.load(query_start_ptr + seq)
    o_offs = (q_start + tok) * stride_ot + head[:, None] * stride_oh + d[None, :]
    o_mask = head_valid[:, None] & (d < HEAD_DIM)[None, :]
    tl.store(out_ptr + o_offs, result.to(out_ptr.dtype.element_ty), mask=o_mask)


def choose_num_splits(num_seqs: int, kv_heads: int, max_context: int, num_sms: int) -> int:
    """Enough splits for ~PROGRAMS_PER_SM programs per SM, never under MIN_SPLIT_TOKENS keys."""
    programs = max(1, num_seqs * kv_heads)
    wanted = math.ceil(PROGRAMS_PER_SM * num_sms / programs)
    useful = math.ceil(max_context / MIN_SPLIT_TOKENS)
    return max(1, min(wanted, useful, MAX_SPLITS))


def split_kv_attention(
    q: torch.Tensor,  # [tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    out: torch.Tensor,  # [tokens, num_heads, head_dim]; the batch's rows are written
    batch: PagedBatch,
    scale: float,
    num_splits: int,
    block_n: int | None = None,
) -> None:
    """Attention of each sequence's 1-16 new queries over its paged context (causal among them).

    `num_splits == 1` is the unsplit kernel (one program per sequence and KV head, no combine):
    the baseline the benchmark holds the split path against.
    """
    group = check_attention_inputs(q, key_cache, value_cache, out, batch)
    if not 1 <= batch.max_query_len <= MAX_QUERY_TOKENS:
        raise ValueError(
            f"split-KV attention takes 1-{MAX_QUERY_TOKENS} query tokens per sequence, got "
            f"{batch.max_query_len}; longer chunks go to chunked_prefill_attention"
        )
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    _, page_size, kv_heads, head_dim = key_cache.shape
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_m = max(16, triton.next_power_of_2(batch.max_query_len * group))
    block_n = block_n or (64 if block_d <= 128 else 32)
    split_tokens = triton.cdiv(triton.cdiv(batch.max_context_len, num_splits), block_n) * block_n
    num_splits = triton.cdiv(batch.max_context_len, split_tokens)
    direct = num_splits == 1
    num_heads = q.shape[1]
    seqs, q_tokens = batch.num_seqs, batch.max_query_len
    if direct:  # never read; the kernel still needs valid pointers and strides
        part_out = out.new_empty((1, 1, 1, 1, 1), dtype=torch.float32)
        part_lse = out.new_empty((1, 1, 1, 1), dtype=torch.float32)
    else:
        part_out = torch.empty(
            (seqs, q_tokens, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty(
            (seqs, q_tokens, num_heads, num_splits), dtype=torch.float32, device=q.device
        )
    _split_kv_attention_kernel[(seqs, kv_heads, num_splits)](
        q, key_cache, value_cache, batch.block_table,
        batch.query_start, batch.query_len, batch.context_len,
        out, part_out, part_lse,
        scale * math.log2(math.e), split_tokens,
        q.stride(0), q.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        batch.block_table.stride(0),
        out.stride(0), out.stride(1),
        *part_out.stride()[:4],
        *part_lse.stride()[:3],
        HEAD_DIM=head_dim, BLOCK_D=block_d, GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n,
        PAGE_SIZE=page_size, DIRECT_OUT=direct,
        DOT_FP32=dot_in_fp32(q, key_cache),
        num_warps=4 if block_m <= 64 else 8, num_stages=2,
    )  # fmt: skip
    if direct:
        return
    block_splits = max(2, triton.next_power_of_2(num_splits))
    # Up to ~8K fp32 partial elements per program: few registers per thread on a GPU, and few
    # programs (each a Python loop iteration) under the CPU interpreter.
    block_h = min(triton.next_power_of_2(num_heads), max(1, 8192 // (block_splits * block_d)))
    _combine_splits_kernel[(batch.num_tokens, triton.cdiv(num_heads, block_h))](
        part_out, part_lse, batch.query_start, batch.token_seq, batch.token_index, out,
        num_heads, num_splits,
        *part_out.stride()[:4],
        *part_lse.stride()[:3],
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_H=block_h, BLOCK_SPLITS=block_splits,
        num_warps=4,
    )  # fmt: skip


def device_sm_count(device: torch.device) -> int:
    """Streaming multiprocessors to fill; the CPU interpreter has none, so a few stand in."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def paged_decode_attention(
    q: torch.Tensor,  # [tokens, num_heads, head_dim], one token per sequence
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    out: torch.Tensor,  # [tokens, num_heads, head_dim]
    batch: PagedBatch,
    scale: float,
    num_splits: int | None = None,
) -> None:
    """Decode: one new query per sequence; the split count fills the device unless given."""
    if batch.max_query_len != 1:
        raise ValueError(f"decode takes one query per sequence, got up to {batch.max_query_len}")
    splits = num_splits or choose_num_splits(
        batch.num_seqs, key_cache.shape[2], batch.max_context_len, device_sm_count(q.device)
    )
    split_kv_attention(q, key_cache, value_cache, out, batch, scale, splits)


def verify_attention(
    q: torch.Tensor,  # [tokens, num_heads, head_dim], 2-16 tokens per sequence
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    out: torch.Tensor,  # [tokens, num_heads, head_dim]
    batch: PagedBatch,
    scale: float,
    num_splits: int | None = None,
) -> None:
    """Speculative verify: k+1 queries per sequence, causal among them, on the split-KV path."""
    if not 2 <= batch.max_query_len <= MAX_QUERY_TOKENS:
        raise ValueError(
            f"verify takes 2-{MAX_QUERY_TOKENS} queries per sequence, got {batch.max_query_len}"
        )
    splits = num_splits or choose_num_splits(
        batch.num_seqs, key_cache.shape[2], batch.max_context_len, device_sm_count(q.device)
    )
    split_kv_attention(q, key_cache, value_cache, out, batch, scale, splits)
