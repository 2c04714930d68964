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

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shared.model.layers import rms_norm
from shared.model.linear import Linear
from shared.model.llama import LlamaModel
from shared.model.rope import RotaryEmbedding


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


def _pack(seqs: Sequence[BranchedSequence]) -> _Packed:
    max_len = max(s.num_rows for s in seqs)
    mask = torch.zeros(len(seqs), 1, max_len, max_len, dtype=torch.bool)
    # Padding rows attend to themselves only, so their softmax stays finite; they are dropped.
    mask[:, 0] = torch.eye(max_len, dtype=torch.bool)
    tokens: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    for b, s in enumerate(seqs):
        n = s.num_rows
        mask[b, 0, :n, :n] = s.attention_mask()
        tokens += [*s.trunk, *(t for branch in s.branches for t in branch)]
        positions += s.positions()
        slots += range(b * max_len, b * max_len + n)
    return _Packed(
        tokens=torch.tensor(tokens),
        positions=torch.tensor(positions),
        slots=torch.tensor(slots),
        mask=mask,
        batch=len(seqs),
        max_len=max_len,
    )


def apply_linear(linear: Linear, x: torch.Tensor, max_rows: int | None) -> torch.Tensor:
    """linear(x), fed at most `max_rows` rows per call when set.

    Row-capped calls reproduce the numerics of small serving steps: the `auto` format switches
    kernels on the number of rows per call, so capping the rows evaluates its decode path.
    """
    if max_rows is None or x.shape[0] <= max_rows:
        return linear(x)
    return torch.cat([linear(chunk) for chunk in x.split(max_rows)])


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: _Packed) -> torch.Tensor:
    """q [rows, hq, d], k/v [rows, hq, d] (GQA already expanded) -> [rows, hq * d]."""

    def padded(x: torch.Tensor) -> torch.Tensor:
        grid = x.new_zeros(p.batch * p.max_len, *x.shape[1:])
        grid[p.slots] = x
        return grid.view(p.batch, p.max_len, *x.shape[1:]).transpose(1, 2)  # [B, h, T, d]

    out = F.scaled_dot_product_attention(padded(q), padded(k), padded(v), attn_mask=p.mask)
    return out.transpose(1, 2).reshape(p.batch * p.max_len, -1)[p.slots]


@torch.inference_mode()
def forward_hidden(
    model: LlamaModel, seqs: Sequence[BranchedSequence], max_linear_rows: int | None = None
) -> list[torch.Tensor]:
    """Final-norm hidden states, one [num_rows, hidden] tensor per sequence."""
    cfg = model.config
    if not cfg.is_plain_llama:
        # This dense re-implementation spells out Llama's layer only; a family's extras
        # (biases, windows, experts) would be silently skipped.
        raise ValueError(f"the dense forward runs Llama's layout only, not '{cfg.architecture}'")
    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    p = _pack(seqs)
    n = p.tokens.shape[0]
    cos, sin = model.rope.tables(p.positions)
    x = model.embed_tokens[p.tokens]
    for layer in model.layers:
        h = rms_norm(x, layer.input_norm, cfg.rms_norm_eps)
        qkv = apply_linear(layer.qkv, h, max_linear_rows)
        q = RotaryEmbedding.apply(qkv[:, : hq * d].view(n, hq, d), cos, sin)
        k = RotaryEmbedding.apply(qkv[:, hq * d : (hq + hkv) * d].view(n, hkv, d), cos, sin)
        v = qkv[:, (hq + hkv) * d :].view(n, hkv, d)
        k = k.repeat_interleave(cfg.gqa_group, dim=1)
        v = v.repeat_interleave(cfg.gqa_group, dim=1)
        x = x + apply_linear(layer.o_proj, _attend(q, k, v, p), max_linear_rows)
        h = rms_norm(x, layer.post_attention_norm, cfg.rms_norm_eps)
        gu = apply_linear(layer.gate_up, h, max_linear_rows)
        inter = cfg.intermediate_size
        x = x + apply_linear(layer.down, F.silu(gu[:, :inter]) * gu[:, inter:], max_linear_rows)
    hidden = rms_norm(x, model.norm, cfg.rms_norm_eps)
    return list(hidden.split([s.num_rows for s in seqs]))


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
