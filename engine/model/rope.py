"""Rotary position embeddings: rotate-half RoPE, with the frequency rescalings configs ask for."""

from __future__ import annotations

import math

import torch

from shared.modelfile.config import RopeScaling


def inverse_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None = None
) -> torch.Tensor:
    """Per rotated pair, radians per position (float64, so long contexts keep their angles)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "factors":
        if len(scaling.freq_factors) != len(inv_freq):
            raise ValueError(
                f"{len(scaling.freq_factors)} RoPE frequency factors for {len(inv_freq)} pairs"
            )
        return inv_freq / torch.tensor(scaling.freq_factors, dtype=torch.float64)
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between
    # blended smoothly (Llama 3.1's context extension).
    old = scaling.original_max_position
    low_wavelen = old / scaling.low_freq_factor
    high_wavelen = old / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding:
    """Rotate-half RoPE with cos/sin tables precomputed for every position."""

    def __init__(
        self,
        head_dim: int,
        theta: float,
        max_position: int,
        device: torch.device,
        scaling: RopeScaling | None = None,
    ):
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
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
