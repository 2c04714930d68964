"""Fitting the cost models to measured points: non-negative least squares on a handful of
features, plus the worst relative error of the fit so a profile says how far to trust it.

Coefficients are kept non-negative because a negative cost (a step that gets cheaper with
more tokens) extrapolates to nonsense in the simulator, however well it fits the grid.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from services.planner.replica_profile import (
    DecodeModel,
    PrefillModel,
    TransferModel,
    chunk_plan,
    touched_fraction,
)


@dataclass(frozen=True)
class PrefillPoint:
    tokens: int
    cached: int
    ms: float


@dataclass(frozen=True)
class DecodePoint:
    batch: int
    context: int  # per sequence
    ms: float  # one step


@dataclass(frozen=True)
class TransferPoint:
    nbytes: int
    ms: float


@dataclass(frozen=True)
class Fit:
    coefficients: tuple[float, ...]
    max_rel_error: float


def nnls(features: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Least squares with coefficients >= 0 (active set: drop the most negative, refit).

    Rows are weighted by 1/target so that small and large measurements count alike (relative
    error is what a latency prediction is judged by)."""
    weights = 1.0 / np.maximum(target, 1e-9)
    a = features * weights[:, None]
    b = target * weights
    active = list(range(features.shape[1]))
    coef = np.zeros(features.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0.0
            coef[active] = sol
            return coef
        del active[int(np.argmin(sol))]
    return coef


def _fit(features: np.ndarray, target: np.ndarray) -> Fit:
    if len(target) < features.shape[1]:
        raise ValueError(f"{len(target)} measurements cannot fit {features.shape[1]} coefficients")
    coef = nnls(features, target)
    predicted = features @ coef
    error = float(np.max(np.abs(predicted - target) / np.maximum(target, 1e-9)))
    return Fit(tuple(float(c) for c in coef), error)


def fit_prefill(points: Sequence[PrefillPoint], chunk_tokens: int) -> tuple[PrefillModel, float]:
    rows = [chunk_plan(p.tokens, p.cached, chunk_tokens) for p in points]
    fit = _fit(np.array(rows, dtype=float), np.array([p.ms for p in points]))
    return PrefillModel(*fit.coefficients), fit.max_rel_error


def fit_decode(
    points: Sequence[DecodePoint], experts: int = 0, experts_per_token: int = 0
) -> tuple[DecodeModel, float]:
    """With `experts`, one more feature: the fraction of experts a batch touches (MoE)."""
    rows = [
        (1.0, p.batch, p.batch * p.context, float(p.batch * p.context) ** 2)
        + ((touched_fraction(experts, experts_per_token, p.batch),) if experts else ())
        for p in points
    ]
    fit = _fit(np.array(rows, dtype=float), np.array([p.ms for p in points]))
    base, seq, ctx, ctx2, *moe = fit.coefficients
    if not moe:
        return DecodeModel(base, seq, ctx, ctx2), fit.max_rel_error
    return DecodeModel(base, seq, ctx, ctx2, moe[0], experts, experts_per_token), fit.max_rel_error


def fit_transfer(points: Sequence[TransferPoint]) -> tuple[TransferModel, float]:
    rows = [(1.0, p.nbytes / 1e6) for p in points]
    fit = _fit(np.array(rows, dtype=float), np.array([p.ms for p in points]))
    latency, ms_per_mb = fit.coefficients
    if ms_per_mb <= 0:
        raise ValueError("transfer times do not grow with size: cannot fit a bandwidth")
    return TransferModel(latency, 1.0 / ms_per_mb), fit.max_rel_error
