"""Timing one replica's engine: prefill by prompt length and cached prefix, decode steps by
batch and context, and KV transfer by size between two real processes.

Decode is measured without prefilling the batch: the decode role's own entry point
(`reserve_blocks` + `add_prefilled`, what a pushed KV lands in) admits sequences at any
context at once, and a step costs the same whatever numbers sit in the KV. A cached prefix is
put in place the same way, so only the timed prefill is ever computed.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence

from engine.core.engine import Engine
from shared.sampling.params import SamplingParams
from tools.profiler.fit import DecodePoint, PrefillPoint, TransferPoint

Progress = Callable[[str], None]


class PromptSource:
    """Random token ids, distinct per call so no two prompts share a cached block."""

    def __init__(self, vocab_size: int, seed: int = 0):
        self._rng = random.Random(seed)
        self._vocab = vocab_size

    def __call__(self, length: int) -> list[int]:
        return [self._rng.randrange(100, self._vocab - 100) for _ in range(length)]


def _plant_prefix(engine: Engine, prefix: list[int], tag: str) -> None:
    """Make `prefix` a cached prefix without computing it (its KV content is irrelevant)."""
    table = engine.reserve_blocks(len(prefix))
    if table is None:
        raise RuntimeError(f"the profiling engine has no room for a {len(prefix)}-token prefix")
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    engine.add_prefilled(tag, prefix, 0, table, params)
    engine.abort(tag)  # its full blocks stay in the prefix cache


def time_prefill(engine: Engine, prompts: PromptSource, tokens: int, cached: int) -> float:
    """Milliseconds from adding a `tokens`-long prompt (first `cached` cached) to its token."""
    prompt = prompts(tokens)
    if cached:
        _plant_prefix(engine, prompt[:cached], f"prefix-{id(prompt)}")
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    rid = engine.add_request(prompt, params)
    for out in engine.run_until_done():
        if out.request_id == rid and out.num_cached_tokens != cached:
            raise RuntimeError(
                f"expected {cached} cached tokens, the engine reused {out.num_cached_tokens}"
            )
    return (time.perf_counter() - start) * 1e3


def measure_prefill(
    engine: Engine,
    lengths: Sequence[int],
    fractions: Sequence[float],
    repeats: int,
    progress: Progress,
) -> list[PrefillPoint]:
    prompts = PromptSource(engine.model.config.vocab_size, seed=1)
    block = engine.config.block_size
    time_prefill(engine, prompts, 64, 0)  # first-call allocations are not a prefill's cost
    points = []
    for tokens in lengths:
        for fraction in fractions:
            # Whole blocks only (the cache holds full blocks), and never the whole prompt.
            cached = min(int(tokens * fraction) // block * block, (tokens - 1) // block * block)
            # The least disturbed run: on a shared machine noise only ever adds time.
            times = [time_prefill(engine, prompts, tokens, cached) for _ in range(repeats)]
            points.append(PrefillPoint(tokens, cached, min(times)))
            progress(f"prefill {tokens} tokens, {cached} cached: {points[-1].ms:.1f} ms")
    return points


def time_decode(
    engine: Engine, prompts: PromptSource, batch: int, context: int, steps: int, warmup: int = 1
) -> DecodePoint:
    params = SamplingParams(temperature=0.0, max_tokens=steps + warmup + 8, ignore_eos=True)
    ids = []
    for i in range(batch):
        table = engine.reserve_blocks(context)
        if table is None:
            raise RuntimeError(f"the profiling engine has no room for batch {batch} x {context}")
        prompt = prompts(context)
        rid = f"decode-{batch}-{context}-{i}"
        engine.add_prefilled(rid, prompt, 0, table, params)
        ids.append(rid)
    try:
        for _ in range(warmup):
            engine.step()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            times.append((time.perf_counter() - start) * 1e3)
        ms = statistics.median(times)  # one disturbed step does not move it
    finally:
        for rid in ids:
            engine.abort(rid)
    # The timed steps attend to this many positions per sequence on average.
    return DecodePoint(batch, context + 1 + warmup + steps // 2, ms)


# Decode points are timed in rounds, every point once per round, each keeping its best: a
# slow spell of a shared machine then costs one round of every point rather than all of one
# point's steps (a profile measured here once put batch 1 at 41.6 ms a step, batch 8 at
# 40.8; the same step timed alone took 18 ms, and the simulator inherited the error).
DECODE_ROUNDS = 2


def measure_decode(
    engine: Engine,
    batches: Sequence[int],
    contexts: Sequence[int],
    steps: int,
    progress: Progress,
    rounds: int = DECODE_ROUNDS,
) -> list[DecodePoint]:
    prompts = PromptSource(engine.model.config.vocab_size, seed=2)
    best: dict[tuple[int, int], DecodePoint] = {}
    for _ in range(rounds):
        for context in contexts:
            for batch in batches:
                point = time_decode(engine, prompts, batch, context, steps)
                kept = best.get((batch, context))
                if kept is None or point.ms < kept.ms:
                    best[(batch, context)] = point
    keys = [(batch, context) for context in contexts for batch in batches]
    for batch, context in keys:
        progress(
            f"decode batch {batch}, context {context}: {best[(batch, context)].ms:.1f} ms/step"
        )
    return [best[key] for key in keys]


def measure_transfer(
    sizes_mib: Sequence[int], repeats: int, progress: Progress
) -> list[TransferPoint]:
    """Real transfers over the shm backend between two processes (control plane included)."""
    from tools.bench.transfer_bench import run_transfer_bench

    report = run_transfer_bench(sizes_mib=sizes_mib, backends=("shm",), repeats=repeats)
    points = []
    for size in sizes_mib:
        nbytes = size << 20
        gb_s = report["backends"]["shm"][f"gb_s_{size}mib"]
        points.append(TransferPoint(nbytes, nbytes / (gb_s * 1e6)))
        progress(f"transfer {size} MiB: {points[-1].ms:.2f} ms")
    return points
