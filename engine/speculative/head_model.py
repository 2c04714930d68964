"""The draft head: one decoder layer over the target's own hidden states (EAGLE-style).

Why this family (and not Medusa or a standalone draft): the standalone draft (draft_model.py)
sees token ids only and must rebuild in 1-2 layers what the target's 30 layers already know;
measured, it loses on its own (0.59x on chat). The target's last hidden state at position t
already encodes everything that decides token t+1 and most of t+2. Medusa reads that state
with k independent heads, each guessing position t+i blind to the guesses before it;
EAGLE feeds one small layer the state *and the embedding of the token actually chosen*, and
chains its own predicted state forward, so guess i is conditioned on guesses < i. For a chain
of k proposals that conditioning is what keeps acceptance up past the first token.

Which hidden state: the target's *final-normed* state (what the output head reads), not the
pre-norm residual. Both the torch path and the native C step (kernels/native/decode_step.c
applies the final norm inside `ss_forward`) already return exactly that tensor for every
computed row, so the head costs no second forward and no change to the native ABI. The
final norm only rescales each row by one scalar (and a fixed per-channel weight): no token
information is lost, and a chained prediction lives in the same space the target's head reads,
so the head's logits are the target head applied to it.

Input at cache position i (sequence position t): fc([embed(x_{t+1}); h_t]) -> DecoderLayer ->
RMSNorm -> f_{t+1}, a prediction of h_{t+1}; logits of x_{t+2} = head_rows @ f_{t+1}. The token
embedding is the target's (shared, not stored in the head file); the output head is the
target's own head restricted to the `vocab_ids` most frequent tokens (4,096 of SmolLM2's
49,152: a full-vocabulary head per guess would read as many bytes as ~8 target layers).
Neither shared matrix is trained or saved: both are handed in from the target at load time.

Serving runs the whole step (fc, layer, norm) and the logits in the native library where it
builds (head_native.py, Q8_0 weights), and through torch where it does not; training always
runs in torch.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from engine.model.embedding import TokenEmbedding
from engine.model.fp32_gemm import aligned, fp32_linear, register
from engine.model.llama import RotaryEmbedding, rms_norm
from engine.speculative.draft_model import (
    BatchKV,
    DecoderLayer,
    DraftConfig,
    Projection,
    cached_attention,
    copy_target_layer,
    decoder_layer,
    layer_out,
    layer_qkv,
    serve_projections,
)
from engine.speculative.head_native import HEAD_WEIGHTS, HeadParts, NativeHeadLayer, WeightFormat

# The target's token embedding: a tensor, or the serving model's (maybe Q8_0) table.
TargetEmbedding = TokenEmbedding | torch.Tensor


class DraftHead(nn.Module):
    """Trainable parts: `fc`, one `layer`, `norm`. `embed` [V, H] and `head_rows` [N, H] are
    the target's, set by `attach_target` (non-persistent: never in the state dict)."""

    def __init__(self, config: DraftConfig):
        super().__init__()
        if config.num_layers != 1:
            raise ValueError(f"a draft head has one decoder layer, not {config.num_layers}")
        self.config = config
        h = config.hidden_size
        self.fc = Projection(2 * h, h)
        self.layer = DecoderLayer(config)
        self.norm = nn.Parameter(torch.ones(h))
        self.rope = RotaryEmbedding(
            config.head_dim, config.rope_theta, config.max_position, torch.device("cpu")
        )
        # The target's token embedding, looked up by target id: a tensor, or the serving
        # model's TokenEmbedding (its Q8_0 blocks: shared, not copied to 108 MiB of fp32).
        self.embed: TargetEmbedding | None = None
        self.register_buffer("head_rows", torch.zeros(config.vocab_size, h), persistent=False)
        self._rows_routed = False  # see serve()
        self.native: NativeHeadLayer | None = None  # see serve()
        self.native_reason = "not serving"

    def attach_target(self, embed: TargetEmbedding, head_rows: torch.Tensor) -> None:
        if head_rows.shape != (self.config.vocab_size, self.config.hidden_size):
            raise ValueError(f"head rows {tuple(head_rows.shape)} do not fit the head's config")
        self.embed = embed.detach().float() if isinstance(embed, torch.Tensor) else embed
        self.head_rows = head_rows.detach().float().contiguous()

    def forward(
        self,
        features: torch.Tensor,
        next_ids: torch.Tensor,
        start: torch.Tensor | None = None,
        kv: BatchKV | None = None,
    ) -> torch.Tensor:
        """features [B, T, H] (target states h_t, or the head's own f for chained steps),
        next_ids [B, T] target ids x_{t+1} -> predicted next states [B, T, H].

        Without `kv`: causal attention over the T positions (training). With `kv`: row b's
        positions are cache slots start[b] + t (see draft_model.decoder_layer).
        """
        c = self.config
        b, t, _ = features.shape
        offsets = torch.arange(t)
        positions = offsets[None, :].expand(b, t) if start is None else start[:, None] + offsets
        if kv is not None and self.native is not None and not torch.is_grad_enabled():
            flat = self.native.forward(
                next_ids.reshape(-1).numpy(),
                features.reshape(b * t, -1),
                positions.reshape(-1).numpy(),
                np.repeat(np.arange(b, dtype=np.int32), t),
                kv,
            )
            return flat.view(b, t, -1)
        assert self.embed is not None, "attach_target first"
        x = self.fc(torch.cat([self.embed[next_ids].float(), features], dim=-1))
        x = decoder_layer(self.layer, c, self.rope, x, positions, kv, 0)
        return rms_norm(x, self.norm, c.rms_norm_eps)

    def forward_nodes(
        self,
        features: torch.Tensor,
        next_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        known: int | torch.Tensor,
        ancestry: torch.Tensor,
        kv: BatchKV,
        batch_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One head step for draft-tree nodes of one or several requests: node i belongs to
        batch row batch_rows[i] of `kv` (row 0 when None), feeds its parent's predicted state
        features[i] [N, H] and its own token next_ids[i], sits at RoPE position positions[i],
        writes its K/V at cache slot slots[i] (past its request's `known` true pairs; `known`
        is one count for all nodes or one per node) and attends to those true pairs and to
        the tree entries ancestry[i] [N, E] marks (its ancestors' and its own, in slots
        known .. known + E of its row). Returns the nodes' predicted states [N, H]."""
        c = self.config
        n = ancestry.shape[0]
        bases = known if isinstance(known, torch.Tensor) else torch.full((n,), known)
        rows = batch_rows if batch_rows is not None else torch.zeros(n, dtype=torch.long)
        if self.native is not None and not torch.is_grad_enabled():
            # Node i's logical positions known .. positions[i] are its path's entries, in depth
            # order (entries are numbered depth by depth, so ascending), its own last.
            width = int(ancestry.sum(1).max())
            path = bases[:, None].repeat(1, width).long()
            for row in range(n):
                entries = ancestry[row].nonzero()[:, 0]
                path[row, : len(entries)] = bases[row] + entries
            return self.native.forward(
                next_ids.numpy(),
                features,
                positions.numpy(),
                rows.numpy().astype(np.int32),
                kv,
                bases.numpy().astype(np.int32),
                path.numpy(),
            )
        assert self.embed is not None, "attach_target first"
        out = torch.empty(n, c.hidden_size)
        for row in rows.unique().tolist():
            mine = (rows == row).nonzero()[:, 0]
            base = int(bases[mine[0]])
            x = self.fc(torch.cat([self.embed[next_ids[mine]].float(), features[mine]], dim=-1))
            q, k, v = layer_qkv(self.layer, c, self.rope, x[None], positions[mine][None])
            keys, values = kv.keys[0][row : row + 1], kv.values[0][row : row + 1]
            keys[0, :, slots[mine]] = k[0].to(keys.dtype)
            values[0, :, slots[mine]] = v[0].to(values.dtype)
            own = ancestry[mine]
            used = base + own.shape[1]
            mask = torch.cat([own.new_ones((len(mine), base)), own], dim=1)
            attn = cached_attention(q, keys[:, :, :used], values[:, :, :used], mask[None, None])
            out[mine] = rms_norm(
                layer_out(self.layer, c, x[None], attn), self.norm, c.rms_norm_eps
            )[0]
        return out

    def forward_chained(
        self, features: torch.Tensor, next_ids: torch.Tensor, steps: int
    ) -> list[torch.Tensor]:
        """Training as serving drafts (EAGLE-3's "training-time test"): prediction s (from 1)
        at slot i is what the s-th guess of a chain whose last true slot is i - s + 1 sees.
        Its input state is prediction s - 1 at slot i - 1 (the head's own, not the target's)
        and it attends to the true pairs of slots <= i - s + 1 and to the chained entries
        (i - s + r, step r) before it, exactly the cache a proposal builds. Returns the
        predicted states [B, T, H] of each step; step s is meaningful for slots >= s - 1."""
        c = self.config
        b, t, _ = features.shape
        positions = torch.arange(t)[None, :].expand(b, t)
        slot = torch.arange(t)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        outputs: list[torch.Tensor] = []
        inputs = features
        for s in range(1, steps + 1):
            assert self.embed is not None, "attach_target first"
            x = self.fc(torch.cat([self.embed[next_ids].float(), inputs], dim=-1))
            q, k, v = layer_qkv(self.layer, c, self.rope, x, positions)
            keys.append(k)
            values.append(v)
            blocks = [slot[None, :] <= slot[:, None] - s + 1]  # true pairs
            for r in range(2, s + 1):
                blocks.append(slot[None, :] == slot[:, None] - (s - r))
            mask = torch.cat(blocks, dim=1)  # [T, s*T]
            attn = F.scaled_dot_product_attention(
                q, torch.cat(keys, dim=2), torch.cat(values, dim=2), mask, enable_gqa=True
            )
            out = rms_norm(layer_out(self.layer, c, x, attn), self.norm, c.rms_norm_eps)
            outputs.append(out)
            inputs = torch.cat([features[:, :1], out[:, :-1]], dim=1)
        return outputs

    def serve(self, native_weights: WeightFormat = HEAD_WEIGHTS) -> None:
        """Inference from now on: the step runs in the native library, its matrices held
        in `native_weights` (head_native.py), or where that library does not build every
        matrix (the shared output rows too) multiplies through the chosen fp32 GEMM call."""
        serve_projections(self)
        self.head_rows = aligned(self.head_rows)
        register(self.head_rows)
        self._rows_routed = True
        # The step in the native library where it builds (head_native.py); torch otherwise.
        assert self.embed is not None, "attach_target first"
        parts = HeadParts(
            self.config,
            self.embed,
            self.fc.weight,
            self.layer,
            self.norm,
            self.head_rows,
            self.rope.cos,
            self.rope.sin,
        )
        self.native, self.native_reason = NativeHeadLayer.create(parts, native_weights)

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        """Logits over the head vocabulary (draft ids index `vocab_ids`)."""
        if self.native is not None and not torch.is_grad_enabled():
            flat = self.native.logits(states.reshape(-1, states.shape[-1]))
            return flat.view(*states.shape[:-1], self.head_rows.shape[0])
        if self._rows_routed and not torch.is_grad_enabled():
            flat = fp32_linear(states.reshape(-1, states.shape[-1]), self.head_rows)
            return flat.view(*states.shape[:-1], self.head_rows.shape[0])
        return F.linear(states, self.head_rows)


def head_config(target_config, vocab_size: int) -> DraftConfig:
    """The head's layer has the target's shapes (so it can start as a copy of a target layer)."""
    tc = target_config
    return DraftConfig(
        hidden_size=tc.hidden_size,
        intermediate_size=tc.intermediate_size,
        num_heads=tc.num_heads,
        num_kv_heads=tc.num_kv_heads,
        head_dim=tc.head_dim,
        num_layers=1,
        vocab_size=vocab_size,
        rope_theta=tc.rope_theta,
        rms_norm_eps=tc.rms_norm_eps,
        max_position=tc.max_position,
        source_layers=(tc.num_layers - 1,),
        tied=True,
    )


def init_head_from_checkpoint(head: DraftHead, tensors: dict[str, torch.Tensor]) -> None:
    """Start the layer as a copy of the target's last layer (it already maps late-layer states
    to next-token states) and fc as [0.5 I, 0.5 I] (the sum of the two inputs)."""
    h = head.config.hidden_size
    with torch.no_grad():
        eye = torch.eye(h)
        head.fc.weight.copy_(torch.cat([0.5 * eye, 0.5 * eye], dim=1))
        copy_target_layer(head.layer, tensors, head.config.source_layers[0])
        head.norm.copy_(tensors["norm"])
