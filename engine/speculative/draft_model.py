"""A small dense Llama decoder for drafting, cut out of the target and then distilled.

Why this shape (and not an EAGLE head): the engine's runner does not expose the target's hidden
states, so the draft must stand alone and see only token ids. On the 2-core CPU a target step
reads ~540 MB of fp32 weights (~20-40 ms); the draft must make k=4-8 guesses in a small fraction
of that, so it keeps the target's width (its layers can then start as copies of target layers,
which is what makes minutes of distillation enough) but only 1-2 layers, and a *reduced
vocabulary*: the N most frequent tokens of the target's own outputs. A full 49152-row output
head alone would cost as much as ~8 target layers per guess; N=4096 rows cost a tenth of that.
Measured (1 thread, busy shared machine): 2 layers + 3.7k rows propose a token in ~4.7 ms
against ~121 ms for one fp32 target decode step, i.e. ~4% of a step per guess.
The draft's q is zero outside its vocabulary, which keeps rejection sampling exact (the verifier
simply never accepts what q cannot propose). Input ids outside the vocabulary share one learned
"unknown" row. Input and output embeddings are tied, as in the target, to halve the file.

The same module, built with every layer and the full vocabulary, is the *teacher* the trainer
generates with: one dense batched implementation serves both (see draft_data.py).

Layout: batched [B, heads, T, head_dim]; a dense per-batch KV cache (`BatchKV`) where row b
holds positions [0, len_b) and a step writes at positions start_b + t (so rows of different
lengths share one tensor, and padding past a row's end is simply never attended).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.fp32_gemm import aligned, fp32_linear, register
from engine.model.gguf_file import Checkpoint
from engine.model.layers import rms_norm
from engine.model.rope import RotaryEmbedding


@dataclass(frozen=True)
class DraftConfig:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    vocab_size: int  # output rows (draft vocabulary); the input table has one more (unknown)
    rope_theta: float
    rms_norm_eps: float
    max_position: int
    source_layers: tuple[int, ...]  # which target layers the draft layers started from
    tied: bool = True  # the output head is the input table's first vocab_size rows

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> DraftConfig:
        data = dict(data)
        data["source_layers"] = tuple(data["source_layers"])
        return cls(**data)


class BatchKV:
    """A draft's KV cache for B rows, `capacity` positions each.

    One fp32 tensor [B, layers, 2, capacity, kv_heads, head_dim] holds it: the native step's
    paged layout (decode_step.c) with one block per row as large as the row's capacity, so a
    draft head's layer can run in that library on this very memory (head_native.py). `keys`
    and `values` are per-layer [B, kv_heads, capacity, head_dim] views of it, which the torch
    path indexes and writes through.
    """

    def __init__(self, storage: torch.Tensor):
        if storage.dim() != 6 or storage.shape[2] != 2:
            raise ValueError(
                f"a draft KV cache is [B, layers, 2, S, kv_heads, d], not {storage.shape}"
            )
        self.storage = storage
        layers = storage.shape[1]
        self.keys = [storage[:, i, 0].transpose(1, 2) for i in range(layers)]
        self.values = [storage[:, i, 1].transpose(1, 2) for i in range(layers)]

    @classmethod
    def empty(cls, config: DraftConfig, batch: int, capacity: int) -> BatchKV:
        c = config
        return cls(torch.zeros(batch, c.num_layers, 2, capacity, c.num_kv_heads, c.head_dim))

    @property
    def batch(self) -> int:
        return self.storage.shape[0]

    @property
    def capacity(self) -> int:
        return self.storage.shape[3]

    def grown(self, config: DraftConfig, capacity: int, keep: int) -> BatchKV:
        """This cache with room for `capacity` positions (doubling), its first `keep` kept."""
        if capacity <= self.capacity:
            return self
        grown = BatchKV.empty(config, self.batch, max(capacity, 2 * self.capacity))
        grown.storage[:, :, :, :keep] = self.storage[:, :, :, :keep]
        return grown

    def select(self, rows: torch.Tensor) -> BatchKV:
        """A copy holding only these batch rows."""
        return BatchKV(self.storage[rows])


def gather_kv(
    config: DraftConfig, caches: list[BatchKV], lengths: list[int], capacity: int
) -> BatchKV:
    """Batch-of-one caches -> one padded batch cache holding each one's first lengths[b]."""
    kv = BatchKV.empty(config, len(caches), capacity)
    for row, (cache, n) in enumerate(zip(caches, lengths, strict=True)):
        kv.storage[row, :, :, :n] = cache.storage[0, :, :, :n]
    return kv


def scatter_kv(kv: BatchKV, caches: list[BatchKV], spans: list[tuple[int, int]]) -> None:
    """Copy positions [start, end) of batch row b back into caches[b] (the inverse of gather)."""
    for row, (cache, (start, end)) in enumerate(zip(caches, spans, strict=True)):
        cache.storage[0, :, :, start:end] = kv.storage[row, :, :, start:end]


class Projection(nn.Linear):
    """A bias-free nn.Linear that, once `serve()`d, multiplies through the chosen fp32 GEMM call
    when no gradient is wanted: a draft's few rows a step then take the call measured fastest here
    (on an AVX2 EPYC torch's MKL ran a 1-row product at half the native kernel's rate), and
    training keeps autograd's plain path."""

    routed = False

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    def serve(self) -> None:
        with torch.no_grad():
            self.weight.data = aligned(self.weight.data.float())
        register(self.weight.data)
        self.routed = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.routed and not torch.is_grad_enabled() and x.dtype == torch.float32:
            flat = fp32_linear(x.reshape(-1, x.shape[-1]), self.weight)
            return flat.view(*x.shape[:-1], self.out_features)
        return super().forward(x)


def serve_projections(module: nn.Module) -> None:
    """Route every Projection of `module` (see Projection.serve); inference only."""
    for part in module.modules():
        if isinstance(part, Projection):
            part.serve()


class DecoderLayer(nn.Module):
    """One Llama decoder layer's weights (Q/K/V and gate/up fused), as the draft holds them."""

    def __init__(self, c: DraftConfig):
        super().__init__()
        d = c.head_dim
        self.input_norm = nn.Parameter(torch.ones(c.hidden_size))
        self.qkv = Projection(c.hidden_size, (c.num_heads + 2 * c.num_kv_heads) * d)
        self.o_proj = Projection(c.num_heads * d, c.hidden_size)
        self.post_attention_norm = nn.Parameter(torch.ones(c.hidden_size))
        self.gate_up = Projection(c.hidden_size, 2 * c.intermediate_size)
        self.down = Projection(c.intermediate_size, c.hidden_size)


class DraftModel(nn.Module):
    def __init__(self, config: DraftConfig):
        super().__init__()
        self.config = config
        c = config
        self.embed = nn.Parameter(torch.zeros(c.vocab_size + 1, c.hidden_size))
        self.head = None if c.tied else nn.Parameter(torch.zeros(c.vocab_size, c.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_layers))
        self.norm = nn.Parameter(torch.ones(c.hidden_size))
        self.rope = RotaryEmbedding(c.head_dim, c.rope_theta, c.max_position, torch.device("cpu"))

    @property
    def head_weight(self) -> torch.Tensor:
        return self.embed[: self.config.vocab_size] if self.head is None else self.head

    def forward(
        self, ids: torch.Tensor, start: torch.Tensor | None = None, kv: BatchKV | None = None
    ) -> torch.Tensor:
        """ids [B, T] draft ids -> final-norm hidden [B, T, hidden].

        Without `kv`: plain causal attention over the T tokens (training). With `kv`: row b's
        tokens sit at positions start[b] + t; their K/V are written there and each attends to
        every cached position at or before its own.
        """
        c = self.config
        b, t = ids.shape
        offsets = torch.arange(t)
        positions = offsets[None, :].expand(b, t) if start is None else start[:, None] + offsets
        x = self.embed[ids]
        for index, layer in enumerate(self.layers):
            x = decoder_layer(layer, c, self.rope, x, positions, kv, index)
        return rms_norm(x, self.norm, c.rms_norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.head_weight)


def decoder_layer(
    layer: DecoderLayer,
    c: DraftConfig,
    rope: RotaryEmbedding,
    x: torch.Tensor,
    positions: torch.Tensor,
    kv: BatchKV | None,
    index: int,
) -> torch.Tensor:
    """x [B, T, hidden] through one layer. Without `kv`: plain causal attention over the T
    tokens. With `kv`: row b's token t sits at cache position positions[b, t]; its K/V are
    written there and it attends to every cached position at or before its own."""
    b = x.shape[0]
    q, k, v = layer_qkv(layer, c, rope, x, positions)
    if kv is None:
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    else:
        used = int(positions.max()) + 1
        rows = torch.arange(b)[:, None]
        mask = (torch.arange(used)[None, None, :] <= positions[:, :, None])[:, None]
        keys, values = kv.keys[index], kv.values[index]
        keys[rows, :, positions] = k.transpose(1, 2).to(keys.dtype)
        values[rows, :, positions] = v.transpose(1, 2).to(values.dtype)
        attn = cached_attention(q, keys[:, :, :used], values[:, :, :used], mask)
    return layer_out(layer, c, x, attn)


def layer_qkv(
    layer: DecoderLayer, c: DraftConfig, rope: RotaryEmbedding, x: torch.Tensor, positions
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layer's rotated queries [B, hq, T, d] and keys, and values [B, hkv, T, d]."""
    b, t, _ = x.shape
    hq, hkv, d = c.num_heads, c.num_kv_heads, c.head_dim
    cos = rope.cos[positions][:, None]  # [B, 1, T, d]
    sin = rope.sin[positions][:, None]
    h = rms_norm(x, layer.input_norm, c.rms_norm_eps)
    qkv = layer.qkv(h).view(b, t, hq + 2 * hkv, d).transpose(1, 2)
    qk = RotaryEmbedding.apply(qkv[:, : hq + hkv], cos, sin)
    return qk[:, :hq], qk[:, hq:], qkv[:, hq + hkv :]


def layer_out(
    layer: DecoderLayer, c: DraftConfig, x: torch.Tensor, attn: torch.Tensor
) -> torch.Tensor:
    """The residual stream after the layer, given its attention output [B, hq, T, d]."""
    b, t, _ = x.shape
    x = x + layer.o_proj(attn.transpose(1, 2).reshape(b, t, c.num_heads * c.head_dim))
    h = rms_norm(x, layer.post_attention_norm, c.rms_norm_eps)
    gate, up = layer.gate_up(h).chunk(2, dim=-1)
    return x + layer.down(F.silu(gate) * up)


def cached_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """q [B, hq, T, d], keys/values [B, hkv, S, d], mask [B, 1, T, S] -> [B, hq, T, d].

    Spelled out: torch's CPU SDPA with a mask and GQA was measured 4x slower at B=16, T=1 than
    this (it has no fast path for few queries); grouping the query heads that share a KV head
    into the row dimension turns GQA into two plain batched matmuls.
    """
    b, hq, t, d = q.shape
    hkv, s = keys.shape[1], keys.shape[2]
    g = hq // hkv
    scores = (q.reshape(b, hkv, g * t, d) @ keys.transpose(-1, -2)).view(b, hkv, g, t, s)
    scores = scores.mul_(d**-0.5).masked_fill_(~mask[:, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(b, hkv, g * t, s)
    return (probs @ values).view(b, hq, t, d)


def model_from_checkpoint(
    checkpoint: Checkpoint, source_layers: tuple[int, ...], vocab_ids: torch.Tensor | None
) -> DraftModel:
    """Copy target layers `source_layers` (and the embedding rows `vocab_ids`, or all rows when
    None, which with every layer gives the full target as a teacher) into a DraftModel."""
    tc = checkpoint.config
    t = checkpoint.tensors
    rows = vocab_ids if vocab_ids is not None else torch.arange(tc.vocab_size)
    tied = tc.tie_embeddings or vocab_ids is not None
    config = DraftConfig(
        hidden_size=tc.hidden_size,
        intermediate_size=tc.intermediate_size,
        num_heads=tc.num_heads,
        num_kv_heads=tc.num_kv_heads,
        head_dim=tc.head_dim,
        num_layers=len(source_layers),
        vocab_size=len(rows),
        rope_theta=tc.rope_theta,
        rms_norm_eps=tc.rms_norm_eps,
        max_position=tc.max_position,
        source_layers=tuple(source_layers),
        tied=tied,
    )
    model = DraftModel(config)
    with torch.no_grad():
        embed = t["embed_tokens"][rows]
        # The unknown row starts as the mean embedding: a neutral "some other word".
        model.embed.copy_(torch.cat([embed, embed.mean(0, keepdim=True)]))
        if model.head is not None:
            model.head.copy_(t["lm_head"][rows])
        model.norm.copy_(t["norm"])
        for layer, src in zip(model.layers, source_layers, strict=True):
            copy_target_layer(layer, t, src)
    return model


@torch.no_grad()
def copy_target_layer(layer: DecoderLayer, t: dict[str, torch.Tensor], src: int) -> None:
    """Set `layer` to target layer `src` of checkpoint tensors `t`."""
    p = f"layers.{src}."
    layer.input_norm.copy_(t[p + "input_norm"])
    layer.post_attention_norm.copy_(t[p + "post_attention_norm"])
    layer.qkv.weight.copy_(torch.cat([t[p + n] for n in ("q_proj", "k_proj", "v_proj")]))
    layer.o_proj.weight.copy_(t[p + "o_proj"])
    layer.gate_up.weight.copy_(torch.cat([t[p + "gate_proj"], t[p + "up_proj"]]))
    layer.down.weight.copy_(t[p + "down_proj"])
