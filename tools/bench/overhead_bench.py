"""`splitserve bench overhead`: what tracing costs a request.

Three local stacks, identical but for `telemetry:`: tracing off; on at 100% sampling to the
JSON-lines file; on at 100% to OTLP/gRPC (a receiver in its own process standing in for
the collector). All three run at once and are driven in turn, round after round, in a rotating
order, so that drift on a shared machine (thermal, other jobs) falls on every mode alike.
Each round is a closed loop of streamed chat requests at a fixed concurrency.

Under that load a request's TTFT is mostly waiting behind other requests' steps, and it
moves by tens of milliseconds from round to round on a shared machine: far too much noise
to resolve a 1 ms cost. So TTFT is also measured unloaded and paired: one request at a
time, the same new prompt sent to each mode in a rotating order, so that each mode's
TTFT is the prompt's own path through coordinator, prefill, transfer and decode.

Headline keys are the worse of the two tracing modes against off:
`tracing_throughput_ratio` (closed loop, on / off, target >= 0.98) and
`tracing_ttft_p50_delta_ms` (paired, on - off, target <= 1 ms); the closed loop's TTFT
delta is reported beside it as `tracing_ttft_p50_delta_ms_loaded`. The CPU seconds each service
spent per closed-loop request are reported too, per role (`cpu_ms_per_request`) and as
`tracing_cpu_ratio` (on / off), with the stand-in collector's own CPU kept apart (a real
collector runs elsewhere). Decode compute dominates that figure and itself varies by several
percent between runs here, so it shows where CPU goes rather than resolving a 2% cost.
Single TTFTs still vary by ±15 ms, so the paired delta comes with a bootstrap 95% interval
(`tracing_ttft_p50_delta_ms_ci95`): the resolution the run actually had.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import tempfile
import time
from pathlib import Path

import httpx

from services.launcher import LocalStack, start_local_stack
from shared.config.schema import parse_config
from shared.modelfile.default import DEFAULT_MODEL_ID
from shared.telemetry.file_export import read_span_file
from tools.bench.cpu_time import process_cpu_s, total_cpu_s
from tools.bench.load import RequestTiming, filler_text, percentile, stream_chat, timing_samples
from tools.bench.otlp_receiver import ReceiverProcess
from tools.bench.span_cost import span_cost_ms

MODES = ("off", "file", "otlp")
THROUGHPUT_TARGET = 0.98
TTFT_DELTA_TARGET_MS = 1.0


def _config(mode: str, weights: str, trace_file: Path, otlp_endpoint: str) -> dict:
    telemetry = {
        "off": {"exporter": "none"},
        "file": {"exporter": "file", "file": str(trace_file), "sampling_ratio": 1.0},
        "otlp": {"exporter": "otlp_grpc", "endpoint": otlp_endpoint, "sampling_ratio": 1.0},
    }[mode]
    return {
        "coordinator": {"port": 0, "registry_port": 0},
        "transfer": {"backend": "shm"},
        "telemetry": telemetry,
        "models": [
            {
                "id": DEFAULT_MODEL_ID,
                "weights": weights,
                "pools": {"prefill": 1, "decode": 1},
                "worker": {"kv_cache_bytes": 96 << 20, "host_cache_bytes": 32 << 20, "threads": 1},
            }
        ],
    }


def _body(i: int, max_tokens: int) -> dict:
    return {
        "model": DEFAULT_MODEL_ID,
        "messages": [
            {"role": "system", "content": "You are a cheerful companion in a chat app."},
            {"role": "user", "content": filler_text(40, i)},
        ],
        "max_tokens": max_tokens,
        "temperature": 0.7,
        "seed": i,
        "ignore_eos": True,
        "stream": True,
    }


async def closed_loop_round(
    base_url: str, requests: int, concurrency: int, max_tokens: int, first_id: int
) -> tuple[list[RequestTiming], float]:
    """A closed loop: `concurrency` clients, `requests` in all. Returns timings, wall s."""
    url = f"{base_url}/chat/completions"
    ids = iter(range(first_id, first_id + requests))
    timings: list[RequestTiming] = []

    async def client(http: httpx.AsyncClient) -> None:
        for i in ids:
            timings.append(await stream_chat(http, url, _body(i, max_tokens), "chat"))

    async with httpx.AsyncClient(timeout=300) as http:
        start = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        return timings, time.perf_counter() - start


async def _paired_ttft(
    running: dict[str, LocalStack], prompts: int, first_id: int
) -> dict[str, list[float]]:
    """Each prompt to every mode in turn, one request in flight at a time: TTFT per mode,
    index-aligned by prompt."""
    ttft: dict[str, list[float]] = {m: [] for m in MODES}
    async with httpx.AsyncClient(timeout=300) as http:
        for i in range(prompts):
            for mode in _rotated(i):
                url = f"{running[mode].base_url}/chat/completions"
                timing = await stream_chat(http, url, _body(first_id + i, 2), "chat")
                if timing.error is not None or timing.ttft_ms is None:
                    raise RuntimeError(f"paired TTFT request failed on {mode}: {timing.error}")
                ttft[mode].append(timing.ttft_ms)
    return ttft


def _pids_by_role(stack: LocalStack) -> dict[str, list[int]]:
    """Process ids by service role: "prefill-0" and "prefill-1" are both "prefill"."""
    roles: dict[str, list[int]] = {}
    for name, process in stack.processes.items():
        roles.setdefault(name.split("-")[0], []).append(process.pid)
    return roles


def _cpu_by_role(pids: dict[str, list[int]]) -> dict[str, float | None]:
    return {role: total_cpu_s(ids) for role, ids in pids.items()}


def _cpu_ms_per_request(
    before: dict[str, float | None], after: dict[str, float | None], requests: int
) -> dict[str, float]:
    """Per role, and in total when every role could be read; empty without /proc."""
    per_role = {
        role: (used_after - used) * 1e3 / requests
        for role, used in before.items()
        if requests and used is not None and (used_after := after.get(role)) is not None
    }
    if per_role and len(per_role) == len(before):
        per_role["total"] = sum(per_role.values())
    return per_role


def _rotated(i: int) -> tuple[str, ...]:
    """The modes starting from the i-th: each goes first, second and last equally often."""
    return MODES[i % len(MODES) :] + MODES[: i % len(MODES)]


def p50_delta_ci95(on: list[float], off: list[float], resamples: int = 2000) -> list[float]:
    """Bootstrap 95% interval of p50(on) - p50(off), resampling prompts (pairs kept)."""
    pairs = list(zip(on, off, strict=True))
    rng = random.Random(0)  # the same data gives the same interval
    deltas = []
    for _ in range(resamples):
        sample = rng.choices(pairs, k=len(pairs))
        a = percentile([p[0] for p in sample], 0.5)
        b = percentile([p[1] for p in sample], 0.5)
        deltas.append(a - b)  # type: ignore[operator]  (never empty: pairs is not)
    return [percentile(deltas, 0.025), percentile(deltas, 0.975)]  # type: ignore[list-item]


def summarize_timings(timings: list[RequestTiming], wall_s: float) -> dict:
    ok = [t for t in timings if t.error is None]
    ttft = [t.ttft_ms for t in ok if t.ttft_ms is not None]
    itl = [x for t in ok for x in t.itl_ms]
    tokens = sum(t.tokens for t in ok)
    return {
        "requests": len(timings),
        "errors": len(timings) - len(ok),
        "tokens": tokens,
        "wall_s": wall_s,
        "throughput_tok_s": tokens / wall_s if wall_s else None,
        "ttft_p50_ms": percentile(ttft, 0.5),
        "ttft_p99_ms": percentile(ttft, 0.99),
        "itl_p50_ms": percentile(itl, 0.5),
        "e2e_p50_ms": percentile([t.e2e_ms for t in ok], 0.5),
    }


def run(
    weights: str = "fp32",
    requests: int = 8,
    concurrency: int = 4,
    max_tokens: int = 32,
    rounds: int = 3,
    paired: int = 150,
    startup_timeout_s: float = 300.0,
) -> dict:
    result: dict = {
        "weights": weights,
        "requests_per_round": requests,
        "concurrency": concurrency,
        "max_tokens": max_tokens,
        "rounds": rounds,
        "paired_prompts": paired,
        "sampling_ratio": 1.0,
    }
    with (
        tempfile.TemporaryDirectory(prefix="splitserve-overhead-") as tmp,
        ReceiverProcess() as receiver,
        contextlib.ExitStack() as stacks,
    ):
        trace_file = Path(tmp) / "traces.jsonl"
        running: dict[str, LocalStack] = {}
        for mode in MODES:
            config = parse_config(_config(mode, weights, trace_file, receiver.endpoint))
            running[mode] = stacks.enter_context(
                start_local_stack(config, startup_timeout_s, run_dir=Path(tmp) / mode)
            )
        receiver.start()  # its own process, like a real collector: no GIL shared with us
        for n, mode in enumerate(MODES):  # first-touch costs are not what we measure
            asyncio.run(
                closed_loop_round(running[mode].base_url, concurrency, concurrency, 4, -100 * n)
            )
        timings: dict[str, list[RequestTiming]] = {m: [] for m in MODES}
        walls = dict.fromkeys(MODES, 0.0)
        pids = {m: _pids_by_role(running[m]) for m in MODES}
        cpu_before = {m: _cpu_by_role(pids[m]) for m in MODES}
        collector_before = process_cpu_s(receiver.pid) if receiver.pid else None
        for r in range(rounds):
            for mode in _rotated(r):
                got, wall = asyncio.run(
                    closed_loop_round(
                        running[mode].base_url, requests, concurrency, max_tokens, r * requests
                    )
                )
                timings[mode].extend(got)
                walls[mode] += wall
        cpu_after = {m: _cpu_by_role(pids[m]) for m in MODES}
        collector_after = process_cpu_s(receiver.pid) if receiver.pid else None
        # Prompts the closed loop never sent, so no mode has them cached.
        paired_ttft = asyncio.run(_paired_ttft(running, paired, 1_000_000))
        stacks.close()  # flushes every service's spans before they are counted
        result["spans_written_file"] = len(read_span_file(trace_file)) if trace_file.exists() else 0
        result["spans_received_otlp"] = receiver.span_count()
    for mode in MODES:
        result[mode] = summarize_timings(timings[mode], walls[mode])
        result[mode]["unloaded_ttft_p50_ms"] = percentile(paired_ttft[mode], 0.5)
        result[mode]["cpu_ms_per_request"] = _cpu_ms_per_request(
            cpu_before[mode], cpu_after[mode], len(timings[mode])
        )
    result["samples_paired_ttft_ms"] = paired_ttft
    result["collector_cpu_ms_per_request"] = (
        (collector_after - collector_before) * 1e3 / len(timings["otlp"])
        if collector_before is not None and collector_after is not None and timings["otlp"]
        else None
    )
    for mode in ("file", "otlp"):
        ci = p50_delta_ci95(paired_ttft[mode], paired_ttft["off"])
        result[f"tracing_ttft_p50_delta_ms_ci95_{mode}"] = ci
    result["samples"] = {mode: timing_samples(timings[mode]) for mode in MODES}
    # The same spans built in one quiet process: what the end-to-end difference should be.
    result.update(span_cost_ms())
    _headline(result)
    return result


def _headline(result: dict) -> None:
    off = result["off"]
    ratios, deltas, loaded, cpu = {}, {}, {}, {}
    for mode in ("file", "otlp"):
        on = result[mode]
        on_cpu = (on.get("cpu_ms_per_request") or {}).get("total")
        off_cpu = (off.get("cpu_ms_per_request") or {}).get("total")
        if on_cpu is not None and off_cpu:
            cpu[mode] = on_cpu / off_cpu
        result[f"tracing_cpu_ratio_{mode}"] = cpu.get(mode)
        if off["throughput_tok_s"] and on["throughput_tok_s"]:
            ratios[mode] = on["throughput_tok_s"] / off["throughput_tok_s"]
        if off["unloaded_ttft_p50_ms"] is not None and on["unloaded_ttft_p50_ms"] is not None:
            deltas[mode] = on["unloaded_ttft_p50_ms"] - off["unloaded_ttft_p50_ms"]
        if off["ttft_p50_ms"] is not None and on["ttft_p50_ms"] is not None:
            loaded[mode] = on["ttft_p50_ms"] - off["ttft_p50_ms"]
        result[f"tracing_throughput_ratio_{mode}"] = ratios.get(mode)
        result[f"tracing_ttft_p50_delta_ms_{mode}"] = deltas.get(mode)
        result[f"tracing_ttft_p50_delta_ms_loaded_{mode}"] = loaded.get(mode)
    result["tracing_throughput_ratio"] = min(ratios.values()) if ratios else None
    result["tracing_ttft_p50_delta_ms"] = max(deltas.values()) if deltas else None
    if deltas:  # the interval of the mode the headline quotes
        worst = max(deltas, key=deltas.__getitem__)
        result["tracing_ttft_p50_delta_ms_ci95"] = result.get(
            f"tracing_ttft_p50_delta_ms_ci95_{worst}"
        )
    result["tracing_ttft_p50_delta_ms_loaded"] = max(loaded.values()) if loaded else None
    result["tracing_cpu_ratio"] = max(cpu.values()) if cpu else None


def table_rows(r: dict) -> list[tuple[str, object, object, object]]:
    off = r["off"]
    rows: list[tuple[str, object, object, object]] = []
    for mode in ("file", "otlp"):
        on = r[mode]
        rows.append(
            (
                f"throughput tok/s ({mode} vs off)",
                on["throughput_tok_s"],
                off["throughput_tok_s"],
                r[f"tracing_throughput_ratio_{mode}"],
            )
        )
        rows.append(
            (
                f"TTFT p50 ms, paired unloaded ({mode} vs off)",
                on["unloaded_ttft_p50_ms"],
                off["unloaded_ttft_p50_ms"],
                None,
            )
        )
        rows.append(
            (
                f"TTFT p50 ms, closed loop ({mode} vs off)",
                on["ttft_p50_ms"],
                off["ttft_p50_ms"],
                None,
            )
        )
    rows.append(
        (
            "tracing_throughput_ratio (>= target)",
            r["tracing_throughput_ratio"],
            THROUGHPUT_TARGET,
            None,
        )
    )
    rows.append(
        (
            "tracing_ttft_p50_delta_ms (<= target)",
            r["tracing_ttft_p50_delta_ms"],
            TTFT_DELTA_TARGET_MS,
            None,
        )
    )
    ci = r.get("tracing_ttft_p50_delta_ms_ci95")
    if ci:
        rows.append(("  its 95% interval (bootstrap)", f"{ci[0]:.2f} .. {ci[1]:.2f}", None, None))
    rows.append(
        ("tracing_ttft_p50_delta_ms_loaded", r["tracing_ttft_p50_delta_ms_loaded"], None, None)
    )
    for mode in ("file", "otlp"):
        on_cpu, off_cpu = (
            r[mode].get("cpu_ms_per_request") or {},
            off.get("cpu_ms_per_request") or {},
        )
        for role in on_cpu:
            ratio = r.get(f"tracing_cpu_ratio_{mode}") if role == "total" else None
            rows.append(
                (f"{role} CPU ms/request ({mode} vs off)", on_cpu[role], off_cpu.get(role), ratio)
            )
    rows.append(
        ("collector CPU ms/request (otlp)", r.get("collector_cpu_ms_per_request"), None, None)
    )
    rows.append(
        (
            "span CPU ms/request vs e2e p50 ms",
            r["span_cpu_ms_per_request"],
            off["e2e_p50_ms"],
            r["span_cpu_ms_per_request"] / off["e2e_p50_ms"] if off["e2e_p50_ms"] else None,
        )
    )
    rows.append(("errors (off/file/otlp)", "/".join(str(r[m]["errors"]) for m in MODES), 0, None))
    return rows
