"""The decoder every registered family runs on, over the paged KV cache.

Llama's layout is the base; a family's config switches (shared/modelfile/config.py) turn on
its extras in the layer loop below — biases, per-head q/k norms, sliding-window layers with
their own RoPE theta, Gemma's norms and scalings, sparse expert MLPs. Plain tensors and
functions rather than nn.Modules: the forward pass is the hot loop of a 2-core CPU server,
and every avoided indirection is time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import numpy as np
import torch

from engine.kvcache.pool import KVLayout, KVPool
from engine.model.embedding import TokenEmbedding
from engine.model.gguf_file import Checkpoint
from engine.model.layers import DecoderLayer, Matrix, norm_weight, rms_norm, torch_layers
from engine.model.linear import Linear
from engine.model.native_step import NativeStep
from engine.model.rope import RotaryEmbedding
from kernels.attention_kernel import AttentionKernel
from kernels.attention_metadata import AttentionMetadata
from kernels.moe_experts import activate
from kernels.serial_ops import serial_ops
from kernels.torch_attention import TorchPagedAttention
from shared.modelfile.config import ModelConfig

# What a path can run in: a torch weight format, or the native step.
ModelFormat = Literal["fp32", "bf16", "int8", "int4", "native", "native-a8"]
MODEL_FORMATS: tuple[str, ...] = ("fp32", "bf16", "int8", "int4", "native", "native-a8")
# The native step's builds, by how their matrices take activations (native_step.ACTIVATIONS).
NATIVE_FORMATS: dict[str, str] = {"native": "fp32", "native-a8": "int8"}
# (q [n, hq, d], k and v [n, hkv, d], layer index, its window) -> [n, hq, d]
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, int | None], torch.Tensor]
# (a matrix or sparse MLP, rows) -> its output rows
LinearCall = Callable[[Callable[[torch.Tensor], torch.Tensor], torch.Tensor], torch.Tensor]


def _call(matrix: Callable[[torch.Tensor], torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
    return matrix(rows)


class NativeUnavailable(RuntimeError):
    """`native` was asked for where the native step cannot run (no compiler, not a CPU)."""


class LlamaModel:
    """One model, computed on two paths: prompt rows (prefill chunks) in `weights`, and
    decode/verify rows in `decode_weights` (default: the same). Either may be `native`, the
    one-call C step over the file's own quantized blocks (engine/model/native_step.py);
    a path whose format is a torch format runs the layers below, op by op."""

    def __init__(
        self,
        checkpoint: Checkpoint,
        weights: ModelFormat = "fp32",
        device: str | torch.device = "cpu",
        attention: AttentionKernel | None = None,
        decode_weights: ModelFormat | None = None,
    ):
        cfg = checkpoint.config
        for fmt in (weights, decode_weights):
            if fmt is not None and fmt not in MODEL_FORMATS:
                raise ValueError(
                    f"unknown weight format '{fmt}' (valid: {', '.join(MODEL_FORMATS)})"
                )
        self.config: ModelConfig = cfg
        self.weights: ModelFormat = weights
        self.decode_weights: ModelFormat = decode_weights or weights
        self.device = torch.device(device)
        self.attention = attention or TorchPagedAttention()
        t = checkpoint.tensors
        dev = self.device
        natives = {f for f in (weights, self.decode_weights) if f in NATIVE_FORMATS}
        # The file's Q8_0 embedding blocks serve lookups unless a torch head of this model
        # is made from the same fp32 rows (tied, no native head): then those rows are
        # resident anyway.
        self.embed_tokens = TokenEmbedding.from_checkpoint(
            checkpoint, dev, keep_blocks=bool(natives) or not cfg.tie_embeddings
        )
        self.norm = norm_weight(t, "norm", cfg, dev)
        self.rope = RotaryEmbedding(
            cfg.head_dim, cfg.rope_theta, cfg.max_position, dev, cfg.rope_scaling
        )
        # Sliding layers of Gemma 3 rotate with their own theta (and no scaling).
        self.local_rope = (
            RotaryEmbedding(cfg.head_dim, cfg.local_rope_theta, cfg.max_position, dev)
            if cfg.local_rope_theta is not None
            else None
        )
        self.scale = (cfg.query_scale or cfg.head_dim) ** -0.5
        self.native: NativeStep | None = None
        self.native_reason = "not asked for"
        if len(natives) > 1:
            raise ValueError(f"one native build per model, not {sorted(natives)}")
        if natives:
            (native_format,) = natives
            self.native, self.native_reason = NativeStep.create(
                checkpoint,
                self.embed_tokens,
                self.rope.cos,
                self.rope.sin,
                NATIVE_FORMATS[native_format],
            )
            if self.native is None:
                raise NativeUnavailable(f"the native step is unavailable: {self.native_reason}")
        # Torch layers per torch format in use (usually one; two only if the chooser measured
        # two different torch formats fastest for the two paths).
        self._torch: dict[str, tuple[list[DecoderLayer], Linear | None]] = {}
        for fmt in dict.fromkeys((self.weights, self.decode_weights)):
            if fmt not in NATIVE_FORMATS:
                # With a native step, its head (the file's Q8_0 rows, ~1/3 the bytes of a bf16
                # copy) serves both paths: the prompt path needs logits of a few rows only.
                self._torch[fmt] = torch_layers(  # type: ignore[arg-type]
                    checkpoint, fmt, dev, head=self.native is None
                )
        # The layers of the prompt path, matrices as callables (the quality gate's dense
        # forward reads them): torch Linears, or the native kernel's own matrices.
        if self.weights in NATIVE_FORMATS:
            assert self.native is not None
            self.layers = [
                DecoderLayer(
                    input_norm=t[f"layers.{i}.input_norm"].to(dev),
                    qkv=self.native.matrix(i, "qkv"),
                    o_proj=self.native.matrix(i, "o_proj"),
                    post_attention_norm=t[f"layers.{i}.post_attention_norm"].to(dev),
                    gate_up=self.native.matrix(i, "gate_up"),
                    down=self.native.matrix(i, "down"),
                )
                for i in range(cfg.num_layers)
            ]
            self.lm_head = self.native.matrix(-1, "head")
        else:
            self.layers, torch_head = self._torch[self.weights]
            self.lm_head = torch_head or (self.native.matrix(-1, "head") if self.native else None)

    @property
    def decode_native(self) -> bool:
        return self.decode_weights in NATIVE_FORMATS

    @property
    def prefill_native(self) -> bool:
        return self.weights in NATIVE_FORMATS

    def kv_layout(self, block_size: int, dtype: torch.dtype = torch.float32) -> KVLayout:
        """The pool layout this model's attention reads: fp32 or fp16 elements (what a
        replica's `kv_cache_dtype` resolved to; engine/kvcache/kv_dtype.py)."""
        c = self.config
        return KVLayout(c.num_layers, c.num_kv_heads, c.head_dim, block_size, dtype)

    @property
    def weight_bytes_per_token_step(self) -> int:
        """Bytes of weights one batch-1 decode step reads (embedding row lookup excluded)."""
        if self.native is not None and self.decode_native:
            return self.native.nbytes.per_step_b1
        layers, torch_head = self._torch[self.decode_weights]
        head: Matrix = torch_head or self.native.matrix(-1, "head")  # type: ignore[union-attr]
        total = head.nbytes_per_call
        for lyr in layers:
            total += sum(m.nbytes_per_call for m in lyr.dense_matrices())
            if lyr.sparse is not None:
                # A batch-1 step reads the top-k routed experts (and the shared one).
                gate_up, down = lyr.sparse.experts[0]
                total += lyr.sparse.top_k * (gate_up.nbytes_per_call + down.nbytes_per_call)
                if lyr.sparse.shared is not None:
                    total += sum(m.nbytes_per_call for m in lyr.sparse.shared[:2])
        return total

    def memory_bytes(self) -> dict[str, int]:
        """Bytes each weight representation holds (what the worker reports at start)."""
        norms = self.norm.numel() + sum(
            lyr.input_norm.numel() + lyr.post_attention_norm.numel() for lyr in self.layers
        )
        out = {"embedding+norms": self.embed_tokens.nbytes + 4 * norms}
        for fmt, (layers, head) in self._torch.items():
            matrices = [m for lyr in layers for m in lyr.all_matrices()]
            if head is not None:
                matrices.append(head)
            out[f"torch {fmt}"] = sum(m.nbytes_held for m in matrices)  # type: ignore[union-attr]
        if self.native is not None:
            out[f"native ({self.native.activations} activations)"] = self.native.nbytes.weights
            if self.native.nbytes.greedy_twin:
                out["native head int8 twin (greedy rows)"] = self.native.nbytes.greedy_twin
        return out

    def torch_path(self, decode: bool) -> str | None:
        """The torch format a path runs in, or None when it runs natively."""
        fmt = self.decode_weights if decode else self.weights
        return None if fmt in NATIVE_FORMATS else fmt

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        kv: KVPool,
        fmt: str | None = None,
    ) -> torch.Tensor:
        """input_ids [tokens] -> final-norm hidden states [tokens, hidden], op by op in torch
        format `fmt` (default: the prompt path's), attending over the paged cache."""
        layers = self._torch[fmt or self.torch_path(decode=False) or next(iter(self._torch))][0]
        self.attention.prepare(meta)

        def attend(q, k, v, index: int, window: int | None) -> torch.Tensor:
            key, value = kv.key_cache(index), kv.value_cache(index)
            return self.attention.forward(q, k, v, key, value, meta, self.scale, window)

        return self.hidden_states(input_ids, meta.positions(), layers, attend)

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        layers: list[DecoderLayer],
        attend: Attend,
        linear: LinearCall | None = None,
    ) -> torch.Tensor:
        """The decoder every family runs: input_ids [tokens] at `positions` -> final-norm
        hidden states [tokens, hidden]. The caller supplies attention (the paged cache when
        serving, a dense mask when scoring) and, optionally, how a matrix is applied to rows
        (the quality gate caps the rows per call to reproduce serving-step numerics)."""
        cfg = self.config
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        cos, sin = self.rope.tables(positions)
        local = self.local_rope.tables(positions) if self.local_rope is not None else None
        x = self.embed_tokens[input_ids]
        if cfg.embed_scale != 1.0:
            x = x * cfg.embed_scale
        n = x.shape[0]
        eps, inter = cfg.rms_norm_eps, cfg.intermediate_size
        apply = linear or _call
        for index, layer in enumerate(layers):
            window = cfg.window(index)
            with serial_ops(n):  # see kernels/serial_ops.py: small ops, sleeping threads
                h = rms_norm(x, layer.input_norm, eps)
            qkv = apply(layer.qkv, h)
            with serial_ops(n):
                if layer.qkv_bias is not None:
                    qkv = qkv + layer.qkv_bias
                qk = qkv[:, : (hq + hkv) * d].view(n, hq + hkv, d)
                if layer.q_norm is not None and layer.k_norm is not None:
                    qk = torch.cat(
                        [
                            rms_norm(qk[:, :hq], layer.q_norm, eps),
                            rms_norm(qk[:, hq:], layer.k_norm, eps),
                        ],
                        dim=1,
                    )
                # Q and K heads rotate together: one RoPE application per layer, not two.
                c, s = local if local is not None and window is not None else (cos, sin)
                qk = RotaryEmbedding.apply(qk, c, s)
            q, k = qk[:, :hq], qk[:, hq:]
            v = qkv[:, (hq + hkv) * d :].view(n, hkv, d)
            attn = attend(q, k, v, index, window).reshape(n, hq * d)
            out = apply(layer.o_proj, attn)
            with serial_ops(n):
                if layer.attn_out_norm is not None:
                    out = rms_norm(out, layer.attn_out_norm, eps)
                x = x + out
                h = rms_norm(x, layer.post_attention_norm, eps)
            if layer.sparse is not None:
                out = apply(layer.sparse, h)
            else:
                assert layer.gate_up is not None and layer.down is not None
                gu = apply(layer.gate_up, h)
                with serial_ops(n):
                    act = activate(gu[:, :inter], cfg.activation) * gu[:, inter:]
                out = apply(layer.down, act)
            with serial_ops(n):
                if layer.mlp_out_norm is not None:
                    out = rms_norm(out, layer.mlp_out_norm, eps)
                x = x + out
        with serial_ops(n):
            return rms_norm(x, self.norm, eps)

    def forward_path(
        self, input_ids: torch.Tensor, meta: AttentionMetadata, kv: KVPool, decode: bool
    ) -> torch.Tensor:
        """forward() on the prompt path or the decode path, natively where that path is."""
        fmt = self.torch_path(decode)
        if fmt is not None:
            return self.forward(input_ids, meta, kv, fmt)
        assert self.native is not None
        tables: list[list[int]] = []
        width = max(len(t) for t in meta.block_tables)
        for q_len, table in zip(meta.query_lens, meta.block_tables, strict=True):
            tables.extend([table + [0] * (width - len(table))] * q_len)
        positions = meta.token_positions()
        tree_base = tree_slots = None
        if meta.has_trees:
            tree_base, tree_slots = _tree_slots(meta, positions)
        return self.native.forward(
            input_ids.numpy().astype(np.int64, copy=False),
            np.asarray(positions, dtype=np.int32),
            np.asarray(tables, dtype=np.int32).reshape(len(positions), width),
            kv.tensor,
            meta.block_size,
            tree_base,
            tree_slots,
        )

    @property
    def verifies_trees(self) -> bool:
        """Whether a verify step may carry draft trees: the decode path's attention honours
        tree masks (the native step and the torch kernel do) and no layer slides a window
        (a window is counted in slots, which tree nodes do not fill in position order)."""
        if any(self.config.window(i) is not None for i in range(self.config.num_layers)):
            return False
        return self.torch_path(decode=True) is None or self.attention.supports_trees

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, decode: bool = False) -> torch.Tensor:
        """Logits of final hidden states, with the head of the path they came from."""
        fmt = self.decode_weights if decode else self.weights
        if fmt in NATIVE_FORMATS or (self.native is not None and self._torch[fmt][1] is None):
            assert self.native is not None
            return self.native.logits(hidden)
        head = self._torch[fmt][1]
        assert head is not None
        logits = head(hidden)
        cap = self.config.final_softcap
        return logits if cap is None else cap * torch.tanh(logits / cap)

    def greedy_tokens(self, hidden: torch.Tensor, decode: bool = False) -> torch.Tensor | None:
        """The argmax of `logits(hidden, decode)` per row, found without the full logits where
        the path's head allows (the native head's int8 twin); None: take the logits."""
        fmt = self.decode_weights if decode else self.weights
        if self.native is None or not (fmt in NATIVE_FORMATS or self._torch[fmt][1] is None):
            return None
        return self.native.greedy_tokens(hidden)

    def expert_load(self) -> dict[int, list[int]]:
        """Layer -> tokens routed to each expert so far, over both paths' layers."""
        load: dict[int, list[int]] = {}
        for layers, _ in self._torch.values():
            for i, layer in enumerate(layers):
                if layer.sparse is not None:
                    counts = layer.sparse.load.tolist()
                    load[i] = [
                        a + b for a, b in zip(load.get(i, [0] * len(counts)), counts, strict=True)
                    ]
        return load


def _tree_slots(meta: AttentionMetadata, positions: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The native step's view of the step's draft trees: per row, the position from which
    its context is remapped (past its own for rows without a tree) and the slots of its
    remapped positions, i.e. of the root and of each ancestor down to the row itself."""
    rows = len(positions)
    width = max(len(t) + 1 for t in meta.trees or [] if t is not None)
    base = np.asarray(positions, dtype=np.int32) + 1
    slots = np.zeros((rows, width), dtype=np.int32)
    row = 0
    for seq, (q_len, ctx) in enumerate(zip(meta.query_lens, meta.context_lens, strict=True)):
        tree = meta.tree(seq)
        if tree is not None:
            root = ctx - q_len  # the first query token's position, and its slot
            lines: list[list[int]] = [[root]]
            for node, parent in enumerate(tree):
                lines.append(lines[parent + 1] + [root + 1 + node])
            base[row : row + q_len] = root
            for i, line in enumerate(lines):
                slots[row + i, : len(line)] = line
        row += q_len
    return base, slots
