"""Holding the simulator against reality: replay a short slice of a trace on a live local
stack (one prefill and one decode replica, one thread each, as `splitserve up` runs them)
and in the simulator, and compare TTFT p50 and ITL p50.

The simulator runs on the profile anchored to the stack's speed at the time (see
`calibrate`: isolated probe requests just before and after the slice), because on this
shared machine the CPU a replica gets drifts by more than the error being measured; the
error with the profile as measured is reported beside it.

The slice keeps the trace's order, arrival pattern and length mix, cut down to what this
hardware serves in about a minute: lengths scaled and capped (prompts <= `max_prompt`,
replies <= `max_output` tokens) and arrivals stretched so the prefill replica runs at about
`utilization` of its capacity by the profile. Requests the trace gives one timestamp (the
Mooncake trace counts time in 3 s ticks, ten requests to a tick) are then spread
`MIN_GAP_MS` apart in trace order: sent at one instant, they reached the engine in whatever
order their connections raced to (a different one each run), while the engine and the
simulator both serve first come, first served; a burst's TTFT p50 swings by half with that
order (see `spread_ties`). Prompts are token ids sent to
/v1/completions, so their lengths are exact, and two prompts share tokens exactly where their
trace block ids agree, so the live prefix cache sees what the simulated one sees.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import httpx
import numpy as np

from services.planner.replica_profile import ReplicaProfile
from shared.config.router import RouterConfig
from tools.bench.load import RequestTiming, summarize
from tools.tuner.calibrate import Anchoring, anchor, probe
from tools.tuner.colocation import Colocation, simulate_colocated
from tools.tuner.fleet import FleetConfig
from tools.tuner.results import SimResult
from tools.tuner.simulator import simulate
from tools.tuner.trace import Trace
from tools.tuner.validate_client import stream_completion

T = TypeVar("T")

# Two requests of a slice arrive at least this far apart, so the live stack receives them in
# trace order: well above the coordinator's per-request handling (a few ms) and the client's
# scheduling jitter, small beside the seconds a burst queues for.
MIN_GAP_MS = 20.0


@dataclass(frozen=True)
class LiveSlice:
    name: str
    trace: Trace  # the scaled slice, as the simulator replays it
    prompts: list[list[int]]  # token ids, lengths equal trace.input_tokens


def make_slice(
    name: str,
    trace: Trace,
    profile: ReplicaProfile,
    vocab_size: int,
    count: int = 30,
    start: int = 0,
    length_scale: float = 1.0,
    max_prompt: int = 1500,
    max_output: int = 64,
    utilization: float = 0.6,
    seed: int = 0,
) -> LiveSlice:
    window = trace.window(start, count).scaled(1.0, length_scale)
    inputs = np.clip(window.input_tokens, 16, max_prompt)
    outputs = np.clip(window.output_tokens, 2, max_output)
    busy = sum(profile.prefill_ms(int(n)) for n in inputs)
    span = float(window.arrival_ms[-1]) if len(window) > 1 else 0.0
    wanted = busy / utilization
    arrivals = (
        window.arrival_ms * (wanted / span)
        if span > 0
        else np.linspace(0.0, wanted, len(window), endpoint=False)
    )
    sliced = Trace(
        name=f"{trace.name}[{start}:{start + count}]",
        format=trace.format,
        arrival_ms=spread_ties(arrivals, MIN_GAP_MS),
        input_tokens=inputs.astype(np.int64),
        output_tokens=outputs.astype(np.int64),
        hash_ids=window.hash_ids,
        block_tokens=window.block_tokens,
    )
    return LiveSlice(name, sliced, _prompts(sliced, vocab_size, seed))


def spread_ties(arrival_ms: np.ndarray, gap_ms: float) -> np.ndarray:
    """Arrivals at least `gap_ms` apart, in the order given: a request closer than that to the
    one before it (the same timestamp, typically) comes `gap_ms` after it; no arrival moves
    earlier. The simulator's order for equal timestamps is the trace's; a replay that sends
    them at one instant has no order at all."""
    out = np.asarray(arrival_ms, dtype=np.float64).copy()
    for i in range(1, len(out)):
        out[i] = max(out[i], out[i - 1] + gap_ms)
    return out


def _prompts(trace: Trace, vocab_size: int, seed: int) -> list[list[int]]:
    """Token ids per request; the tokens of a trace block are a function of its id."""
    block = max(1, int(round(trace.block_tokens)))
    blocks: dict[int, list[int]] = {}
    rng = random.Random(seed)
    out = []
    for i, length in enumerate(trace.input_tokens.tolist()):
        ids = trace.hash_ids[i] if trace.hash_ids is not None else ()
        tokens: list[int] = []
        for h in ids:
            if h not in blocks:
                block_rng = random.Random(f"{seed}-{h}")
                blocks[h] = [block_rng.randrange(100, vocab_size - 100) for _ in range(block)]
            tokens += blocks[h]
            if len(tokens) >= length:
                break
        while len(tokens) < length:  # no block ids (Azure), or fewer than the length needs
            tokens.append(rng.randrange(100, vocab_size - 100))
        out.append(tokens[:length])
    return out


def slice_request(model: str, sl: LiveSlice, i: int) -> dict:
    """Request i of the slice as a streamed /v1/completions body (greedy, exact length)."""
    return {
        "model": model,
        "prompt": sl.prompts[i],
        "max_tokens": int(sl.trace.output_tokens[i]),
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }


async def at_arrivals(
    sl: LiveSlice, send: Callable[[httpx.AsyncClient, int], Awaitable[T]]
) -> list[T]:
    """`send(client, i)` for every request of the slice at its arrival time (open loop: a slow
    reply never delays the next arrival), results in slice order."""
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    arrival_s = sl.trace.arrival_ms / 1e3
    async with httpx.AsyncClient(limits=limits) as client:
        start = time.perf_counter()

        async def one(i: int) -> T:
            delay = arrival_s[i] - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            return await send(client, i)

        return list(await asyncio.gather(*(one(i) for i in range(len(sl.trace)))))


async def replay(base_url: str, model: str, sl: LiveSlice) -> list[RequestTiming]:
    url = f"{base_url}/completions"
    return await at_arrivals(
        sl, lambda client, i: stream_completion(client, url, slice_request(model, sl, i))
    )


async def warm_up(base_url: str, model: str, vocab_size: int) -> None:
    """First calls pay for allocations and connections, which no steady replica does."""
    rng = random.Random(12345)
    async with httpx.AsyncClient() as client:
        for length in (64, 256):
            prompt = [rng.randrange(100, vocab_size - 100) for _ in range(length)]
            body = {"model": model, "prompt": prompt, "max_tokens": 4, "ignore_eos": True}
            await stream_completion(client, f"{base_url}/completions", {**body, "stream": True})


def compare(sl: LiveSlice, timings: list[RequestTiming], profile: ReplicaProfile) -> dict:
    return _compared(timings, simulate(sl.trace, profile, FleetConfig(1, 1)))


def _compared(timings: list[RequestTiming], result: SimResult) -> dict:
    live = summarize(timings)
    sim = result.summary()
    busy = {k: sim[k] for k in ("prefill_utilization", "decode_utilization")}
    per_request = {
        "live_ttft_ms": [t.ttft_ms for t in timings],
        "sim_ttft_ms": result.ttft_ms.tolist(),
    }
    return _errors(live, sim) | busy | {"per_request": per_request}


def simulate_anchored(
    trace: Trace,
    anchoring: Anchoring,
    fleet: FleetConfig,
    router_config: RouterConfig | None = None,
) -> tuple[SimResult, dict[str, float]]:
    """The simulation on the anchored profile, each replica slowed in proportion to how busy
    the other kind is (they share this machine's cores: `colocation`). Returns the result
    and the slowdown factors it settled on."""
    colocation = Colocation(anchoring.busy_prefill_slowdown, anchoring.busy_decode_slowdown)
    return simulate_colocated(
        trace, anchoring.profile, fleet, colocation, router_config=router_config
    )


def compare_anchored(sl: LiveSlice, timings: list[RequestTiming], anchoring: Anchoring) -> dict:
    result, factors = simulate_anchored(sl.trace, anchoring, FleetConfig(1, 1))
    return _compared(timings, result) | {"interference": factors}


def _errors(live: dict, sim: dict) -> dict:
    out = {"live": live, "sim": {k: v for k, v in sim.items() if k.startswith(("ttft", "itl"))}}
    for key in ("ttft_p50_ms", "itl_p50_ms"):
        name = f"sim_vs_live_{key.removesuffix('_ms')}_error"
        out[name] = abs(sim[key] - live[key]) / live[key] if live[key] and sim[key] else None
    return out


def stack_config(weights: str = "auto") -> dict:
    from shared.modelfile.default import DEFAULT_MODEL_ID

    return {
        "coordinator": {"port": 0, "registry_port": 0, "max_tokens_limit": 4096},
        "transfer": {"backend": "shm"},
        "models": [
            {
                "id": DEFAULT_MODEL_ID,
                "weights": weights,
                "pools": {"prefill": 1, "decode": 1},
                "worker": {"threads": 1},
            }
        ],
    }


def run_validation(
    slices: list[LiveSlice], profile: ReplicaProfile, vocab_size: int
) -> dict[str, dict]:
    """Start one local stack; probe it, then replay each slice and probe again. Each slice is
    simulated with the profile anchored to the probes on either side of it (the headline
    errors) and with the profile as given (`as_profiled`)."""
    from services.launcher import start_local_stack
    from shared.config.schema import parse_config
    from shared.modelfile.default import DEFAULT_MODEL_ID

    results = {}
    # The stack serves the weights the profile measured.
    config = parse_config(stack_config(profile.meta.get("weights", "auto")))
    with start_local_stack(config, startup_timeout_s=600) as stack:
        url = stack.base_url
        asyncio.run(warm_up(url, DEFAULT_MODEL_ID, vocab_size))
        before = probe(url, DEFAULT_MODEL_ID, vocab_size, seed=0)
        for i, sl in enumerate(slices):
            timings = asyncio.run(replay(url, DEFAULT_MODEL_ID, sl))
            after = probe(url, DEFAULT_MODEL_ID, vocab_size, seed=i + 1)
            anchoring = anchor(profile, before + after)
            result = compare_anchored(sl, timings, anchoring)
            raw = compare(sl, timings, profile)
            result.update(
                slice=sl.trace.summary(),
                anchoring=anchoring.report(),
                probes=[p.__dict__ for p in before + after],
                as_profiled={k: v for k, v in raw.items() if k != "live"},
            )
            results[sl.name] = result
            before = after
    return results
