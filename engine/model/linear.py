"""Linear layers in the torch weight formats: fp32, bf16, int8 / int4 weight-only.

torch's quantized CPU kernels are only fast with bf16 activations (fp32 activations fall to a
slow generic path), so the non-fp32 formats round matmul inputs to bf16; the residual stream
stays fp32. Which format is fastest depends on the CPU (a CPU without native bf16 runs bf16
GEMMs several times slower than fp32): `engine/model/formats.py` measures it per machine.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from engine.model.fp32_gemm import aligned, fp32_linear, register

WeightFormat = Literal["fp32", "bf16", "int8", "int4"]
WEIGHT_FORMATS: tuple[str, ...] = ("fp32", "bf16", "int8", "int4")

INT4_GROUP = 32
_INNER_K_TILES = 8


def _int4_from_q4_1(blocks: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Reuse a GGUF Q4_1 tensor's own quantization: w = d*q + m == (q - 8)*d + (m + 8d)."""
    out, groups, _ = blocks.shape
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)[..., 0]
    m = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)[..., 0]
    qs = blocks[..., 4:20]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(out, groups * INT4_GROUP)
    scale = torch.from_numpy(d)
    zero = torch.from_numpy(m + 8.0 * d)
    return torch.from_numpy(q.astype(np.int32)), torch.stack([scale, zero], dim=-1)


def _int4_from_dense(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric group-wise 4-bit quantization, groups of 32 along the input dimension."""
    out, inp = weight.shape
    grouped = weight.reshape(out, inp // INT4_GROUP, INT4_GROUP)
    lo = grouped.amin(dim=-1, keepdim=True)
    hi = grouped.amax(dim=-1, keepdim=True)
    scale = ((hi - lo) / 15.0).clamp(min=1e-10)
    q = ((grouped - lo) / scale).round().clamp(0, 15).to(torch.int32).reshape(out, inp)
    zero = lo + 8.0 * scale
    return q, torch.cat([scale, zero], dim=-1)


class Linear:
    """y = x @ W.T in one weight format; `weight` is the fp32 reference, [out, in]."""

    def __init__(
        self, weight: torch.Tensor, fmt: WeightFormat, q4_1_blocks: np.ndarray | None = None
    ):
        if fmt not in WEIGHT_FORMATS:
            raise ValueError(f"unknown weight format '{fmt}' (valid: {', '.join(WEIGHT_FORMATS)})")
        self.fmt = fmt
        self.out_features, self.in_features = weight.shape
        self.fp32: torch.Tensor | None = None
        self.bf16: torch.Tensor | None = None
        self.int8: tuple[torch.Tensor, torch.Tensor] | None = None
        self.int4: tuple[torch.Tensor, torch.Tensor] | None = None
        if fmt == "fp32":
            # Aligned: where a file's layout put the weight must not change its products' bits.
            self.fp32 = aligned(weight)
            register(self.fp32)
        if fmt == "bf16":
            self.bf16 = weight.to(torch.bfloat16).contiguous()
        if fmt == "int8":
            scale = weight.abs().amax(dim=1).clamp(min=1e-10) / 127.0
            q = (weight / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
            self.int8 = (q.contiguous(), scale.to(torch.bfloat16))
        if fmt == "int4":
            if self.in_features % INT4_GROUP:
                raise ValueError(f"int4 needs in_features divisible by {INT4_GROUP}")
            q, scales_zeros = (
                _int4_from_q4_1(q4_1_blocks)
                if q4_1_blocks is not None
                else _int4_from_dense(weight)
            )
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, _INNER_K_TILES)
            # Kernel wants [groups, out, 2] in the activation dtype.
            self.int4 = (packed, scales_zeros.transpose(0, 1).contiguous().to(torch.bfloat16))

    @property
    def nbytes_per_call(self) -> int:
        """Weight bytes one call reads at batch 1 (for bandwidth accounting)."""
        n = self.out_features * self.in_features
        if self.fmt == "fp32":
            return n * 4
        if self.fmt == "bf16":
            return n * 2
        if self.fmt == "int8":
            return n + self.out_features * 2
        return n // 2 + (n // INT4_GROUP) * 4  # int4

    @property
    def nbytes_held(self) -> int:
        """Memory this layer's weights take, whatever its format."""
        tensors = [self.fp32, self.bf16, *(self.int8 or ()), *(self.int4 or ())]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp32 is not None:
            return fp32_linear(x, self.fp32)
        xb = x.to(torch.bfloat16)
        if self.int4 is not None:
            packed, scales_zeros = self.int4
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, packed, INT4_GROUP, scales_zeros)
        elif self.int8 is not None:
            q, scale = self.int8
            y = torch.ops.aten._weight_int8pack_mm(xb, q, scale)
        else:
            y = F.linear(xb, self.bf16)
        return y.float()


def fuse_rows(weights: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(weights, dim=0)


def fuse_q4_1(blocks: list[np.ndarray | None]) -> np.ndarray | None:
    if any(b is None for b in blocks):
        return None
    return np.concatenate(blocks, axis=0)
