"""A draft head's step as one native call (decode_step.c's ss_forward_head), and its logits.

Why: a head step is one decoder layer over one row per request, ~0.2 ms of arithmetic on
SmolLM2's shapes, but in torch it is ~40 small operations (the input projection, norms, RoPE,
the cache write, masked attention), measured at 0.94 ms a step on a 2-core EPYC; a chain of
three guesses then cost more than a tenth of the verify step it feeds. The library's step
already computes a Llama layer over paged KV; given the head's input projection it builds
each row's input, fc([embedding of the token; state]), itself, and it reads and writes the
head's own cache in place (BatchKV's storage is that layout, one block per batch row).

Weights: between two head steps the target's step streams ~0.5 GB of fp32 matrices, so the
head's ~26 MB of fp32 weights (layer, fc, 4,096 output rows) come from DRAM every step. In
Q8_0 blocks (int8 per weight and one fp32 scale per 32) they are 3.8x fewer bytes; HEAD_WEIGHTS
says what that did to acceptance and speed.

The results match the torch head to the rounding of the weights' format, not bit for bit; a
draft only proposes, and verification keeps the output exact whichever path drafted it.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from engine.model.embedding import TokenEmbedding
from engine.speculative.draft_model import BatchKV, DecoderLayer, DraftConfig
from kernels.native import abi
from kernels.native.build import load

WeightFormat = Literal["fp32", "q8_0"]
# Measured with `bench spec`'s trained head on its chat set (fp32 target, 2 threads, k=8,
# cutoff 0.3; one process, the variants interleaved prompt by prompt, 2-core AVX-512 EPYC):
#   head step      b1 tok/s (x plain)   b8 tok/s (x plain)   mean accepted (b1)
#   torch          47.7 (1.43x)          98.0 (0.72x)          2.126
#   native fp32    49.8 (1.49x)         125.7 (0.92x)          2.126
#   native q8_0    51.1 (1.53x)         127.9 (0.93x)          2.130
# A proposal at b1 (feed the new true pairs, then guess) cost 4.3, 2.5 and 1.2 ms. Q8_0 moved
# acceptance by nothing measurable, so it is the default wherever the shapes are whole blocks.
HEAD_WEIGHTS: WeightFormat = "q8_0"


class NativeHeadError(RuntimeError):
    """The library refused a head step (a caller's bug: positions past the cache)."""


def quantize_q8_0(weight: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """fp32 [out, in] -> int8 quants [out, in/32, 32] and fp32 scales [out, in/32]: each block
    of 32 scaled by its largest magnitude / 127. Rows that were Q8_0 blocks already (the
    target's output rows) come back as the same integers."""
    out, inp = weight.shape
    blocks = weight.detach().float().reshape(out, inp // abi.GROUP, abi.GROUP)
    scales = blocks.abs().amax(dim=-1) / 127.0
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    quants = torch.round(blocks / safe[..., None]).clamp(-127, 127).to(torch.int8)
    return quants.numpy().copy(), scales.numpy().copy()


@dataclass(frozen=True)
class HeadParts:
    """What the native step reads of a served head: its own weights and the target's
    embedding and output rows."""

    config: DraftConfig
    embed: TokenEmbedding | torch.Tensor
    fc: torch.Tensor
    layer: DecoderLayer
    norm: torch.Tensor
    head_rows: torch.Tensor
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor


class NativeHeadLayer:
    """The head's step over paged KV (`forward`) and its output rows (`logits`)."""

    def __init__(self, lib: ctypes.CDLL, parts: HeadParts, weights: WeightFormat):
        self.lib = lib
        self.config = c = parts.config
        self.weights = weights
        layer, embed = parts.layer, parts.embed
        self._keep: list[object] = []  # every array the structs point into
        layers = (abi.Layer * 1)()
        layers[0].input_norm = self._f32(layer.input_norm).data_ptr()
        layers[0].post_norm = self._f32(layer.post_attention_norm).data_ptr()
        for name in ("qkv", "o_proj", "gate_up", "down"):
            setattr(layers[0], name, self._linear(getattr(layer, name).weight))
        self._layers = layers
        self.rows = self._linear(parts.head_rows)
        if isinstance(embed, TokenEmbedding) and embed.quantized:
            assert embed.quants is not None and embed.scales is not None
            dense_ptr, quants_ptr, scales_ptr = (
                None,
                embed.quants.ctypes.data,
                embed.scales.ctypes.data,
            )
            vocab = embed.num_rows
        else:
            table = embed.dense if isinstance(embed, TokenEmbedding) else embed
            assert table is not None
            dense = self._f32(table)
            dense_ptr, quants_ptr, scales_ptr = dense.data_ptr(), None, None
            vocab = dense.shape[0]
        self._embed = embed
        cos, sin = self._f32(parts.rope_cos), self._f32(parts.rope_sin)
        self.model = abi.Model(
            num_layers=1,
            hidden=c.hidden_size,
            num_heads=c.num_heads,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            intermediate=c.intermediate_size,
            vocab=vocab,
            max_pos=cos.shape[0],
            eps=c.rms_norm_eps,
            scale=c.head_dim**-0.5,
            embed=dense_ptr,
            final_norm=self._f32(parts.norm).data_ptr(),
            rope_cos=cos.data_ptr(),
            rope_sin=sin.data_ptr(),
            layers=layers,
            head=self.rows,  # the step itself never applies it: see logits()
            embed_quants=quants_ptr,
            embed_scales=scales_ptr,
            input_proj=self._linear(parts.fc),
        )

    @classmethod
    def create(
        cls, parts: HeadParts, weights: WeightFormat = HEAD_WEIGHTS
    ) -> tuple[NativeHeadLayer | None, str]:
        """The native step, or None and why not (no compiler, a shape the library lacks)."""
        config, embed = parts.config, parts.embed
        if config.num_layers != 1:
            return None, f"a head has one layer, not {config.num_layers}"
        if config.head_dim > 512 or config.num_heads % config.num_kv_heads:
            return None, f"head_dim {config.head_dim} / GQA layout not supported natively"
        if isinstance(embed, TokenEmbedding) and embed.quantized and config.hidden_size % abi.GROUP:
            return None, f"hidden size {config.hidden_size} is not whole Q8_0 blocks"
        if weights == "q8_0" and any(
            n % abi.GROUP for n in (config.hidden_size, config.intermediate_size)
        ):
            weights = "fp32"  # Q8_0 needs whole blocks of 32 inputs
        build = load()
        if not build.available or build.library is None:
            return None, build.reason
        native = cls(build.library, parts, weights)
        return native, f"native, {weights} weights"

    def _f32(self, tensor: torch.Tensor) -> torch.Tensor:
        array = tensor.detach().float().contiguous()
        self._keep.append(array)
        return array

    def _linear(self, weight: torch.Tensor) -> abi.Linear:
        out, inp = weight.shape
        if self.weights == "q8_0":
            quants, scales = quantize_q8_0(weight)
            self._keep.extend([quants, scales])
            return abi.Linear(abi.Q8_0, out, inp, 0, quants.ctypes.data, scales.ctypes.data, None)
        dense = self._f32(weight)
        return abi.Linear(abi.F32, out, inp, 0, dense.data_ptr(), None, None)

    @property
    def threads(self) -> int:
        return max(1, torch.get_num_threads())

    def forward(
        self,
        token_ids: np.ndarray,  # int64 [n]: each row's target token id (x_{t+1})
        features: torch.Tensor,  # fp32 [n, hidden]: each row's state (h_t, or a prediction)
        positions: np.ndarray,  # int32 [n]: each row's cache slot (and RoPE position)
        batch_rows: np.ndarray,  # int32 [n]: each row's batch row of `kv`
        kv: BatchKV,
        tree_base: np.ndarray | None = None,  # int32 [n] (see ss_forward_tree)
        tree_slots: np.ndarray | None = None,  # int32 [n, width]
    ) -> torch.Tensor:
        """The rows' predicted next states [n, hidden]. Each row's K/V is written at its slot
        of its batch row, and it attends to that row's slots 0 .. its position (tree rows:
        remapped from tree_base on)."""
        n = int(features.shape[0])
        x = features.float().contiguous()
        ids = np.ascontiguousarray(token_ids, dtype=np.int64)
        out = torch.empty((n, self.config.hidden_size), dtype=torch.float32)
        storage = kv.storage
        if storage.dtype != torch.float32 or not storage.is_contiguous():
            raise NativeHeadError("the head's cache must be contiguous fp32")
        tables = np.ascontiguousarray(batch_rows, dtype=np.int32).reshape(n, 1)
        positions = np.ascontiguousarray(positions, dtype=np.int32)
        block = abi.KV(storage.data_ptr(), kv.capacity, 1, tables.ctypes.data, abi.KV_F32, 0)
        base_ptr = slots_ptr = None
        width = 0
        if tree_base is not None and tree_slots is not None:
            tree_base = np.ascontiguousarray(tree_base, dtype=np.int32)
            tree_slots = np.ascontiguousarray(tree_slots, dtype=np.int32)
            base_ptr, slots_ptr = tree_base.ctypes.data, tree_slots.ctypes.data
            width = tree_slots.shape[1]
        code = self.lib.ss_forward_head(
            ctypes.byref(self.model),
            ctypes.byref(block),
            n,
            ids.ctypes.data,
            x.data_ptr(),
            positions.ctypes.data,
            base_ptr,
            slots_ptr,
            width,
            out.data_ptr(),
            self.threads,
        )
        if code != 0:
            raise NativeHeadError(f"the native head step refused {n} rows (code {code})")
        return out

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> logits over the head vocabulary [n, N]."""
        x = states.float().contiguous()
        y = torch.empty((x.shape[0], self.rows.out_features), dtype=torch.float32)
        if x.shape[0] == 0:
            return y
        code = self.lib.ss_linear_forward(
            ctypes.byref(self.rows), x.data_ptr(), x.shape[0], y.data_ptr(), self.threads
        )
        if code != 0:
            raise NativeHeadError(f"the head's output rows refused {x.shape[0]} rows (code {code})")
        return y
