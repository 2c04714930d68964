"""Fused MoE experts in Triton: grouped GEMMs over the rows routed to each expert.

Rows arrive sorted by expert; the host cuts each expert's run into tiles of BLOCK_M rows and
launches one program per (tile, output block). The first kernel computes gate and up for a
tile in one pass over the hidden dimension and applies the activation (SwiGLU or GeGLU) in
its epilogue; the second runs the down projection and scales each row by its routing weight.
Same contract as `kernels.moe_experts.reference_grouped_experts`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

BLOCK_M = 16
BLOCK_N = 32
BLOCK_K = 32


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _expert_gemm_kernel(
    x_ptr,  # [rows, K]
    w_ptr,  # [experts, N_rows_of_w, K]
    out_ptr,  # [rows, N]
    row_weight_ptr,  # [rows] fp32
    tile_expert_ptr,  # [tiles] int32
    tile_start_ptr,  # [tiles] int32: first row of the tile
    tile_end_ptr,  # [tiles] int32: one past its last row
    K,
    N,
    UP_OFFSET,  # gated: the up projection's rows start here in w
    stride_xr,
    stride_we,
    stride_wn,
    stride_or,
    GATED: tl.constexpr,
    GELU: tl.constexpr,
    WEIGHTED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    start = tl.load(tile_start_ptr + tile)
    end = tl.load(tile_end_ptr + tile)
    rows = start + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    w_base = w_ptr + expert * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        x = tl.load(
            x_ptr + rows[:, None].to(tl.int64) * stride_xr + k[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        w_mask = k_ok[:, None] & n_ok[None, :]
        w = tl.load(w_base + n[None, :] * stride_wn + k[:, None], mask=w_mask, other=0.0)
        acc += tl.dot(x, w.to(tl.float32), input_precision="ieee")
        if GATED:
            w_up = tl.load(
                w_base + (n[None, :] + UP_OFFSET) * stride_wn + k[:, None], mask=w_mask, other=0.0
            )
            acc_up += tl.dot(x, w_up.to(tl.float32), input_precision="ieee")
    if GATED:
        if GELU:
            # tanh(y) = 2 sigmoid(2y) - 1: the interpreter and every backend have exp.
            inner = 0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)
            gate = 0.5 * acc * (1.0 + (2.0 * _sigmoid(2.0 * inner) - 1.0))
        else:
            gate = acc * _sigmoid(acc)
        acc = gate * acc_up
    if WEIGHTED:
        weight = tl.load(row_weight_ptr + rows, mask=row_ok, other=0.0)
        acc = acc * weight[:, None]
    out = out_ptr + rows[:, None].to(tl.int64) * stride_or + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def _tiles(counts: Sequence[int], device: torch.device) -> tuple[torch.Tensor, ...]:
    experts, starts, ends = [], [], []
    offset = 0
    for expert, count in enumerate(counts):
        for s in range(0, count, BLOCK_M):
            experts.append(expert)
            starts.append(offset + s)
            ends.append(offset + min(count, s + BLOCK_M))
        offset += count
    return tuple(torch.tensor(v, dtype=torch.int32, device=device) for v in (experts, starts, ends))


def grouped_experts(
    grouped: torch.Tensor,  # [rows, hidden], sorted by expert
    counts: Sequence[int],  # rows per expert
    gate_up: torch.Tensor,  # [experts, 2 * inter, hidden]
    down: torch.Tensor,  # [experts, hidden, inter]
    row_weights: torch.Tensor,  # [rows]
    activation: str,
) -> torch.Tensor:  # [rows, hidden]
    if activation not in ("silu", "gelu_tanh"):
        raise ValueError(f"unknown activation {activation!r}")
    rows, hidden = grouped.shape
    experts, inter = down.shape[0], down.shape[2]
    if gate_up.shape != (experts, 2 * inter, hidden) or len(counts) != experts:
        raise ValueError(
            f"gate_up {tuple(gate_up.shape)} / down {tuple(down.shape)} / {len(counts)} "
            f"counts do not describe {experts} experts of [{inter}, {hidden}]"
        )
    out = torch.empty_like(grouped)
    if rows == 0:
        return out
    x = grouped.contiguous()
    gate_up, down = gate_up.contiguous(), down.contiguous()
    weights = row_weights.to(torch.float32).contiguous()
    tile_expert, tile_start, tile_end = _tiles(counts, x.device)
    tiles = tile_expert.shape[0]
    hidden_act = torch.empty((rows, inter), dtype=torch.float32, device=x.device)
    _expert_gemm_kernel[(tiles, triton.cdiv(inter, BLOCK_N))](
        x, gate_up, hidden_act, weights, tile_expert, tile_start, tile_end,
        hidden, inter, inter,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), hidden_act.stride(0),
        GATED=True, GELU=activation == "gelu_tanh", WEIGHTED=False,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    _expert_gemm_kernel[(tiles, triton.cdiv(hidden, BLOCK_N))](
        hidden_act, down, out, weights, tile_expert, tile_start, tile_end,
        inter, hidden, 0,
        hidden_act.stride(0), down.stride(0), down.stride(1), out.stride(0),
        GATED=False, GELU=False, WEIGHTED=True,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    return out
