"""`splitserve bench chaos`: does the supervised local stack lose a stream when a worker dies?

One `splitserve up`-style stack (1 coordinator, 2 prefill, 2 decode by default; with
`coordinators` > 1 the streams are spread over every coordinator). Per scenario, N
concurrent greedy streams (ignore_eos) while a worker is hit:

- kill_decode: SIGKILL of a decode replica serving streams, once they are a few tokens in
  (its streams migrate; the supervisor restarts it);
- kill_prefill: SIGKILL of a prefill replica as the first stream gets its first token (the
  others are still being prefilled: they retry on the other prefill or prefill locally);
- drain_decode: SIGTERM of a decode replica serving streams (nothing new is routed to it;
  its streams finish there, or, when they outlast its grace (`drain_grace_s`, short by
  default so that they do), are handed over to the other decode replica and migrate; then
  it exits and is restarted);
- restart_decode_same_name: a decode replica killed and restarted (same name, new process
  and address) *before* the streams, which must then go through it like any other;
- kill_coordinator (two coordinators or more): SIGKILL of the last coordinator once one of
  its streams is a few tokens in (tools/bench/chaos_coordinators.py).

Each scenario's texts are compared with a calm run of the same prompts afterwards (greedy:
they must be identical; the calm run comes second so the chaos run is not served from
prefix caches that would skip the prefill being killed). Keys per scenario: `streams`,
`identical`, `failed`, `leaked_blocks` (KV blocks still held on any worker once the stack is
idle again), `recovery_s` (from the hit to the replica serving again), `p99_stall_ms` (p99
over surviving streams of the longest gap between two of its tokens); the calm run beside
them; drain_decode adds `handed_over` (its streams that moved when the grace ran out).
Targets: identical == streams and leaked_blocks == 0; for kill_coordinator, streams on the
killed coordinator may fail (nothing else), and a new request succeeds within 2 s.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from services.launcher import LocalStack, start_local_stack
from services.launcher.presets import loopback_config
from shared.config.schema import parse_config
from shared.modelfile.default import DEFAULT_MODEL_ID
from shared.proto_gen import worker_pb2 as pb
from shared.proto_gen import worker_pb2_grpc as pb_grpc
from tools.bench.chaos_coordinators import CoordinatorHit, one_view
from tools.bench.load import StreamError, filler_text, percentile, stream_events

WORKER_SCENARIOS = ("kill_decode", "kill_prefill", "drain_decode", "restart_decode_same_name")
SCENARIOS = (*WORKER_SCENARIOS, "kill_coordinator")  # the last needs two coordinators
NEW_REQUEST_TARGET_S = 2.0
TOPICS = ("a lighthouse", "the sea", "a fox", "a city", "a clock", "a river", "a storm", "a map")


@dataclass(frozen=True)
class ChaosBenchPlan:
    streams: int = 16
    max_tokens: int = 48
    prefill: int = 2
    decode: int = 2
    coordinators: int = 1
    hit_after_tokens: int = 6  # kill_decode / drain_decode: once a stream is this far in
    # Every worker's drain grace: shorter than the streams, so drain_decode hands them over.
    drain_grace_s: float = 1.0
    prompt_words: int = 60
    weights: str = "fp32"
    scenarios: tuple[str, ...] = WORKER_SCENARIOS
    recovery_timeout_s: float = 120.0


@dataclass
class StreamResult:
    prompt: str
    coordinator: int = 0  # which of the stack's coordinators serves it
    text: str = ""
    prefill: str = ""  # worker ids from the first chunk's metadata ("" = local prefill)
    decode: str = ""
    tokens: int = 0
    gaps_ms: list[float] = field(default_factory=list)
    error: str | None = None
    moves: list[str] = field(default_factory=list)  # why each attempt after the first began


async def _stream(client: httpx.AsyncClient, url: str, r: StreamResult, max_tokens: int) -> None:
    url = f"{url}/v1/chat/completions"
    body = {
        "model": DEFAULT_MODEL_ID,
        "messages": [{"role": "user", "content": r.prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    last = None
    try:
        async for data in stream_events(client, url, body, timeout_s=300):
            metadata = data.get("metadata", {})
            replica = metadata.get("replica")
            if replica and not r.decode:
                r.prefill, _, r.decode = replica.rpartition("->")
            if metadata.get("attempts"):  # the first chunk and the last: the last one wins
                r.moves = [a["reason"] for a in json.loads(metadata["attempts"])[1:]]
            for choice in data.get("choices", []):
                if choice.get("delta", {}).get("content"):
                    now = time.perf_counter()
                    if last is not None:
                        r.gaps_ms.append((now - last) * 1e3)
                    last = now
                    r.text += choice["delta"]["content"]
                    r.tokens += 1
    except StreamError as exc:
        r.error = str(exc)
    except (TimeoutError, httpx.HTTPError) as exc:
        r.error = f"{type(exc).__name__}: {exc}"


async def _run_streams(
    stack: LocalStack,
    prompts: list[str],
    max_tokens: int,
    hit: Callable[[list[StreamResult]], bool] | None = None,
) -> list[StreamResult]:
    """The streams, concurrently, spread over the coordinators; `hit(results)` is polled
    while they run until it acts."""
    urls = stack.coordinator_urls
    results = [StreamResult(p, i % len(urls)) for i, p in enumerate(prompts)]
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(limits=limits, trust_env=False) as client:
        tasks = [
            asyncio.create_task(_stream(client, urls[r.coordinator], r, max_tokens))
            for r in results
        ]
        while hit is not None and not all(t.done() for t in tasks):
            if hit(results):
                break
            await asyncio.sleep(0.01)
        await asyncio.gather(*tasks)
    return results


def _service_of(stack: LocalStack, worker_id: str) -> str:
    """The launcher's service name of a worker id (worker ids end with the process id)."""
    names = [n for n, p in stack.processes.items() if worker_id.endswith(f"-{p.pid}")]
    if len(names) != 1:
        raise RuntimeError(f"no single service runs worker {worker_id!r} (found {names})")
    return names[0]


def _ready(stack: LocalStack) -> dict:
    try:
        return httpx.get(f"{stack.url}/ready", timeout=5, trust_env=False).json()
    except (httpx.HTTPError, json.JSONDecodeError):
        return {"ready": False, "workers": {}}


def _healed(stack: LocalStack, expected_workers: int) -> bool:
    if not all(stack.supervisor.is_ready(name) for name in stack.processes):
        return False
    return one_view(stack, expected_workers)


def _wait_healed(stack: LocalStack, expected: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not _healed(stack, expected):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the stack did not heal within {timeout_s:g} s ({stack.run_dir})")
        time.sleep(0.1)


def _recovery_s(stack: LocalStack, name: str, hit_at: float, restarts: int, timeout_s: float):
    """Seconds from the hit until `name` runs a new process that serves (health SERVING:
    loaded and registered)."""
    deadline = hit_at + timeout_s
    while time.monotonic() < deadline:
        if stack.supervisor.restarts(name) > restarts and stack.supervisor.is_ready(name):
            return round(time.monotonic() - hit_at, 2)
        time.sleep(0.05)
    return None


def leaked_blocks(stack: LocalStack, settle_s: float = 10.0) -> int:
    """KV blocks still referenced on any worker once nothing runs (cached blocks are free to
    reuse and do not count); polled until zero or `settle_s`, as releases trail the streams."""
    deadline = time.monotonic() + settle_s
    while True:
        held = 0
        for worker in _ready(stack)["workers"].values():
            if not worker["alive"]:
                continue
            with stack.internal_auth.sync_channel(worker["address"]) as channel:
                stats = json.loads(
                    pb_grpc.WorkerStub(channel).Stats(pb.StatsRequest(), timeout=5).json
                )
            load = stats["load"]
            held += load["total_blocks"] - load["free_blocks"]
        if held == 0 or time.monotonic() > deadline:
            return held
        time.sleep(0.2)


class _Hit:
    """Acts once on the running streams: picks the victim, sends the signal, records when."""

    def __init__(
        self, stack: LocalStack, role: str, sig: int, when: Callable[[StreamResult], bool]
    ):
        self.stack, self.role, self.sig, self.when = stack, role, sig, when
        self.name: str | None = None
        self.at = 0.0
        self.restarts = 0

    def __call__(self, results: list[StreamResult]) -> bool:
        for r in results:
            worker = r.decode if self.role == "decode" else r.prefill
            if worker and self.when(r):
                self.name = _service_of(self.stack, worker)
                self.restarts = self.stack.supervisor.restarts(self.name)
                self.at = time.monotonic()
                self.stack.processes[self.name].kill(self.sig)
                return True
        return False


def summarize_streams(results: list[StreamResult], reference: dict[str, str] | None) -> dict:
    ok = [r for r in results if r.error is None]
    stalls = [max(r.gaps_ms) for r in ok if r.gaps_ms]
    out = {
        "streams": len(results),
        "failed": len(results) - len(ok),
        "p99_stall_ms": round(percentile(stalls, 0.99), 1) if stalls else None,
    }
    if reference is not None:
        out["identical"] = sum(r.error is None and r.text == reference[r.prompt] for r in results)
    errors = sorted({r.error for r in results if r.error})
    if errors:
        out["errors"] = errors[:3]
    return out


def _scenario(stack: LocalStack, plan: ChaosBenchPlan, scenario: str, workers: int) -> dict:
    # Mostly new text: with most of a prompt cached on a decode replica (the chat template's
    # system prompt alone is a third of a short one) it would prefill there, not on a prefill
    # replica, and kill_prefill would hit nothing.
    seed = 1000 * SCENARIOS.index(scenario)
    prompts = [
        f"{filler_text(plan.prompt_words, seed + i)}. Now tell a long story about "
        f"{TOPICS[i % len(TOPICS)]}."
        for i in range(plan.streams)
    ]
    far_in = lambda r: r.tokens >= plan.hit_after_tokens  # noqa: E731
    first_token = lambda r: r.tokens >= 1  # noqa: E731
    hit: _Hit | None = None
    extra: dict = {}
    if scenario == "kill_coordinator":
        coordinator_hit = CoordinatorHit(stack, far_in)
        results = asyncio.run(_run_streams(stack, prompts, plan.max_tokens, coordinator_hit))
        coordinator_hit.finish()
        if not coordinator_hit.at:
            raise RuntimeError(f"{scenario}: the streams ended before the coordinator was hit")
        recovery, extra["converged_s"] = coordinator_hit.converged(workers, plan.recovery_timeout_s)
        extra["new_request_s"] = coordinator_hit.new_request_s
        killed = [r for r in results if r.coordinator == coordinator_hit.index]
        extra["on_killed_coordinator"] = len(killed)
        extra["failed_on_survivors"] = sum(
            r.error is not None for r in results if r.coordinator != coordinator_hit.index
        )
    elif scenario == "restart_decode_same_name":
        name = next(n for n in stack.processes if n.startswith("decode"))
        restarts = stack.supervisor.restarts(name)
        at = time.monotonic()
        stack.processes[name].kill(signal.SIGKILL)
        recovery = _recovery_s(stack, name, at, restarts, plan.recovery_timeout_s)
        _wait_healed(stack, workers, plan.recovery_timeout_s)
        revived = _service_worker_id(stack, name)
        results = asyncio.run(_run_streams(stack, prompts, plan.max_tokens))
        extra["through_restarted"] = sum(r.decode == revived for r in results)
    else:
        role, sig, when = {
            "kill_decode": ("decode", signal.SIGKILL, far_in),
            "kill_prefill": ("prefill", signal.SIGKILL, first_token),
            "drain_decode": ("decode", signal.SIGTERM, far_in),
        }[scenario]
        hit = _Hit(stack, role, sig, when)
        results = asyncio.run(_run_streams(stack, prompts, plan.max_tokens, hit))
        if hit.name is None:
            raise RuntimeError(f"{scenario}: the streams ended before a {role} could be hit")
        recovery = _recovery_s(stack, hit.name, hit.at, hit.restarts, plan.recovery_timeout_s)
        if scenario == "drain_decode":
            drained = [r for r in results if r.decode and _is_process_of(r.decode, hit.name)]
            handed_over = sum("drain" in r.moves for r in drained)
            extra["finished_on_drained_replica"] = len(drained) - handed_over
            extra["handed_over"] = handed_over
    _wait_healed(stack, workers, plan.recovery_timeout_s)
    leaked = leaked_blocks(stack)
    calm = asyncio.run(_run_streams(stack, prompts, plan.max_tokens))
    reference = {r.prompt: r.text for r in calm}
    return {
        **summarize_streams(results, reference),
        "leaked_blocks": leaked,
        "recovery_s": recovery,
        "calm": summarize_streams(calm, None),
        **extra,
    }


def _service_worker_id(stack: LocalStack, name: str) -> str:
    pid = stack.processes[name].pid
    return next(w for w in _ready(stack)["workers"] if w.endswith(f"-{pid}"))


def _is_process_of(worker_id: str, name: str) -> bool:
    # The drained process has exited (and maybe been replaced): match by replica slot name.
    role, _, index = name.rpartition("-")
    return f"-{role}-{index}-" in worker_id


def met_targets(scenario: str, s: dict) -> bool:
    if scenario != "kill_coordinator":
        return s["identical"] == s["streams"] and s["leaked_blocks"] == 0
    # Streams on the killed coordinator may fail; every other one must come out identical.
    survivors = s["streams"] - s["on_killed_coordinator"]
    new_request = s["new_request_s"]
    return (
        s["failed_on_survivors"] == 0
        and s["identical"] >= survivors
        and s["leaked_blocks"] == 0
        and new_request is not None
        and new_request < NEW_REQUEST_TARGET_S
    )


def run(plan: ChaosBenchPlan) -> dict:
    workers = plan.prefill + plan.decode
    result: dict = {
        "streams": plan.streams,
        "max_tokens": plan.max_tokens,
        "topology": {
            "coordinators": plan.coordinators,
            "prefill": plan.prefill,
            "decode": plan.decode,
        },
        "weights": plan.weights,
        "drain_grace_s": plan.drain_grace_s,
        "scenarios": {},
    }
    pools = {"prefill": plan.prefill, "decode": plan.decode}
    raw = loopback_config(pools, plan.weights)
    raw["coordinator"]["replicas"] = plan.coordinators
    raw["worker_drain_grace_s"] = plan.drain_grace_s
    with start_local_stack(parse_config(raw), startup_timeout_s=300) as stack:
        _wait_healed(stack, workers, plan.recovery_timeout_s)  # every coordinator knows all
        for scenario in plan.scenarios:
            result["scenarios"][scenario] = _scenario(stack, plan, scenario, workers)
    result["targets_met"] = all(met_targets(n, s) for n, s in result["scenarios"].items())
    return result


def table_rows(result: dict) -> list[tuple[str, object, object, object]]:
    rows: list[tuple[str, object, object, object]] = []
    for name, s in result["scenarios"].items():
        short = name.replace("_same_name", "")
        rows.append((f"{short}: identical / streams", s["identical"], s["streams"], None))
        rows.append((f"{short}: failed", s["failed"], 0, None))
        rows.append((f"{short}: leaked blocks", s["leaked_blocks"], 0, None))
        rows.append((f"{short}: recovery (s)", s["recovery_s"], None, None))
        stall, calm = s["p99_stall_ms"], s["calm"]["p99_stall_ms"]
        ratio = stall / calm if stall and calm else None
        rows.append((f"{short}: p99 stall ms vs calm", stall, calm, ratio))
        if name == "drain_decode":
            rows.append((f"{short}: handed over", s["handed_over"], None, None))
        if name == "kill_coordinator":
            rows.append((f"{short}: failed on survivors", s["failed_on_survivors"], 0, None))
            rows.append(
                (f"{short}: new request (s)", s["new_request_s"], NEW_REQUEST_TARGET_S, None)
            )
            rows.append((f"{short}: converged after restart (s)", s["converged_s"], None, None))
    return rows
