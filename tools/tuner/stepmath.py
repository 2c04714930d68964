"""Runs of engine steps whose time grows by a fixed amount per step, in closed form.

A decode batch's step grows with its context (every sequence gains a token per step), and a
long prompt's prefill chunks each attend to one chunk more than the last: in both, step i of
a run costs `first + growth * i`. Jumping over a whole run at once, instead of one event per
step, is what lets the simulator replay a trace in seconds.
"""

from __future__ import annotations

import math

UNBOUNDED = 1 << 62  # "as many steps as you like": the span has no end


def run_ms(k: int, first: float, growth: float) -> float:
    """Time of k steps: k * first + growth * k * (k - 1) / 2."""
    return k * first + growth * k * (k - 1) * 0.5


def steps_within(first: float, growth: float, span: float) -> int:
    """The largest k >= 0 whose k steps fit in `span` ms (first > 0, growth >= 0)."""
    if span < first:
        return 0
    if math.isinf(span):
        return UNBOUNDED
    if growth <= 0.0:
        k = int(span / first)
    else:
        # growth/2 k^2 + (first - growth/2) k - span <= 0
        b = first - 0.5 * growth
        k = int((-b + math.sqrt(b * b + 2.0 * growth * span)) / growth)
    # Guard the float rounding either way.
    while k > 0 and run_ms(k, first, growth) > span:
        k -= 1
    while run_ms(k + 1, first, growth) <= span:
        k += 1
    return k


def steps_to_reach(first: float, growth: float, span: float) -> int:
    """The smallest k >= 0 whose k steps take at least `span` ms (a boundary at or after it)."""
    if span <= 0.0:
        return 0
    k = steps_within(first, growth, span)
    return k if run_ms(k, first, growth) >= span else k + 1
