"""A dense forward pass over a batch of branched sequences, for scoring (no KV cache).

A branched sequence is one shared trunk followed by alternative continuations: a PIQA item is
one question with two candidate answers. Each branch attends to the trunk and to itself, and
its positions restart where the trunk ends, so every branch sees exactly what it would see
run alone after the trunk — but the trunk is computed once (on PIQA, ~18% fewer tokens).

Sequences of a batch are packed row-wise for the matmuls, so no padding row is ever multiplied
by a weight matrix; they are padded to a common length only inside attention, where padding is
cheap. Batches are formed from sequences sorted by length, which keeps that padding small.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.model.llama import LlamaModel


@dataclass(frozen=True)
class BranchedSequence:
    """Rows are laid out trunk first, then each branch in order."""

    trunk: tuple[int, ...]
    branches: tuple[tuple[int, ...], ...] = ()

    @property
    def num_rows(self) -> int:
        return len(self.trunk) + sum(len(b) for b in self.branches)

    def branch_rows(self, k: int) -> range:
        start = len(self.trunk) + sum(len(b) for b in self.branches[:k])
        return range(start, start + len(self.branches[k]))

    def positions(self) -> list[int]:
        trunk = list(range(len(self.trunk)))
        return trunk + [len(self.trunk) + i for b in self.branches for i in range(len(b))]

    def branch_ids(self) -> list[int]:
        """0 for trunk rows, k + 1 for the rows of branch k."""
        return [0] * len(self.trunk) + [k + 1 for k, b in enumerate(self.branches) for _ in b]

    def attention_mask(self) -> torch.Tensor:
        """[rows, rows] bool, True where row i may attend to row j."""
        ids = torch.tensor(self.branch_ids())
        n = len(ids)
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        same_or_trunk = (ids[None, :] == 0) | (ids[None, :] == ids[:, None])
        return causal & same_or_trunk


@dataclass(frozen=True)
class _Packed:
    tokens: torch.Tensor  # [rows] int64, all sequences back to back
    positions: torch.Tensor  # [rows] int64
    slots: torch.Tensor  # [rows] int64, each row's place in the padded [batch * max_len] grid
    mask: torch.Tensor  # [batch, 1, max_len, max_len] bool
    batch: int
    max_len: int
    grid_positions: torch.Tensor  # [batch, max_len] int64, 0 in padding slots

    def window_mask(self, window: int) -> torch.Tensor:
        """`mask` for a sliding layer: a row also sees only the `window` positions up to its
        own (a branch's positions continue the trunk's, so distances hold across the two)."""
        pos = self.grid_positions
        return self.mask & (pos[:, None, :, None] - pos[:, None, None, :] < window)


def _pack(seqs: Sequence[BranchedSequence]) -> _Packed:
    max_len = max(s.num_rows for s in seqs)
    mask = torch.zeros(len(seqs), 1, max_len, max_len, dtype=torch.bool)
    # Padding rows attend to themselves only, so their softmax stays finite; they are dropped.
    mask[:, 0] = torch.eye(max_len, dtype=torch.bool)
    tokens: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    grid_positions = torch.zeros(len(seqs), max_len, dtype=torch.long)
    for b, s in enumerate(seqs):
        n = s.num_rows
        mask[b, 0, :n, :n] = s.attention_mask()
        tokens += [*s.trunk, *(t for branch in s.branches for t in branch)]
        positions += s.positions()
        grid_positions[b, :n] = torch.tensor(s.positions())
        slots += range(b * max_len, b * max_len + n)
    return _Packed(
        tokens=torch.tensor(tokens),
        positions=torch.tensor(positions),
        slots=torch.tensor(slots),
        mask=mask,
        batch=len(seqs),
        max_len=max_len,
        grid_positions=grid_positions,
    )


def apply_linear(
    linear: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, max_rows: int | None
) -> torch.Tensor:
    """linear(x), fed at most `max_rows` rows per call when set.

    Row-capped calls reproduce the numerics of small serving steps: the `auto` format switches
    kernels on the number of rows per call, so capping the rows evaluates its decode path.
    """
    if max_rows is None or x.shape[0] <= max_rows:
        return linear(x)
    return torch.cat([linear(chunk) for chunk in x.split(max_rows)])


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, p: _Packed
) -> torch.Tensor:
    """q [rows, hq, d], k/v [rows, hq, d] (GQA already expanded) -> [rows, hq * d]."""

    def padded(x: torch.Tensor) -> torch.Tensor:
        grid = x.new_zeros(p.batch * p.max_len, *x.shape[1:])
        grid[p.slots] = x
        return grid.view(p.batch, p.max_len, *x.shape[1:]).transpose(1, 2)  # [B, h, T, d]

    out = F.scaled_dot_product_attention(
        padded(q), padded(k), padded(v), attn_mask=mask, scale=scale
    )
    return out.transpose(1, 2).reshape(p.batch * p.max_len, -1)[p.slots]


@torch.inference_mode()
def forward_hidden(
    model: LlamaModel, seqs: Sequence[BranchedSequence], max_linear_rows: int | None = None
) -> list[torch.Tensor]:
    """Final-norm hidden states, one [num_rows, hidden] tensor per sequence: the model's own
    decoder (every family's extras included), with dense masked attention over the batch."""
    group = model.config.gqa_group
    p = _pack(seqs)
    masks: dict[int, torch.Tensor] = {}

    def attend(q, k, v, index: int, window: int | None) -> torch.Tensor:
        if window is not None and window not in masks:
            masks[window] = p.window_mask(window)
        mask = p.mask if window is None else masks[window]
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        return _attend(q, k, v, mask, model.scale, p)

    def linear(matrix, rows: torch.Tensor) -> torch.Tensor:
        return apply_linear(matrix, rows, max_linear_rows)

    hidden = model.hidden_states(p.tokens, p.positions, model.layers, attend, linear)
    return list(hidden.split([s.num_rows for s in seqs]))


def head_logits(model: LlamaModel, hidden: torch.Tensor, max_rows: int | None) -> torch.Tensor:
    """Logits as the served model computes them: its head, then its soft-cap (Gemma)."""
    logits = apply_linear(model.lm_head, hidden, max_rows)
    cap = model.config.final_softcap
    return logits if cap is None else cap * torch.tanh(logits / cap)


def length_batches(seqs: Sequence[BranchedSequence], max_rows: int) -> list[list[int]]:
    """Indices of `seqs` grouped into batches of similar length, each padded batch holding at
    most `max_rows` rows (a longer sequence gets a batch of its own)."""
    order = sorted(range(len(seqs)), key=lambda i: seqs[i].num_rows)
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        # Sorted ascending, so the newest sequence sets the padded length of the batch.
        if current and (len(current) + 1) * seqs[i].num_rows > max_rows:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches
