"""A Llama-family decoder over the paged KV cache.

Plain tensors and functions rather than nn.Modules: the forward pass is the hot loop of a
2-core CPU server, and every avoided indirection is time. Q/K/V and gate/up are fused into one
matmul each (fewer, larger kernel calls).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from kernels.attention_kernel import AttentionKernel
from kernels.attention_metadata import AttentionMetadata
from kernels.torch_attention import TorchPagedAttention
from shared.kvcache.pool import KVLayout, KVPool
from shared.model.embedding import TokenEmbedding
from shared.model.gguf_file import Checkpoint
from shared.model.linear import Linear, WeightFormat, fuse_q4_1, fuse_rows
from shared.model.native_step import NativeMatrix, NativeStep
from shared.modelfile.config import ModelConfig

Matrix = Linear | NativeMatrix  # y = x @ W.T, whichever kernel computes it


@dataclass
class _Layer:
    input_norm: torch.Tensor
    qkv: Matrix
    o_proj: Matrix
    post_attention_norm: torch.Tensor
    gate_up: Matrix
    down: Matrix


_HEAD_FORMAT: dict[str, WeightFormat] = {"int4": "bf16"}

# What a path can run in: a torch weight format, or the native step.
ModelFormat = Literal["fp32", "bf16", "int8", "int4", "native", "native-a8"]
MODEL_FORMATS: tuple[str, ...] = ("fp32", "bf16", "int8", "int4", "native", "native-a8")
# The native step's builds, by how their matrices take activations (native_step.ACTIVATIONS).
NATIVE_FORMATS: dict[str, str] = {"native": "fp32", "native-a8": "int8"}


class NativeUnavailable(RuntimeError):
    """`native` was asked for where the native step cannot run (no compiler, not a CPU)."""


def _torch_layers(
    checkpoint: Checkpoint, weights: WeightFormat, dev: torch.device, head: bool = True
) -> tuple[list[_Layer], Linear | None]:
    cfg = checkpoint.config
    t = checkpoint.tensors
    blocks = checkpoint.q4_1_blocks
    # The output projection decides the argmax: 4-bit groups there flipped 14.5% of fp32's
    # top-1 tokens (quality gate, PIQA set), so int4 builds keep it in bf16.
    lm_head = (
        Linear(
            t.get("lm_head", t["embed_tokens"]).to(dev),
            _HEAD_FORMAT.get(weights, weights),
            blocks.get("lm_head"),
        )
        if head
        else None
    )
    layers: list[_Layer] = []
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        qkv_names = [p + "q_proj", p + "k_proj", p + "v_proj"]
        gate_up_names = [p + "gate_proj", p + "up_proj"]
        layers.append(
            _Layer(
                input_norm=t[p + "input_norm"].to(dev),
                qkv=Linear(
                    fuse_rows([t[n] for n in qkv_names]).to(dev),
                    weights,
                    fuse_q4_1([blocks.get(n) for n in qkv_names]),
                ),
                o_proj=Linear(t[p + "o_proj"].to(dev), weights, blocks.get(p + "o_proj")),
                post_attention_norm=t[p + "post_attention_norm"].to(dev),
                gate_up=Linear(
                    fuse_rows([t[n] for n in gate_up_names]).to(dev),
                    weights,
                    fuse_q4_1([blocks.get(n) for n in gate_up_names]),
                ),
                down=Linear(t[p + "down_proj"].to(dev), weights, blocks.get(p + "down_proj")),
            )
        )
    return layers, lm_head


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Spelled out: torch's CPU F.rms_norm was measured slower here (22 vs ~10 us per call).
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class RotaryEmbedding:
    """Rotate-half RoPE with cos/sin tables precomputed for every position."""

    def __init__(self, head_dim: int, theta: float, max_position: int, device: torch.device):
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        angles = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        self.cos = angles.cos().to(torch.float32).to(device)
        self.sin = angles.sin().to(torch.float32).to(device)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions][:, None, :], self.sin[positions][:, None, :]

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin


class LlamaModel:
    """One model, computed on two paths: prompt rows (prefill chunks) in `weights`, and
    decode/verify rows in `decode_weights` (default: the same). Either may be `native`, the
    one-call C step over the file's own quantized blocks (shared/model/native_step.py);
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
        self.norm = t["norm"].to(dev)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.max_position, dev)
        self.scale = cfg.head_dim**-0.5
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
        self._torch: dict[str, tuple[list[_Layer], Linear | None]] = {}
        for fmt in dict.fromkeys((self.weights, self.decode_weights)):
            if fmt not in NATIVE_FORMATS:
                # With a native step, its head (the file's Q8_0 rows, ~1/3 the bytes of a bf16
                # copy) serves both paths: the prompt path needs logits of a few rows only.
                self._torch[fmt] = _torch_layers(  # type: ignore[arg-type]
                    checkpoint, fmt, dev, head=self.native is None
                )
        # The layers of the prompt path, matrices as callables (the quality gate's dense
        # forward reads them): torch Linears, or the native kernel's own matrices.
        if self.weights in NATIVE_FORMATS:
            assert self.native is not None
            self.layers = [
                _Layer(
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
        replica's `kv_cache_dtype` resolved to; shared/kvcache/kv_dtype.py)."""
        c = self.config
        return KVLayout(c.num_layers, c.num_kv_heads, c.head_dim, block_size, dtype)

    @property
    def weight_bytes_per_token_step(self) -> int:
        """Bytes of weights one batch-1 decode step reads (embedding row lookup excluded)."""
        if self.native is not None and self.decode_native:
            return self.native.nbytes.per_step_b1
        layers, torch_head = self._torch[self.decode_weights]
        head: Matrix = torch_head or self.native.matrix(-1, "head")  # type: ignore[union-attr]
        per_layer = [
            lyr.qkv.nbytes_per_call
            + lyr.o_proj.nbytes_per_call
            + lyr.gate_up.nbytes_per_call
            + lyr.down.nbytes_per_call
            for lyr in layers
        ]
        return sum(per_layer) + head.nbytes_per_call

    def memory_bytes(self) -> dict[str, int]:
        """Bytes each weight representation holds (what the worker reports at start)."""
        norms = self.norm.numel() + sum(
            lyr.input_norm.numel() + lyr.post_attention_norm.numel() for lyr in self.layers
        )
        out = {"embedding+norms": self.embed_tokens.nbytes + 4 * norms}
        for fmt, (layers, head) in self._torch.items():
            matrices = [m for lyr in layers for m in (lyr.qkv, lyr.o_proj, lyr.gate_up, lyr.down)]
            if head is not None:
                matrices.append(head)
            out[f"torch {fmt}"] = sum(m.nbytes_held for m in matrices)  # type: ignore[union-attr]
        if self.native is not None:
            out[f"native ({self.native.activations} activations)"] = self.native.nbytes.weights
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
        format `fmt` (default: the prompt path's)."""
        cfg = self.config
        layers = self._torch[fmt or self.torch_path(decode=False) or next(iter(self._torch))][0]
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        cos, sin = self.rope.tables(meta.positions())
        self.attention.prepare(meta)
        x = self.embed_tokens[input_ids]
        n = x.shape[0]
        for index, layer in enumerate(layers):
            h = rms_norm(x, layer.input_norm, cfg.rms_norm_eps)
            qkv = layer.qkv(h)
            # Q and K heads rotate together: one RoPE application per layer, not two.
            qk = RotaryEmbedding.apply(qkv[:, : (hq + hkv) * d].view(n, hq + hkv, d), cos, sin)
            q, k = qk[:, :hq], qk[:, hq:]
            v = qkv[:, (hq + hkv) * d :].view(n, hkv, d)
            attn = self.attention.forward(
                q, k, v, kv.key_cache(index), kv.value_cache(index), meta, self.scale
            )
            x = x + layer.o_proj(attn.reshape(n, hq * d))
            h = rms_norm(x, layer.post_attention_norm, cfg.rms_norm_eps)
            gate_up = layer.gate_up(h)
            inter = cfg.intermediate_size
            x = x + layer.down(F.silu(gate_up[:, :inter]) * gate_up[:, inter:])
        return rms_norm(x, self.norm, cfg.rms_norm_eps)

    def forward_path(
        self, input_ids: torch.Tensor, meta: AttentionMetadata, kv: KVPool, decode: bool
    ) -> torch.Tensor:
        """forward() on the prompt path or the decode path, natively where that path is."""
        fmt = self.torch_path(decode)
        if fmt is not None:
            return self.forward(input_ids, meta, kv, fmt)
        assert self.native is not None
        positions: list[int] = []
        tables: list[list[int]] = []
        width = max(len(t) for t in meta.block_tables)
        for q_len, ctx, table in zip(
            meta.query_lens, meta.context_lens, meta.block_tables, strict=True
        ):
            positions.extend(range(ctx - q_len, ctx))
            tables.extend([table + [0] * (width - len(table))] * q_len)
        return self.native.forward(
            input_ids.numpy().astype(np.int64, copy=False),
            np.asarray(positions, dtype=np.int32),
            np.asarray(tables, dtype=np.int32).reshape(len(positions), width),
            kv.tensor,
            meta.block_size,
        )

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, decode: bool = False) -> torch.Tensor:
        """Logits of final hidden states, with the head of the path they came from."""
        fmt = self.decode_weights if decode else self.weights
        if fmt in NATIVE_FORMATS or (self.native is not None and self._torch[fmt][1] is None):
            assert self.native is not None
            return self.native.logits(hidden)
        head = self._torch[fmt][1]
        assert head is not None
        return head(hidden)
