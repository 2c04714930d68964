"""Anchoring a profile to the live stack's speed right now, from isolated probe requests.

This machine's CPUs are shared, so a replica's speed drifts with whatever else runs: a
profile measured minutes earlier can be off by half in either direction, which says nothing
about the simulator. So the live check first sends a few requests one at a time (no queueing,
no batching: nothing the simulator has to predict) and fits, against the profile's own
predictions for them, a prefill speed factor plus a fixed serving overhead, and a decode
speed factor. The shapes (how cost grows with length, batch and context) stay the profile's.

One more thing is particular to a local stack: its prefill and decode replicas share the
machine's cores, so a prefill runs slower while the decode replica is busy (about 2x here),
which a fleet of separate accelerators does not do, and a decode step slows while a prompt
prefills. Probes sent while a long reply streams measure both; the live check applies each
over the part of its simulated busy time the neighbour is busy too (`colocation`).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import statistics
import time
from dataclasses import asdict, dataclass, replace

import httpx
import numpy as np

from services.planner.replica_profile import ReplicaProfile
from tools.profiler.fit import nnls
from tools.tuner.validate_client import collect_token_times, stream_completion

ALONE_LENGTHS = (32, 256, 1024)
BUSY_LENGTHS = (128, 512)
PROBE_TOKENS = 12


@dataclass(frozen=True)
class Probe:
    tokens: int
    ttft_ms: float
    itl_p50_ms: float
    neighbour_busy: bool  # a decode stream was running on the other replica meanwhile
    # That stream's median gap while this prompt prefilled, over its median gap before.
    neighbour_slowdown: float | None = None


@dataclass(frozen=True)
class Anchoring:
    profile: ReplicaProfile  # the profile at the probes' speed, replicas undisturbed
    prefill_factor: float
    serving_overhead_ms: float
    decode_factor: float
    busy_prefill_slowdown: float  # prefill time with the decode replica busy / without
    busy_decode_slowdown: float  # decode step with the prefill replica busy / without

    def report(self) -> dict:
        out = asdict(self)
        del out["profile"]
        return out


class Prober:
    def __init__(self, base_url: str, model: str, vocab_size: int, seed: int):
        self.url = f"{base_url}/completions"
        self.model = model
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)

    def _body(self, length: int, tokens: int) -> dict:
        return {
            "model": self.model,
            "prompt": [self.rng.randrange(100, self.vocab_size - 100) for _ in range(length)],
            "max_tokens": tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
        }

    async def _one(self, client: httpx.AsyncClient, length: int, busy: bool) -> Probe:
        timing = await stream_completion(client, self.url, self._body(length, PROBE_TOKENS))
        if timing.error or timing.ttft_ms is None or not timing.itl_ms:
            raise RuntimeError(f"probe of {length} tokens failed: {timing.error}")
        return Probe(length, timing.ttft_ms, statistics.median(timing.itl_ms), busy)

    async def run(self) -> list[Probe]:
        probes = []
        async with httpx.AsyncClient() as client:
            for length in ALONE_LENGTHS:
                probes.append(await self._one(client, length, busy=False))
            for length in BUSY_LENGTHS:
                probes.append(await self._beside_a_decode(client, length))
        return probes

    async def _beside_a_decode(self, client: httpx.AsyncClient, length: int) -> Probe:
        """A prompt prefilled while a long reply streams from the decode replica: how much
        each slows the other down."""
        times: list[float] = []
        body = self._body(32, 4000)
        neighbour = asyncio.create_task(collect_token_times(client, self.url, body, times))
        await asyncio.sleep(1.0)
        start = time.perf_counter()
        probe = await self._one(client, length, busy=True)
        end = start + probe.ttft_ms / 1e3
        neighbour.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await neighbour
        gaps = [(b - a, b) for a, b in zip(times, times[1:], strict=False)]
        before = [g for g, at in gaps if at < start]
        during = [g for g, at in gaps if start < at <= end]
        slowdown = None
        if len(before) >= 3 and during:
            slowdown = statistics.median(during) / statistics.median(before)
        return replace(probe, neighbour_slowdown=slowdown)


def probe(base_url: str, model: str, vocab_size: int, seed: int) -> list[Probe]:
    return asyncio.run(Prober(base_url, model, vocab_size, seed).run())


def anchor(profile: ReplicaProfile, probes: list[Probe]) -> Anchoring:
    """Fit live TTFT = a * prefill + b and ITL = c * step on the undisturbed probes (the first
    token is streamed before the KV push, so no transfer is in it); the busy probes' prefill
    time over `a * prefill` is what a busy neighbour costs."""
    alone = [p for p in probes if not p.neighbour_busy]
    busy = [p for p in probes if p.neighbour_busy]
    compute = np.array([profile.prefill_ms(p.tokens) for p in alone])
    rest = np.array([p.ttft_ms for p in alone])
    a, b = nnls(np.stack([compute, np.ones_like(compute)], 1), rest)
    if a <= 0:  # probes too noisy to show any growth with length: keep the profile's speed
        a, b = 1.0, max(0.0, float(np.median(rest - compute)))
    steps = [profile.decode.step(1, p.tokens + 1 + PROBE_TOKENS // 2) for p in alone]
    c = float(np.median([p.itl_p50_ms / s for p, s in zip(alone, steps, strict=True)]))
    anchored = profile.rescaled(float(a), c, float(b))
    slowdown = 1.0
    if busy:
        ratios = [(p.ttft_ms - b) / anchored.prefill_ms(p.tokens) for p in busy]
        slowdown = max(1.0, float(np.median(ratios)))
    neighbour = [p.neighbour_slowdown for p in busy if p.neighbour_slowdown is not None]
    decode_slowdown = max(1.0, float(np.median(neighbour))) if neighbour else 1.0
    return Anchoring(anchored, float(a), float(b), c, slowdown, decode_slowdown)
