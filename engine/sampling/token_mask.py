"""Tokens a grammar allows, per row of a logits matrix, as packed bits; applied by the sampler.

Only the rows a mask names change: a free row in the same batch samples exactly what it
would alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_SHIFTS = torch.arange(32, dtype=torch.int32)


@dataclass(frozen=True, eq=False)
class TokenMask:
    rows: torch.Tensor  # [C] long: the logits rows it constrains
    bits: torch.Tensor  # [C, W] int32: bit j of word i allows token 32 * i + j

    def allowed(self, vocab_size: int) -> torch.Tensor:
        """[C, vocab_size] bool; tokens past the packed width are not allowed."""
        c, words = self.bits.shape
        unpacked = ((self.bits.unsqueeze(-1) >> _SHIFTS) & 1).bool().reshape(c, words * 32)
        if unpacked.shape[1] >= vocab_size:
            return unpacked[:, :vocab_size]
        pad = torch.zeros((c, vocab_size - unpacked.shape[1]), dtype=torch.bool)
        return torch.cat([unpacked, pad], dim=1)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of ``[B, V]`` logits with disallowed tokens of the named rows at -inf."""
        allowed = self.allowed(logits.shape[-1]).to(logits.device)
        out = logits.clone()
        rows = self.rows.to(logits.device)
        out[rows] = out[rows].masked_fill(~allowed, float("-inf"))
        return out
