"""Where a rate is heading: Holt's linear smoothing (an EWMA level plus an EWMA trend).

Samples arrive at uneven intervals (scrapes fail, timers drift), so the trend is kept per
second and the level is carried forward by trend * elapsed time before each update.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Forecast:
    level: float  # smoothed current value
    trend_per_s: float  # smoothed change per second
    predicted: float  # level + trend over the horizon, never negative


def holt_forecast(
    points: Sequence[tuple[float, float]],
    horizon_s: float,
    alpha: float = 0.5,
    beta: float = 0.3,
) -> Forecast:
    """Forecast `horizon_s` past the last of `points` ((t, value), ascending t).

    alpha weighs a new value against the carried level, beta a new slope against the
    carried trend: higher follows changes sooner and noise more.
    """
    if not points:
        return Forecast(0.0, 0.0, 0.0)
    if not (0 < alpha <= 1 and 0 <= beta <= 1):
        raise ValueError(f"alpha must be in (0, 1] and beta in [0, 1]; got {alpha}, {beta}")
    t_prev, level = points[0]
    trend = 0.0
    for t, value in points[1:]:
        dt = t - t_prev
        if dt <= 0:
            continue  # a duplicate timestamp carries no slope
        carried = level + trend * dt
        # A rate is never negative, however steep the fall that the trend carries forward.
        new_level = max(0.0, alpha * value + (1 - alpha) * carried)
        trend = beta * (new_level - level) / dt + (1 - beta) * trend
        level, t_prev = new_level, t
    return Forecast(level, trend, max(0.0, level + trend * horizon_s))
