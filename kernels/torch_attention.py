"""Torch reference paged attention: the CPU engine's path and the Triton kernels' oracle.

Sequences with few new tokens (decode, speculative verify) are attended as one padded batch;
each long prefill chunk is attended on its own so that a 512-token chunk never pads 31 decode
rows up to 512 queries. Grouped-query attention folds each KV head's query heads into the query
length (`[B, kv_heads, q_len * group, D]`), so K/V are never repeated in memory.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from kernels.attention_kernel import AttentionKernel, write_kv
from kernels.attention_metadata import AttentionMetadata, tree_depths, tree_visibility
from kernels.serial_ops import serial_ops

# Sequences with at most this many new tokens share the padded batch.
BATCHED_MAX_QUERY = 16
# A sequence joins a context bucket if its context is at most 2x the bucket's shortest + this.
BUCKET_SLACK = 64


@dataclass
class _BatchedGroup:
    token_index: torch.Tensor  # [B, q_max] flat token index (padding points at token 0)
    valid: torch.Tensor  # [B, q_max] bool
    # The valid entries as flat indices: into [B * q_max] (`padded_rows`) and the step's
    # tokens (`valid_tokens`), so that each layer moves queries and outputs with
    # index_select / index_copy_ rather than boolean-mask indexing.
    padded_rows: torch.Tensor
    valid_tokens: torch.Tensor
    block_table: torch.Tensor  # [B, max_blocks]
    mask: torch.Tensor  # [B, 1, q_max, 1, ctx_max] bool: query may see key
    q_pos: torch.Tensor  # [B, q_max] absolute position of each query (padding: ctx_max)
    ctx_max: int
    all_keys_visible: bool  # decode rows of equal context: no masking needed at all
    in_order: bool  # one token per row, rows are flat tokens 0..B-1
    # Every row brings q_max tokens and row b's are flat tokens b * q_max ..: a verify step's
    # rows. Queries and outputs are then views of the step's tensors, not gathers and
    # scatters (on a 9-row verify of SmolLM2 the index ops were 6 ms of a 57 ms step).
    dense: bool = False
    # The mask as SDPA takes it, [B, 1, q_max * group, ctx_max] ([B, 1, 1, ctx_max] for
    # decode rows), additive (0 or -inf) in the queries' dtype: built once per step, not per
    # layer (see _sdpa_mask).
    sdpa_mask: torch.Tensor | None = None


@dataclass
class _SingleSeq:
    start: int
    q_len: int
    ctx: int
    block_table: torch.Tensor  # [num_blocks]
    mask: torch.Tensor | None  # [q_len, 1, ctx] bool, None when q_len == 1


def _causal_mask(
    q_len: int, ctx: int, device: torch.device, window: int | None = None
) -> torch.Tensor:
    """Query i (absolute position ctx - q_len + i) sees keys 0..ctx - q_len + i, or with a
    sliding window only the `window` most recent of them (itself included)."""
    q_pos = torch.arange(ctx - q_len, ctx, device=device)[:, None]
    k_pos = torch.arange(ctx, device=device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask


def _windowed(group: _BatchedGroup, window: int) -> torch.Tensor:
    """The group's mask narrowed to a sliding window; padding rows keep their key 0. Keys are
    slot positions, which a draft tree's nodes do not occupy in order: the speculator never
    drafts trees for a model with sliding-window layers."""
    k_pos = torch.arange(group.ctx_max, device=group.mask.device)
    q_pos = group.q_pos[:, None, :, None, None]
    inside = k_pos > q_pos - window
    padding = ~group.valid[:, None, :, None, None]
    return group.mask & (inside | padding)


class TorchPagedAttention(AttentionKernel):
    name = "torch"
    supports_trees = True

    def prepare(self, meta: AttentionMetadata) -> None:
        if meta.has_trees and any(
            q > BATCHED_MAX_QUERY
            for q, t in zip(meta.query_lens, meta.trees or [], strict=True)
            if t
        ):
            raise ValueError(f"a draft tree has at most {BATCHED_MAX_QUERY - 1} nodes")
        starts = [0]
        for q in meta.query_lens:
            starts.append(starts[-1] + q)
        batched = [i for i, q in enumerate(meta.query_lens) if q <= BATCHED_MAX_QUERY]
        singles = [i for i, q in enumerate(meta.query_lens) if q > BATCHED_MAX_QUERY]
        # Every sequence brings exactly one token and all share one bucket: the flat tokens
        # are the batch rows in order, so the gather/scatter of queries can be skipped.
        # Within a bucket, rows in flat order: a lone bucket of equal query lengths is dense.
        buckets = [sorted(b) for b in _context_buckets(batched, meta.context_lens)]
        groups = [_batched_group(b, meta, starts) for b in buckets]
        decode_only = len(groups) == 1 and not singles and groups[0].in_order
        dense = len(groups) == 1 and not singles and groups[0].dense and not decode_only
        state: dict = {
            "groups": groups,
            "singles": [],
            "decode_only": decode_only,
            "dense": dense,
        }
        dev = meta.device
        for i in singles:
            q_len, ctx = meta.query_lens[i], meta.context_lens[i]
            n_blocks = (ctx + meta.block_size - 1) // meta.block_size
            state["singles"].append(
                _SingleSeq(
                    start=starts[i],
                    q_len=q_len,
                    ctx=ctx,
                    block_table=torch.tensor(meta.block_tables[i][:n_blocks], device=dev),
                    mask=_causal_mask(q_len, ctx, dev)[:, None, :],
                )
            )
        meta.kernel_state["torch"] = state

    def forward(self, q, k, v, key_cache, value_cache, meta, scale, window=None):
        if "torch" not in meta.kernel_state:
            self.prepare(meta)
        with serial_ops(k.shape[0]):  # see serial_ops.py: a few rows' KV, threads asleep
            write_kv(k, v, key_cache, value_cache, meta)
        state = meta.kernel_state["torch"]
        if window is not None:
            state = self._window_state(state, window, meta.device)
        num_heads, head_dim = q.shape[1], q.shape[2]
        kv_heads = key_cache.shape[2]
        group = group_size = num_heads // kv_heads
        out = torch.empty_like(q)
        if state["decode_only"]:
            (group,) = state["groups"]
            return self._decode_only(q, key_cache, value_cache, group, scale, kv_heads, group_size)
        if state["dense"]:
            (group,) = state["groups"]
            return self._dense(q, key_cache, value_cache, group, scale, kv_heads, group_size)
        for batched in state["groups"]:
            bsz, q_max = batched.token_index.shape
            keys = _gather(key_cache, batched.block_table, batched.ctx_max)  # [B, Hkv, L, D]
            values = _gather(value_cache, batched.block_table, batched.ctx_max)
            queries = q.index_select(0, batched.token_index.view(-1))
            queries = queries.view(bsz, q_max, kv_heads, group_size, head_dim)
            queries = queries.permute(0, 2, 1, 3, 4).reshape(
                bsz, kv_heads, q_max * group_size, head_dim
            )
            mask = _sdpa_mask(batched, group_size, q.dtype)
            attn = F.scaled_dot_product_attention(
                queries, keys, values, attn_mask=mask, scale=scale
            )
            attn = attn.view(bsz, kv_heads, q_max, group_size, head_dim).permute(0, 2, 1, 3, 4)
            attn = attn.reshape(bsz * q_max, num_heads, head_dim)
            out.index_copy_(0, batched.valid_tokens, attn.index_select(0, batched.padded_rows))
        for seq in state["singles"]:
            keys = _gather(key_cache, seq.block_table[None], seq.ctx)
            values = _gather(value_cache, seq.block_table[None], seq.ctx)
            queries = q[seq.start : seq.start + seq.q_len].view(
                seq.q_len, kv_heads, group, head_dim
            )
            queries = queries.permute(1, 0, 2, 3).reshape(1, kv_heads, seq.q_len * group, head_dim)
            mask = seq.mask.expand(seq.q_len, group, seq.ctx).reshape(
                1, 1, seq.q_len * group, seq.ctx
            )
            attn = F.scaled_dot_product_attention(
                queries, keys, values, attn_mask=mask, scale=scale
            )
            attn = attn.view(kv_heads, seq.q_len, group, head_dim).permute(1, 0, 2, 3)
            out[seq.start : seq.start + seq.q_len] = attn.reshape(seq.q_len, num_heads, head_dim)
        return out

    @staticmethod
    def _window_state(state: dict, window: int, device: torch.device) -> dict:
        """The step's state with masks narrowed to `window`, built once per step and window
        (every sliding layer of the step shares it)."""
        cache = state.setdefault("windows", {})
        if window not in cache:
            groups = [
                replace(g, mask=_windowed(g, window), all_keys_visible=False, sdpa_mask=None)
                for g in state["groups"]
            ]
            singles = [
                replace(s, mask=_causal_mask(s.q_len, s.ctx, device, window)[:, None, :])
                for s in state["singles"]
            ]
            cache[window] = {**state, "groups": groups, "singles": singles}
        return cache[window]

    @staticmethod
    def _dense(q, key_cache, value_cache, batched, scale, kv_heads, group):
        tokens, num_heads, head_dim = q.shape
        bsz, q_max = batched.token_index.shape
        keys = _gather(key_cache, batched.block_table, batched.ctx_max)  # [B, Hkv, L, D]
        values = _gather(value_cache, batched.block_table, batched.ctx_max)
        queries = q.view(bsz, q_max, kv_heads, group, head_dim).permute(0, 2, 1, 3, 4)
        queries = queries.reshape(bsz, kv_heads, q_max * group, head_dim)
        mask = _sdpa_mask(batched, group, q.dtype)
        attn = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)
        attn = attn.view(bsz, kv_heads, q_max, group, head_dim).permute(0, 2, 1, 3, 4)
        return attn.reshape(tokens, num_heads, head_dim)

    @staticmethod
    def _decode_only(q, key_cache, value_cache, batched, scale, kv_heads, group):
        bsz, num_heads, head_dim = q.shape
        keys = _gather(key_cache, batched.block_table, batched.ctx_max)
        values = _gather(value_cache, batched.block_table, batched.ctx_max)
        queries = q.view(bsz, kv_heads, group, head_dim)
        mask = None if batched.all_keys_visible else _sdpa_mask(batched, 1, q.dtype)
        attn = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)
        return attn.reshape(bsz, num_heads, head_dim)


def _sdpa_mask(batched: _BatchedGroup, group: int, dtype: torch.dtype) -> torch.Tensor:
    """The group's mask as SDPA takes it, each query row repeated for the `group` query heads
    folded into it, as an additive mask (0 where a key is seen, -inf where not): given a
    bool mask, SDPA converts it to exactly that in every call, i.e. in every layer. Measured
    on a 2-core AVX-512 EPYC, a verify step of 8 rows of 9 queries (3 KV heads, 320 keys):
    26.6 ms for 30 calls with the bool mask, 23.5 with the additive one, the same bits."""
    mask = batched.sdpa_mask
    bsz, _, q_max, _, ctx = batched.mask.shape
    if mask is None or mask.shape[2] != q_max * group or mask.dtype != dtype:
        seen = batched.mask.expand(bsz, 1, q_max, group, ctx).reshape(bsz, 1, q_max * group, ctx)
        mask = torch.zeros(seen.shape, dtype=dtype, device=seen.device)
        mask.masked_fill_(~seen, float("-inf"))
        batched.sdpa_mask = mask
    return mask


def _context_buckets(rows: list[int], context_lens: list[int]) -> list[list[int]]:
    """Group sequences of similar context length: a padded batch costs B x the longest
    context, so one 2,000-token conversation must not make 30 short ones pay for 2,000 keys."""
    buckets: list[list[int]] = []
    for i in sorted(rows, key=lambda r: context_lens[r]):
        if buckets and context_lens[i] <= 2 * context_lens[buckets[-1][0]] + BUCKET_SLACK:
            buckets[-1].append(i)
        else:
            buckets.append([i])
    return buckets


def _batched_group(rows: list[int], meta: AttentionMetadata, starts: list[int]) -> _BatchedGroup:
    q_max = max(meta.query_lens[i] for i in rows)
    ctx_max = max(meta.context_lens[i] for i in rows)
    blocks_max = (ctx_max + meta.block_size - 1) // meta.block_size
    token_index = torch.zeros((len(rows), q_max), dtype=torch.long)
    valid = torch.zeros((len(rows), q_max), dtype=torch.bool)
    table = torch.zeros((len(rows), blocks_max), dtype=torch.long)
    mask = torch.zeros((len(rows), q_max, ctx_max), dtype=torch.bool)
    q_pos = torch.full((len(rows), q_max), ctx_max, dtype=torch.long)
    for row, i in enumerate(rows):
        q_len, ctx = meta.query_lens[i], meta.context_lens[i]
        token_index[row, :q_len] = torch.arange(starts[i], starts[i] + q_len)
        valid[row, :q_len] = True
        q_pos[row, :q_len] = torch.arange(ctx - q_len, ctx)
        used = meta.block_tables[i][: (ctx + meta.block_size - 1) // meta.block_size]
        table[row, : len(used)] = torch.tensor(used, dtype=torch.long)
        tree = meta.tree(i)
        if tree is None:
            mask[row, :q_len, :ctx] = _causal_mask(q_len, ctx, torch.device("cpu"))
        else:
            # The context before the first query token, then the tree's own ancestry. The
            # ancestors' keys keep their order (parents precede children), as a chain's do.
            mask[row, :q_len, : ctx - q_len] = True
            mask[row, :q_len, ctx - q_len : ctx] = tree_visibility(tree)
            q_pos[row, 1:q_len] = ctx - q_len + torch.tensor(tree_depths(tree))
        # Padding query rows see key 0 so softmax stays finite; their output is dropped.
        mask[row, q_len:, 0] = True
    dev = meta.device
    padded_rows = valid.view(-1).nonzero().view(-1)
    return _BatchedGroup(
        token_index=token_index.to(dev),
        valid=valid.to(dev),
        padded_rows=padded_rows.to(dev),
        valid_tokens=token_index.view(-1)[padded_rows].to(dev),
        block_table=table.to(dev),
        mask=mask[:, None, :, None, :].to(dev),
        q_pos=q_pos.to(dev),
        ctx_max=ctx_max,
        all_keys_visible=q_max == 1 and all(meta.context_lens[i] == ctx_max for i in rows),
        in_order=[starts[i] for i in rows] == list(range(len(rows))) and q_max == 1,
        dense=[starts[i] for i in rows] == list(range(0, len(rows) * q_max, q_max))
        and all(meta.query_lens[i] == q_max for i in rows)
        and len(rows) * q_max == starts[-1],
    )


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """[B, blocks] block ids -> [B, kv_heads, length, head_dim] contiguous keys or values."""
    bsz, n_blocks = block_table.shape
    _, block_size, kv_heads, head_dim = cache.shape
    # index_select, not advanced indexing: on the strided block-major view it is ~5x faster
    # (a row-copy path instead of per-element index arithmetic; measured 13 vs 67 us). Both
    # threads: one alone lost 3-4% of an eight-sequence step's tokens/s (kernels/serial_ops.py).
    gathered = cache.index_select(0, block_table.reshape(-1))
    gathered = gathered.view(bsz, n_blocks * block_size, kv_heads, head_dim)
    return gathered[:, :length].transpose(1, 2).to(torch.float32)
