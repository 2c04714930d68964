"""The whole forward pass of decode/verify rows as one native call (kernels/native).

Holds the weights in the checkpoint's own blocks where the file has them (Q4_1 layers, a
Q8_0 embedding/head) and fp32 elsewhere, packed once into the C structs the library reads.
Every array the structs point at is kept referenced here, so nothing is freed under them.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

import numpy as np
import torch

from engine.hostmem.huge_pages import copy_array
from engine.model.embedding import TokenEmbedding
from engine.model.gguf_file import Checkpoint
from engine.model.greedy_head import GreedyHead
from kernels.native import abi
from kernels.native.build import NativeBuild, load
from shared.modelfile.config import ModelConfig

log = logging.getLogger(__name__)


class NativeStepError(RuntimeError):
    """The native library refused a step (a bug in the caller: bad ids or positions)."""


@dataclass(frozen=True)
class NativeBytes:
    weights: int  # bytes of every matrix in its native form (the memory they hold)
    per_step_b1: int  # bytes of matrices one batch-1 step reads (head included)
    # The head's int8 twin (greedy_head.py): held beside the head, read instead of it by a
    # step whose rows are all greedy.
    greedy_twin: int = 0


def _stack(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]


def _fp16_field(blocks: np.ndarray, offset: int) -> np.ndarray:
    """One fp16 field of every block, as fp32 [out, blocks]."""
    raw = np.ascontiguousarray(blocks[..., offset : offset + 2])
    return np.ascontiguousarray(raw.view(np.float16)[..., 0].astype(np.float32))


def repack(
    kind: int, blocks: np.ndarray, tile: int = 16
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """GGUF blocks [out, in/32, 20|34] -> (quants, fp32 scales, fp32 mins or None), the layout
    the kernel reads (see decode_step.c, linear_a8.h): the same values, nothing re-quantized.
    The _A8_TILES kinds carry their scales inside tiles of `tile` outputs (the build's
    ss_a8_tiles()): (tiles, None, None)."""
    if kind in (abi.Q4_1_A8_TILES, abi.Q8_0_A8_TILES):
        return _tiles(kind, blocks, tile), None, None
    if kind in (abi.Q4_1, abi.Q4_1_A8):
        quants = np.ascontiguousarray(blocks[..., 4:20])
        if kind == abi.Q4_1_A8:
            quants = _regroup_nibbles(quants)
        return quants, _fp16_field(blocks, 0), _fp16_field(blocks, 2)
    quants = np.ascontiguousarray(blocks[..., 2:34]).view(np.int8)
    if kind == abi.Q8_0_A8:
        # VNNI multiplies unsigned by signed bytes, so the kernel takes (x_q + 128) . q and
        # subtracts 128 * d * sum(q) per block, kept here where Q4_1 keeps its mins.
        sums = quants.astype(np.int32).sum(axis=-1).astype(np.float32)
        scales = _fp16_field(blocks, 0)
        return quants, scales, np.ascontiguousarray(-128.0 * scales * sums, dtype=np.float32)
    return quants, _fp16_field(blocks, 0), None


def _tiles(kind: int, blocks: np.ndarray, tile: int) -> np.ndarray:
    """GGUF blocks -> linear_a8.h's tiles of `tile` outputs [tiles, blocks, bytes] (uint8): per
    tile and block, the quants as vectors of 4 bytes per output, then the file's fp16 scales
    (and Q4_1's fp16 mins, or Q8_0's int16 quant sums). Outputs are padded to whole tiles
    with zero blocks, whose products are zero and never stored."""
    if tile not in (8, 16):
        raise ValueError(f"tiles are 8 or 16 outputs wide, not {tile}")
    out, nb, width = blocks.shape
    tiles = -(-out // tile)
    padded = np.zeros((tiles * tile, nb, width), dtype=np.uint8)
    padded[:out] = blocks
    per_tile = padded.reshape(tiles, tile, nb, width)

    def by_block(field: np.ndarray) -> np.ndarray:  # [tiles, 16, nb, k] -> [tiles, nb, 16 * k]
        return field.transpose(0, 2, 1, 3).reshape(tiles, nb, -1)

    if kind == abi.Q4_1_A8_TILES:
        quants = per_tile[..., 4:20].reshape(tiles, tile, nb, 4, 4)
        parts = [per_tile[..., 0:2], per_tile[..., 2:4]]  # fp16 scales, fp16 mins
    else:
        quants = per_tile[..., 2:34].reshape(tiles, tile, nb, 8, 4)
        sums = per_tile[..., 2:34].view(np.int8).astype(np.int16).sum(axis=-1, dtype=np.int16)
        sum_bytes = np.ascontiguousarray(sums).view(np.uint8).reshape(tiles, tile, nb, 2)
        parts = [per_tile[..., 0:2], sum_bytes]  # fp16 scales, int16 sums
    # [tiles, outputs, nb, v, 4 bytes] -> [tiles, nb, v, outputs, 4 bytes]
    vectors = quants.transpose(0, 2, 3, 1, 4).reshape(tiles, nb, -1)
    return np.ascontiguousarray(np.concatenate([vectors] + [by_block(f) for f in parts], axis=-1))


def _regroup_nibbles(quants: np.ndarray) -> np.ndarray:
    """Q4_1 nibbles [out, blocks, 16] in the file's layout -> linear_a8.h's: per 4 blocks,
    byte k holds element k (low) and 64 + k (high); a trailing pair, k and 32 + k; a trailing
    single block stays as it is. Two masks of a 64-byte load then give elements in order."""
    out, nb, _ = quants.shape
    values = np.concatenate([quants & 0x0F, quants >> 4], axis=-1).reshape(out, nb * 32)
    parts = []
    groups = nb // 4
    if groups:
        g = values[:, : groups * 128].reshape(out, groups, 2, 64)
        parts.append((g[:, :, 0] | (g[:, :, 1] << 4)).reshape(out, groups * 64))
    done = groups * 4
    if nb - done >= 2:
        p = values[:, done * 32 : (done + 2) * 32].reshape(out, 2, 32)
        parts.append(p[:, 0] | (p[:, 1] << 4))
        done += 2
    if nb - done == 1:
        parts.append(quants[:, done])
    packed = np.concatenate(parts, axis=1).astype(np.uint8)
    return np.ascontiguousarray(packed.reshape(out, nb, 16))


def int8_kinds(lib) -> tuple[int, int, int]:
    """(Q4_1 kind, Q8_0 kind, outputs per tile) this build multiplies int8 activations with:
    tiles where it has them (Q4_1: VNNI-512 and AVX2; Q8_0: VNNI-512), else the row-major
    _A8 layout (tile 0 where neither is tiled)."""
    tile = lib.ss_a8_tiles()
    q4_1 = abi.Q4_1_A8_TILES if tile else abi.Q4_1_A8
    q8_0 = abi.Q8_0_A8_TILES if lib.ss_a8_q8_tiles() else abi.Q8_0_A8
    return q4_1, q8_0, tile


# How the native step multiplies: "fp32" activations against the dequantized blocks (the fp32
# build's products in another order), or "int8" activations with integer dot products
# (linear_a8.h: faster, lossy, gated by a report of its own).
ACTIVATIONS = ("fp32", "int8")

KV_KINDS = {torch.float32: abi.KV_F32, torch.float16: abi.KV_F16}


class NativeStep:
    def __init__(
        self,
        checkpoint: Checkpoint,
        embed: TokenEmbedding,
        rope_cos,
        rope_sin,
        build,
        activations: str = "fp32",
    ):
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {ACTIVATIONS}, not {activations!r}")
        self.activations = activations
        self.build: NativeBuild = build
        lib = build.library
        assert lib is not None
        self.lib = lib
        cfg: ModelConfig = checkpoint.config
        self.config = cfg
        self._keep: list[object] = []  # arrays the C structs point into
        t = checkpoint.tensors
        self._weight_bytes = 0
        *self._int8_kinds, self._tile = int8_kinds(lib)
        layers = (abi.Layer * cfg.num_layers)()
        for i in range(cfg.num_layers):
            p = f"layers.{i}."
            layer = layers[i]
            layer.input_norm = self._f32_ptr(t[p + "input_norm"])
            layer.post_norm = self._f32_ptr(t[p + "post_attention_norm"])
            layer.qkv = self._linear(checkpoint, [p + "q_proj", p + "k_proj", p + "v_proj"])
            layer.o_proj = self._linear(checkpoint, [p + "o_proj"])
            layer.gate_up = self._linear(checkpoint, [p + "gate_proj", p + "up_proj"])
            layer.down = self._linear(checkpoint, [p + "down_proj"])
        self._layers = layers
        head_name = "lm_head" if "lm_head" in t else "embed_tokens"
        # The head decides the argmax, and it is bound by its bytes, not its instructions: int8
        # activations there gained 0.1 ms a step and cost top-1 agreement, so it keeps fp32.
        self.embedding = embed
        # A tied head in Q8_0 is the embedding's own blocks: one copy serves both.
        self.shares_embedding = head_name == "embed_tokens" and embed.quantized
        head_blocks: tuple[np.ndarray, np.ndarray] | None = None  # a Q8_0 head's quants, scales
        if self.shares_embedding:
            assert embed.quants is not None and embed.scales is not None
            self._head = abi.Linear(
                abi.Q8_0,
                cfg.vocab_size,
                cfg.hidden_size,
                0,
                embed.quants.ctypes.data,
                embed.scales.ctypes.data,
                None,
            )
            head_blocks = embed.quants, embed.scales
        else:
            self._head, arrays = self._packed(checkpoint, [head_name], int8=False)
            if self._head.kind == abi.Q8_0:
                head_blocks = arrays[0], arrays[1]
        # Greedy rows take their token through the head's int8 twin (greedy_head.py): the
        # same argmax, past a few rows at a third of the head's cost.
        self.greedy: GreedyHead | None = None
        self._twin_bytes = 0  # memory of the head's int8 twin, which no step reads beside it
        if head_blocks is not None:
            before = self._weight_bytes
            twin, _ = self._packed(checkpoint, [head_name], int8=True)
            self._twin_bytes, self._weight_bytes = self._weight_bytes - before, before
            self.greedy = GreedyHead(lib, *head_blocks, twin, lambda: self.threads)
        if embed.quantized:
            assert embed.quants is not None and embed.scales is not None
            embed_rows, embed_quants, embed_scales = None, embed.quants, embed.scales
        else:
            assert embed.dense is not None
            self._embed = embed.dense.contiguous().float()
            embed_rows, embed_quants, embed_scales = self._embed.data_ptr(), None, None
        self._cos = rope_cos.contiguous()
        self._sin = rope_sin.contiguous()
        self.model = abi.Model(
            num_layers=cfg.num_layers,
            hidden=cfg.hidden_size,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            intermediate=cfg.intermediate_size,
            vocab=cfg.vocab_size,
            max_pos=self._cos.shape[0],
            eps=cfg.rms_norm_eps,
            scale=cfg.head_dim**-0.5,
            embed=embed_rows,
            final_norm=self._f32_ptr(t["norm"]),
            rope_cos=self._cos.data_ptr(),
            rope_sin=self._sin.data_ptr(),
            layers=layers,
            head=self._head,
            embed_quants=embed_quants.ctypes.data if embed_quants is not None else None,
            embed_scales=embed_scales.ctypes.data if embed_scales is not None else None,
        )

    @property
    def threads(self) -> int:
        # Read per call: the engine sets torch's thread count after the model is built.
        return max(1, torch.get_num_threads())

    @classmethod
    def create(
        cls,
        checkpoint: Checkpoint,
        embed: TokenEmbedding,
        rope_cos,
        rope_sin,
        activations="fp32",
    ) -> tuple[NativeStep | None, str]:
        """The native step for this checkpoint, or None and why not."""
        cfg = checkpoint.config
        if not cfg.is_plain_llama:
            return None, (
                f"the native step computes Llama's layout only; '{cfg.architecture}' "
                "(or its config's extras) runs on the torch path"
            )
        if embed.dense is not None and embed.dense.device.type != "cpu":
            return None, "the native step runs on CPU only"
        build = load()
        if not build.available:
            return None, build.reason
        if cfg.head_dim > 512 or cfg.num_heads % cfg.num_kv_heads:
            return None, f"head_dim {cfg.head_dim} / GQA layout not supported by the native step"
        return cls(checkpoint, embed, rope_cos, rope_sin, build, activations), build.reason

    # ------------------------------------------------------------------ packing

    def _f32_ptr(self, tensor: torch.Tensor) -> int:
        arr = tensor.detach().float().contiguous()
        self._keep.append(arr)
        return arr.data_ptr()

    def _linear(
        self, checkpoint: Checkpoint, names: list[str], int8: bool | None = None
    ) -> abi.Linear:
        """One matrix (rows of `names` stacked) in the file's own blocks when all parts share
        a block type, else fp32."""
        return self._packed(checkpoint, names, int8)[0]

    def _packed(
        self, checkpoint: Checkpoint, names: list[str], int8: bool | None = None
    ) -> tuple[abi.Linear, list[np.ndarray]]:
        """_linear's matrix and the arrays it points into (quants and scales first)."""
        t = checkpoint.tensors
        out = sum(t[n].shape[0] for n in names)
        inp = t[names[0]].shape[1]
        int8 = self.activations == "int8" if int8 is None else int8
        for kind, blocks in (
            (self._int8_kinds[0] if int8 else abi.Q4_1, checkpoint.q4_1_blocks),
            (self._int8_kinds[1] if int8 else abi.Q8_0, checkpoint.q8_0_blocks),
        ):
            if all(n in blocks for n in names):
                # Copied onto huge pages: every step streams all of them (see huge_pages.py).
                quants, scales, mins = (
                    None if a is None else copy_array(a)
                    for a in repack(kind, _stack([blocks[n] for n in names]), self._tile)
                )
                arrays = [a for a in (quants, scales, mins) if a is not None]
                self._keep.extend(arrays)
                self._weight_bytes += sum(a.nbytes for a in arrays)
                linear = abi.Linear(
                    kind,
                    out,
                    inp,
                    0,
                    quants.ctypes.data,
                    scales.ctypes.data if scales is not None else None,
                    mins.ctypes.data if mins is not None else None,
                )
                return linear, arrays
        dense = torch.cat([t[n] for n in names], dim=0).float().contiguous()
        self._keep.append(dense)
        self._weight_bytes += dense.numel() * 4
        return abi.Linear(abi.F32, out, inp, 0, dense.data_ptr(), None, None), []

    def matrix(self, layer: int, name: str) -> NativeMatrix:
        """One of a layer's matrices (qkv, o_proj, gate_up, down) as a callable, or the head
        (layer -1): what a dense forward pass (the quality gate's) calls in place of Linear."""
        linear = self._head if layer < 0 else getattr(self._layers[layer], name)
        return NativeMatrix(self, linear)

    @property
    def nbytes(self) -> NativeBytes:
        """Memory the matrices hold (a head shared with the embedding is the embedding's),
        and bytes a batch-1 step reads (that head included)."""
        shared = self.embedding.nbytes if self.shares_embedding else 0
        return NativeBytes(self._weight_bytes, self._weight_bytes + shared, self._twin_bytes)

    # ------------------------------------------------------------------ running

    def forward(
        self,
        token_ids: np.ndarray,  # int64 [rows]
        positions: np.ndarray,  # int32 [rows]
        block_tables: np.ndarray,  # int32 [rows, max_blocks]: each row's sequence's blocks
        cache: torch.Tensor,  # the KV pool tensor (fp32 or fp16, block-major)
        block_size: int,
        # Draft trees (decode_step.c, ss_forward_tree): int32 [rows] where each row's
        # remapped positions start, and int32 [rows, width] their slots.
        tree_base: np.ndarray | None = None,
        tree_slots: np.ndarray | None = None,
    ) -> torch.Tensor:  # [rows, hidden] final-normed hidden states
        rows = int(token_ids.shape[0])
        out = torch.empty((rows, self.config.hidden_size), dtype=torch.float32)
        kind = KV_KINDS.get(cache.dtype)
        if kind is None:
            raise NativeStepError(f"the native step reads fp32 or fp16 KV, not {cache.dtype}")
        kv = abi.KV(
            cache.data_ptr(), block_size, block_tables.shape[1], block_tables.ctypes.data, kind, 0
        )
        trees = tree_base is not None and tree_slots is not None
        code = self.lib.ss_forward_tree(
            ctypes.byref(self.model),
            ctypes.byref(kv),
            rows,
            token_ids.ctypes.data,
            positions.ctypes.data,
            tree_base.ctypes.data if trees else None,  # type: ignore[union-attr]
            tree_slots.ctypes.data if trees else None,  # type: ignore[union-attr]
            tree_slots.shape[1] if trees else 0,  # type: ignore[union-attr]
            out.data_ptr(),
            self.threads,
        )
        if code != 0:
            raise NativeStepError(f"native step refused a batch of {rows} rows (code {code})")
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.matrix(-1, "head")(hidden)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Each row's argmax of `logits(hidden)` ([rows] long), or None where this head has
        no int8 twin (not Q8_0): the caller takes the logits."""
        if self.greedy is None:
            return None
        return self.greedy.tokens(hidden, lambda h: self.logits(h).argmax(dim=-1))


class NativeMatrix:
    """y = x @ W.T through the native kernel, for any number of rows."""

    def __init__(self, step: NativeStep, linear: abi.Linear):
        self.step = step
        self.linear = linear

    @property
    def nbytes_per_call(self) -> int:
        n = self.linear.out_features * self.linear.in_features
        blocks = n // abi.GROUP
        per_block = {
            abi.Q4_1: 24,
            abi.Q4_1_A8: 24,
            abi.Q4_1_A8_TILES: 20,
            abi.Q8_0: 36,
            abi.Q8_0_A8: 40,
            abi.Q8_0_A8_TILES: 36,
        }
        return blocks * per_block[self.linear.kind] if self.linear.kind in per_block else n * 4

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float().contiguous()
        y = torch.empty((x.shape[0], self.linear.out_features), dtype=torch.float32)
        if x.shape[0] == 0:
            return y
        code = self.step.lib.ss_linear_forward(
            ctypes.byref(self.linear), x.data_ptr(), x.shape[0], y.data_ptr(), self.step.threads
        )
        if code != 0:
            raise NativeStepError(f"native matrix refused {x.shape[0]} rows (code {code})")
        return y
