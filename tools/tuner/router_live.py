"""`bench router --live`: a short slice of the trace on a real local stack (two prefill
replicas, one decode replica, the bundled model), routed by the configured policy, reported
with the same keys as the simulator and beside the simulator's figures for the same slice.

Prompts are token ids, equal exactly where the requests' trace block ids agree, with one trace
block scaled to one KV block (16 tokens): the live prefix caches see what the simulated ones
see. Hit rate comes from each response's `usage.prompt_tokens_details.cached_tokens`;
imbalance is max ÷ mean of the uncached prompt tokens each prefill replica computed (its busy
time, to within its speed), read from the `metadata.replica` of every response.

The simulator's TTFTs come from the profile anchored to the stack's speed by probe requests
just before and after the slice, with the cost of replicas sharing this machine's cores
applied as `bench tune`'s live check does (`tools.tuner.calibrate`); the figures with
the profile as measured are reported beside them (`simulated_as_profiled`). Two prefill
replicas also slow each other here, which the probes (one request at a time) do not see.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict
from dataclasses import dataclass, field

import httpx
import numpy as np

from services.planner.replica_profile import ReplicaProfile
from shared.config.schema import DeploymentConfig
from tools.bench.load import StreamError, completion_token, stream_events
from tools.tuner.calibrate import anchor, probe
from tools.tuner.fleet import FleetConfig
from tools.tuner.results import SimResult
from tools.tuner.simulator import simulate
from tools.tuner.trace import Trace
from tools.tuner.validate import (
    LiveSlice,
    at_arrivals,
    make_slice,
    simulate_anchored,
    slice_request,
    warm_up,
)

PREFILL_REPLICAS = 2
MAX_PROMPT = 512
MAX_OUTPUT = 8


@dataclass
class LiveResult:
    ttft_ms: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    replica: str = ""
    reasoning: list[str] = field(default_factory=list)
    error: str | None = None


async def _one(client: httpx.AsyncClient, url: str, body: dict) -> LiveResult:
    out = LiveResult()
    start = time.perf_counter()
    try:
        async for data in stream_events(client, url, body, timeout_s=600.0):
            if out.ttft_ms is None and any(completion_token(c) for c in data.get("choices", [])):
                out.ttft_ms = (time.perf_counter() - start) * 1e3
            meta = data.get("metadata") or {}
            out.replica = meta.get("replica", out.replica)
            routing = meta.get("routing", out.reasoning)
            # metadata values are strings (OpenAI's shape): the list comes JSON-encoded
            out.reasoning = json.loads(routing) if isinstance(routing, str) else routing
            usage = data.get("usage")
            if usage:
                out.prompt_tokens = usage["prompt_tokens"]
                details = usage.get("prompt_tokens_details") or {}
                out.cached_tokens = details.get("cached_tokens", 0)
    except StreamError as exc:
        out.error = str(exc)
    except (TimeoutError, httpx.HTTPError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    return out


async def replay(base_url: str, model: str, sl: LiveSlice) -> list[LiveResult]:
    url = f"{base_url}/completions"
    # Usage in the last chunk: cached_tokens is how the hit rate is read.
    usage = {"stream_options": {"include_usage": True}}
    return await at_arrivals(
        sl, lambda client, i: _one(client, url, slice_request(model, sl, i) | usage)
    )


def figures(results: list[LiveResult]) -> dict:
    ok = [r for r in results if r.error is None and r.ttft_ms is not None]
    ttft = np.array([r.ttft_ms for r in ok]) if ok else np.array([np.nan])
    work: dict[str, int] = defaultdict(int)
    for r in ok:
        prefill = r.replica.split("->")[0] if "->" in r.replica else r.replica
        work[prefill] += r.prompt_tokens - r.cached_tokens
    loads = np.array(list(work.values()) or [0], dtype=float)
    prompt = sum(r.prompt_tokens for r in ok)
    return {
        "hit_rate": sum(r.cached_tokens for r in ok) / max(1, prompt),
        "ttft_p50_ms": float(np.percentile(ttft, 50)),
        "ttft_p99_ms": float(np.percentile(ttft, 99)),
        "imbalance": float(loads.max() / loads.mean()) if loads.mean() > 0 else 1.0,
        "requests": len(results),
        "errors": len(results) - len(ok),
        "local_prefills": sum(1 for r in ok if "->" not in r.replica),
        "per_replica_uncached_tokens": dict(sorted(work.items())),
    }


def live_config(config: DeploymentConfig) -> DeploymentConfig:
    from shared.config.schema import parse_config

    raw = config.model_dump(mode="json")
    raw["coordinator"].update(port=0, registry_port=0)
    model = raw["models"][0]
    model["pools"] = {"prefill": PREFILL_REPLICAS, "decode": 1, "both": 0}
    model["worker"].update(threads=1)
    return parse_config(raw, "<bench router --live>")


def run(
    trace: Trace,
    config: DeploymentConfig,
    requests: int,
    profile: ReplicaProfile | None = None,
) -> dict:
    from services.launcher import start_local_stack
    from shared.modelfile.default import default_model_path
    from shared.tokenizer import Tokenizer
    from tools.tuner.cli_run import load_profile_or_default

    profile = profile or load_profile_or_default(None)[0]
    config = live_config(config)
    model_id = config.models[0].id
    vocab = Tokenizer.from_gguf(default_model_path()).vocab_size
    scale = config.block_size / trace.block_tokens  # one trace block -> one KV block
    sl = make_slice(
        "router", trace, profile, vocab, requests, 0, scale, MAX_PROMPT, MAX_OUTPUT, 0.6
    )
    with start_local_stack(config, startup_timeout_s=600) as stack:
        asyncio.run(warm_up(stack.base_url, model_id, vocab))
        before = probe(stack.base_url, model_id, vocab, seed=0)
        results = asyncio.run(replay(stack.base_url, model_id, sl))
        after = probe(stack.base_url, model_id, vocab, seed=1)
    worker = config.models[0].worker
    fleet = FleetConfig(
        PREFILL_REPLICAS,
        1,
        router=config.router.policy,
        cache_tokens=worker.kv_cache_bytes // profile.kv_bytes_per_token,
        host_cache_tokens=worker.host_cache_bytes // profile.kv_bytes_per_token,
    )
    anchoring = anchor(profile, before + after)
    sim, interference = simulate_anchored(sl.trace, anchoring, fleet, config.router)
    as_profiled = simulate(sl.trace, profile, fleet, router_config=config.router)
    return {
        "policy": config.router.policy,
        "prefill_replicas": PREFILL_REPLICAS,
        "decode_replicas": 1,
        "slice": sl.trace.summary(),
        "live": figures(results),
        "simulated": _sim_figures(sim),
        "simulated_as_profiled": _sim_figures(as_profiled),
        "anchoring": anchoring.report() | {"interference": interference},
        "errors": sorted({r.error for r in results if r.error})[:5],
        "sample_reasoning": next((r.reasoning for r in results if r.reasoning), []),
    }


def _sim_figures(sim: SimResult) -> dict:
    busy = np.asarray(sim.prefill_busy_ms)
    return {
        "hit_rate": float(sim.cached_tokens.sum() / max(1, sim.input_tokens.sum())),
        **{k: sim.latency()[k] for k in ("ttft_p50_ms", "ttft_p99_ms")},
        "imbalance": float(busy.max() / busy.mean()) if busy.mean() > 0 else 1.0,
    }


def table_rows(live: dict) -> list[tuple[str, object, object, object]]:
    rows: list[tuple[str, object, object, object]] = []
    for key in ("hit_rate", "ttft_p50_ms", "ttft_p99_ms", "imbalance"):
        ours, sim = live["live"][key], live["simulated"][key]
        rows.append((f"{live['policy']} {key} live vs sim", ours, sim, ours / sim if sim else None))
    for key in ("ttft_p50_ms", "ttft_p99_ms"):
        ours, sim = live["live"][key], live["simulated_as_profiled"][key]
        rows.append(
            (
                f"{live['policy']} {key} live vs sim (as profiled)",
                ours,
                sim,
                ours / sim if sim else None,
            )
        )
    rows.append(("errors", live["live"]["errors"], 0, None))
    return rows
