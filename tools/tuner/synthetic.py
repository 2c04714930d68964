"""Synthetic traces: arrivals and lengths whose consequences can be worked out by hand (tests,
and sanity checks of the simulator against queueing arithmetic)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tools.tuner.trace import Trace


def uniform_trace(
    n: int, every_ms: float, input_tokens: int, output_tokens: int, name: str = "uniform"
) -> Trace:
    """n identical requests, one every `every_ms`."""
    return Trace(
        name=name,
        format="synthetic",
        arrival_ms=np.arange(n, dtype=np.float64) * every_ms,
        input_tokens=np.full(n, input_tokens, dtype=np.int64),
        output_tokens=np.full(n, output_tokens, dtype=np.int64),
    )


def poisson_trace(
    n: int,
    rate_per_s: float,
    mean_input: float,
    mean_output: float,
    seed: int = 0,
    hash_ids: Sequence[tuple[int, ...]] | None = None,
    block_tokens: float = 512,
) -> Trace:
    """Poisson arrivals, geometric-ish (exponential, rounded) lengths of the given means."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1e3 / rate_per_s, size=n))
    inputs = np.maximum(1, np.rint(rng.exponential(mean_input, size=n))).astype(np.int64)
    outputs = np.maximum(1, np.rint(rng.exponential(mean_output, size=n))).astype(np.int64)
    return Trace(
        name=f"poisson-{seed}",
        format="synthetic",
        arrival_ms=arrivals - arrivals[0],
        input_tokens=inputs,
        output_tokens=outputs,
        hash_ids=list(hash_ids) if hash_ids is not None else None,
        block_tokens=block_tokens,
    )
