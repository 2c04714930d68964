"""Grouped expert MLPs: the rows routed to each expert, already sorted by expert, through
that expert's gated MLP and scaled by each row's routing weight.

The torch reference loops over experts (one matmul pair per expert, never per token); the
Triton kernel (kernels/triton_moe.py) computes the same thing in two launches over a tile
list. Both take plain tensors: the model (engine/model/moe.py) routes, sorts and scatters.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def activate(gate: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh")
    if activation == "silu":
        return F.silu(gate)
    raise ValueError(f"unknown activation {activation!r}")


def reference_grouped_experts(
    grouped: torch.Tensor,  # [rows, hidden], rows of expert 0 first, then expert 1, ...
    counts: Sequence[int],  # rows per expert
    gate_up: torch.Tensor,  # [experts, 2 * inter, hidden]
    down: torch.Tensor,  # [experts, hidden, inter]
    row_weights: torch.Tensor,  # [rows] routing weight of each row
    activation: str,
) -> torch.Tensor:  # [rows, hidden]
    inter = down.shape[2]
    out = torch.empty_like(grouped)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            rows = slice(start, start + count)
            h = grouped[rows] @ gate_up[expert].T
            h = activate(h[:, :inter], activation) * h[:, inter:]
            out[rows] = (h @ down[expert].T) * row_weights[rows, None].to(out.dtype)
            start += count
    return out
