"""Anchoring a profile to the live stack's speed right now, from isolated probe requests.

This machine's CPUs are shared, so a replica's speed drifts with whatever else runs: a
profile measured minutes earlier can be off by half in either direction, which says nothing
about the simulator. So the live check first sends a few requests one at a time (no queueing,
no batching: nothing the simulator has to predict) and fits, against the profile's own
predictions for them, a prefill speed factor plus a fixed serving overhead, and a decode
speed factor. The shapes (how cost grows with length, batch and context) stay the profile's;
the replayed slice, with its queueing and batching, is what the check then compares.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass

import httpx
import numpy as np

from services.profiler.costmodel import ReplicaProfile
from services.profiler.fit import nnls
from services.tuner.validate_client import stream_completion

PROBE_LENGTHS = (32, 256, 1024)
PROBE_TOKENS = 12


@dataclass(frozen=True)
class Probe:
    tokens: int
    ttft_ms: float
    itl_p50_ms: float


async def probe(base_url: str, model: str, vocab_size: int, seed: int) -> list[Probe]:
    rng = random.Random(seed)
    probes = []
    async with httpx.AsyncClient() as client:
        for length in PROBE_LENGTHS:
            body = {
                "model": model,
                "prompt": [rng.randrange(100, vocab_size - 100) for _ in range(length)],
                "max_tokens": PROBE_TOKENS,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
            }
            timing = await stream_completion(client, f"{base_url}/completions", body)
            if timing.error or timing.ttft_ms is None or not timing.itl_ms:
                raise RuntimeError(f"probe of {length} tokens failed: {timing.error}")
            probes.append(Probe(length, timing.ttft_ms, statistics.median(timing.itl_ms)))
    return probes


def anchor(profile: ReplicaProfile, probes: list[Probe]) -> tuple[ReplicaProfile, dict]:
    """The profile at the probes' speed: live TTFT = a * predicted + b, live ITL = c * step."""
    predicted = np.array(
        [
            profile.prefill_ms(p.tokens) + profile.transfer.ms(p.tokens * profile.kv_bytes_per_token)
            for p in probes
        ]
    )
    live = np.array([p.ttft_ms for p in probes])
    prefill_factor, overhead = nnls(np.stack([predicted, np.ones_like(predicted)], 1), live)
    if prefill_factor <= 0:  # probes too noisy to see any growth: keep the profile's speed
        prefill_factor, overhead = 1.0, max(0.0, float(np.median(live - predicted)))
    steps = [profile.decode.step(1, p.tokens + 1 + PROBE_TOKENS // 2) for p in probes]
    decode_factor = float(np.median([p.itl_p50_ms / s for p, s in zip(probes, steps, strict=True)]))
    anchored = profile.rescaled(float(prefill_factor), decode_factor, float(overhead))
    return anchored, {
        "prefill_factor": float(prefill_factor),
        "serving_overhead_ms": float(overhead),
        "decode_factor": decode_factor,
        "probes": [p.__dict__ for p in probes],
    }
