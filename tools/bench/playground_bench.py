"""`splitserve bench overhead --playground`: what an open playground fleet view costs serving.

One local stack (tracing off), driven by the same closed loop of streamed chat requests as
`bench overhead`, round after round, with and without a poller that asks the fleet view every
second, as an open browser tab does (`/playground/api/fleet`: the registry and one Stats call
to each worker). The two modes alternate on the same stack (off, on, on, off, off, on, ...),
so that drift on a shared machine and the stack's own state fall on both alike; each round
sends new prompts, so no round finds another's prefix cached. While off, nothing polls.

Headline: `playground_throughput_ratio` (output tok/s with the poller / without, target
>= 0.98), beside the TTFT p50 of both modes and the fleet view's own latency. The ratio of
each round's adjacent pair is kept too (`round_ratios`, and their median): on a busy machine
their spread shows how much of the headline is the machine's drift rather than the poller.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from pathlib import Path

import httpx

from services.launcher import start_local_stack
from shared.config.schema import parse_config
from shared.modelfile.default import DEFAULT_MODEL_ID
from tools.bench.load import RequestTiming, percentile
from tools.bench.overhead_bench import closed_loop_round, summarize_timings

MODES = ("off", "fleet_poller")
POLL_INTERVAL_S = 1.0
THROUGHPUT_TARGET = 0.98
FLEET_PATH = "/playground/api/fleet"


def _config(weights: str) -> dict:
    return {
        "coordinator": {"port": 0, "registry_port": 0},
        "transfer": {"backend": "shm"},
        "playground": {"enabled": True},
        "models": [
            {
                "id": DEFAULT_MODEL_ID,
                "weights": weights,
                "pools": {"prefill": 1, "decode": 1},
                "worker": {"kv_cache_bytes": 96 << 20, "host_cache_bytes": 32 << 20, "threads": 1},
            }
        ],
    }


async def poll_fleet(url: str, latencies_ms: list[float], stop: asyncio.Event) -> None:
    """One GET a second (start to start) until `stop`; a failed poll is an error, not a skip."""
    async with httpx.AsyncClient(timeout=10) as http:
        while not stop.is_set():
            started = time.perf_counter()
            resp = await http.get(url)
            resp.raise_for_status()
            workers = [w for m in resp.json()["models"] for w in m["workers"]]
            if not workers:
                raise RuntimeError("the fleet view lists no workers")
            latencies_ms.append((time.perf_counter() - started) * 1e3)
            left = POLL_INTERVAL_S - (time.perf_counter() - started)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), max(0.0, left))


async def _polled_round(
    base_url: str, fleet_url: str, requests: int, concurrency: int, max_tokens: int, first: int
) -> tuple[list[RequestTiming], float, list[float]]:
    latencies: list[float] = []
    stop = asyncio.Event()
    poller = asyncio.create_task(poll_fleet(fleet_url, latencies, stop))
    try:
        timings, wall = await closed_loop_round(base_url, requests, concurrency, max_tokens, first)
    finally:
        stop.set()
        await poller  # a failed poll surfaces here
    return timings, wall, latencies


def order(r: int) -> tuple[str, ...]:
    """off-on, on-off, ...: each mode goes first in half the rounds."""
    return MODES if r % 2 == 0 else MODES[::-1]


def run(
    weights: str = "fp32",
    requests: int = 8,
    concurrency: int = 4,
    max_tokens: int = 32,
    rounds: int = 4,
    startup_timeout_s: float = 300.0,
) -> dict:
    result: dict = {
        "mode": "playground",
        "weights": weights,
        "requests_per_round": requests,
        "concurrency": concurrency,
        "max_tokens": max_tokens,
        "rounds": rounds,
        "poll_interval_s": POLL_INTERVAL_S,
    }
    timings: dict[str, list[RequestTiming]] = {m: [] for m in MODES}
    walls = dict.fromkeys(MODES, 0.0)
    per_round: list[dict[str, float | None]] = []  # throughput tok/s per mode, per round
    poll_ms: list[float] = []
    with (
        tempfile.TemporaryDirectory(prefix="splitserve-playground-bench-") as tmp,
        start_local_stack(
            parse_config(_config(weights)), startup_timeout_s, run_dir=Path(tmp)
        ) as s,
    ):
        fleet_url = f"{s.url}{FLEET_PATH}"
        # First-touch costs are not what we measure; nor is the first fleet snapshot.
        asyncio.run(closed_loop_round(s.base_url, concurrency, concurrency, 4, -100))
        httpx.get(fleet_url, timeout=10).raise_for_status()
        for r in range(rounds):
            per_round.append({})
            for mode in order(r):
                first = (2 * r + MODES.index(mode)) * requests
                if mode == "off":
                    got, wall = asyncio.run(
                        closed_loop_round(s.base_url, requests, concurrency, max_tokens, first)
                    )
                else:
                    got, wall, latencies = asyncio.run(
                        _polled_round(
                            s.base_url, fleet_url, requests, concurrency, max_tokens, first
                        )
                    )
                    poll_ms.extend(latencies)
                timings[mode].extend(got)
                walls[mode] += wall
                per_round[-1][mode] = summarize_timings(got, wall)["throughput_tok_s"]
    for mode in MODES:
        result[mode] = summarize_timings(timings[mode], walls[mode])
    result["fleet_polls"] = len(poll_ms)
    result["fleet_poll_p50_ms"] = percentile(poll_ms, 0.5)
    result["fleet_poll_p99_ms"] = percentile(poll_ms, 0.99)
    off, on = result["off"]["throughput_tok_s"], result["fleet_poller"]["throughput_tok_s"]
    result["playground_throughput_ratio"] = on / off if on and off else None
    result["round_ratios"] = round_ratios(per_round)
    result["round_ratio_median"] = percentile(result["round_ratios"], 0.5)
    return result


def round_ratios(per_round: list[dict[str, float | None]]) -> list[float]:
    """Poller / off throughput within each round (the two ran back to back)."""
    return [
        r["fleet_poller"] / r["off"] for r in per_round if r.get("off") and r.get("fleet_poller")
    ]


def table_rows(r: dict) -> list[tuple[str, object, object, object]]:
    off, on = r["off"], r["fleet_poller"]
    return [
        (
            "throughput tok/s (poller vs off)",
            on["throughput_tok_s"],
            off["throughput_tok_s"],
            r["playground_throughput_ratio"],
        ),
        ("TTFT p50 ms (poller vs off)", on["ttft_p50_ms"], off["ttft_p50_ms"], None),
        ("ITL p50 ms (poller vs off)", on["itl_p50_ms"], off["itl_p50_ms"], None),
        (
            "playground_throughput_ratio (>= target)",
            r["playground_throughput_ratio"],
            THROUGHPUT_TARGET,
            None,
        ),
        (
            "  per-round ratios, median",
            _span(r.get("round_ratios")),
            None,
            r.get("round_ratio_median"),
        ),
        ("fleet view p50 / p99 ms", r["fleet_poll_p50_ms"], r["fleet_poll_p99_ms"], None),
        ("fleet polls answered", r["fleet_polls"], None, None),
        ("errors (off/poller)", f"{off['errors']}/{on['errors']}", 0, None),
    ]


def _span(values: list[float] | None) -> str | None:
    return f"{min(values):.3f}..{max(values):.3f}" if values else None
