"""Writing the step's new K/V into their paged slots.

One program per new token copies its `[kv_heads, head_dim]` keys and values to
(block, offset) of the strided per-layer cache views. A negative block marks a padding token
(e.g. a batch padded to a captured size) that must write nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_batch import check_cache_pair


@triton.jit
def _write_kv_kernel(
    k_ptr,  # [tokens, num_kv_heads, head_dim]
    v_ptr,  # [tokens, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_block_ptr,  # [tokens] int64
    slot_offset_ptr,  # [tokens] int64
    num_kv_heads,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,  # num_kv_heads rounded up to a power of two
    BLOCK_D: tl.constexpr,  # HEAD_DIM rounded up to a power of two
):
    token = tl.program_id(0)
    block = tl.load(slot_block_ptr + token).to(tl.int64)
    offset = tl.load(slot_offset_ptr + token).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    head_limit = tl.where(block >= 0, num_kv_heads, 0)  # padding tokens store nothing
    mask = (h < head_limit)[:, None] & (d < HEAD_DIM)[None, :]

    k = tl.load(k_ptr + token * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    kc_offs = block * stride_kcb + offset * stride_kcs + h[:, None] * stride_kch + d[None, :]
    vc_offs = block * stride_vcb + offset * stride_vcs + h[:, None] * stride_vch + d[None, :]
    tl.store(k_cache_ptr + kc_offs, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + vc_offs, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_slots(
    k: torch.Tensor,  # [tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_blocks: torch.Tensor,  # [tokens] integer block ids, negative = skip
    slot_offsets: torch.Tensor,  # [tokens] integer offsets inside the block
) -> None:
    check_cache_pair(key_cache, value_cache)
    tokens = k.shape[0]
    for name, t in (("k", k), ("v", v)):
        if t.shape != (tokens, *key_cache.shape[2:]) or t.stride(-1) != 1:
            raise ValueError(
                f"{name} must be [tokens, kv_heads, head_dim] = "
                f"{(tokens, *key_cache.shape[2:])} with contiguous head_dim, got "
                f"{tuple(t.shape)} strides {t.stride()}"
            )
        if t.device != key_cache.device:
            raise ValueError(f"{name} on {t.device}, cache on {key_cache.device}")
    for name, t in (("slot_blocks", slot_blocks), ("slot_offsets", slot_offsets)):
        if t.shape != (tokens,) or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"{name} must be [{tokens}] int32/int64, got {tuple(t.shape)} {t.dtype}"
            )
        if t.device != key_cache.device:
            raise ValueError(f"{name} on {t.device}, cache on {key_cache.device}")
    if tokens == 0:
        return
    kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    _write_kv_kernel[(tokens,)](
        k, v, key_cache, value_cache, slot_blocks, slot_offsets, kv_heads,
        k.stride(0), k.stride(1),
        v.stride(0), v.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=1 if kv_heads * head_dim <= 512 else 4,
    )  # fmt: skip
