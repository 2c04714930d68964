"""`splitserve bench serve`: the local stack beside any OpenAI-compatible server.

Our stack starts with the deployment defaults (`splitserve up`'s, or `--config`'s) and is
driven with four workloads; then the peer (`--peer URL`, e.g. llama.cpp's llama-server on the
same GGUF) gets the very same requests from the same streaming client (tools/bench/load.py),
one server after the other so that neither competes with the other for the cores:

- `short`: fresh conversations of one ~20-token user message, sequential;
- `first_turn`: one ~300-token user message, sequential;
- `conversation`: 12 turns where every turn resends the whole history, the server's own
  replies included, plus a new user message; reported over turns 2-12 (turn 1 is a first
  turn, and the point here is what a server does with a history it has seen);
- `concurrency8`: 256-token prompts, 64 output tokens each (`ignore_eos`, which both our API
  and llama-server accept), 8 in flight at a time.

Everything is greedy and streamed, with `model` read from each server's /v1/models. Prompts
are real text from the quality gate's shipped corpus, cut to size with the model's tokenizer
and chosen by a seeded RNG, so both servers (and every run) see the same bytes. Every request
starts with the same short system message: our chat template and llama-server's would
otherwise differ in the default system prompt they add, and the servers would not be
prefilling the same tokens.

Per server and workload: TTFT and ITL p50/p99, output tokens/s (output tokens over the time
the server spent on the workload's requests: the summed request times when sequential, the
wall clock when concurrent) and errors; with a peer, ours / peer ratios beside them (below 1
is better for latency, above 1 for throughput). Output tokens are each server's own usage
count (a streamed chunk may carry several tokens, or one that is no text); ITL is the gap
between chunks that carry text, as a client sees it. After the run: the resident memory of
every process of each server and the KV capacity each has, in tokens.
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

import engine
from tools.bench.load import (
    RequestTiming,
    stream_timing,
    summarize,
    timing_samples,
)

WORKLOADS = ("short", "first_turn", "conversation", "concurrency8")
# The quality gate's texts, found without importing engine.quality (which imports torch).
CORPUS = Path(engine.__file__).parent / "quality" / "data" / "agreement_texts.txt"
SYSTEM_PROMPT = "You are a helpful assistant. Answer briefly."
# (ratio key, the per-server key it divides): ours / peer.
RATIOS = (
    ("ttft_ratio", "ttft_p50_ms"),
    ("ttft_p99_ratio", "ttft_p99_ms"),
    ("itl_ratio", "itl_p50_ms"),
    ("itl_p99_ratio", "itl_p99_ms"),
    ("throughput_ratio", "output_tok_s"),
)
_TABLE_KEYS = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "output_tok_s", "errors")
_TABLE_RATIOS = dict((key, name) for name, key in RATIOS)


@dataclass(frozen=True)
class ServeBenchPlan:
    short_requests: int = 20
    first_turn_requests: int = 10
    conversations: int = 2
    turns: int = 12
    concurrent_requests: int = 32
    concurrency: int = 8
    short_tokens: int = 20
    first_turn_tokens: int = 300
    turn_tokens: int = 40  # each new user message of a conversation
    concurrent_tokens: int = 256
    reply_tokens: int = 32
    concurrent_reply_tokens: int = 64
    warmup_requests: int = 2
    seed: int = 0

    def scaled(self, factor: float) -> ServeBenchPlan:
        """The request counts times `factor` (at least one each); prompt and reply sizes stay,
        they are what defines each workload."""

        def n(count: int) -> int:
            return max(1, round(count * factor))

        return replace(
            self,
            short_requests=n(self.short_requests),
            first_turn_requests=n(self.first_turn_requests),
            conversations=n(self.conversations),
            concurrent_requests=n(self.concurrent_requests),
        )


# A smoke run: every workload exercised, a minute or two per server on 2 cores.
SMALL = ServeBenchPlan(
    short_requests=3, first_turn_requests=2, conversations=1, turns=3, concurrent_requests=8
)


def plan_for(requests: str | float) -> ServeBenchPlan:
    """`--requests`: "full" (the defaults), "small" (a smoke run) or a factor on full's counts."""
    if requests == "full":
        return ServeBenchPlan()
    if requests == "small":
        return SMALL
    return ServeBenchPlan().scaled(float(requests))


# -- prompts -----------------------------------------------------------------------------


def corpus_sentences(path: Path = CORPUS) -> list[str]:
    """Sentences of the corpus's prose passages and user turns.

    Passages are separated by `%%` lines. Chat transcripts contribute only their user
    message: their `<|im_start|>` markup would be read as special tokens. Code is left out:
    cut at sentence ends it would not look like anything a person sends.
    """
    sentences: list[str] = []
    for passage in re.split(r"^%%$", path.read_text(), flags=re.MULTILINE):
        passage = passage.strip()
        if "<|im_start|>user\n" in passage:
            passage = passage.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
        elif "\n" in passage or "<|" in passage:
            continue
        sentences += [s for s in re.split(r"(?<=[.!?])\s+", passage.strip()) if s]
    return sentences


class PromptMaker:
    """Deterministic user messages of about `n` tokens, each starting at its own sentence.

    Every message takes the next sentence of one seeded shuffle as its first (so no two
    share more than the system message as a prefix until the shuffle wraps, and prefix caches
    do not flatter a workload), then seeded random sentences until it is long enough, cut at
    the last word that keeps it within `n` tokens.
    """

    def __init__(self, sentences: Sequence[str], count_tokens: Callable[[str], int], seed: int = 0):
        if not sentences:
            raise ValueError("no sentences to build prompts from")
        self.sentences = list(sentences)
        self.count_tokens = count_tokens
        self.rng = random.Random(seed)
        self.order = self.rng.sample(range(len(self.sentences)), len(self.sentences))
        self.made = 0

    def message(self, n_tokens: int) -> str:
        first = self.sentences[self.order[self.made % len(self.order)]]
        self.made += 1
        parts = [first]
        while self.count_tokens(" ".join(parts)) < n_tokens:
            parts.append(self.rng.choice(self.sentences))
        words = " ".join(parts).split(" ")
        # The longest word prefix within n_tokens (token counts grow with words).
        lo, hi = 1, len(words)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.count_tokens(" ".join(words[:mid])) <= n_tokens:
                lo = mid
            else:
                hi = mid - 1
        return " ".join(words[:lo])


@dataclass(frozen=True)
class Prompts:
    """The user messages of every workload, made once and sent to each server alike."""

    warmup: list[str]
    short: list[str]
    first_turn: list[str]
    conversation: list[list[str]]  # per conversation, one new user message per turn
    concurrency8: list[str]


def make_prompts(
    plan: ServeBenchPlan, count_tokens: Callable[[str], int], sentences: Sequence[str]
) -> Prompts:
    maker = PromptMaker(sentences, count_tokens, plan.seed)
    return Prompts(
        warmup=[maker.message(plan.short_tokens) for _ in range(plan.warmup_requests)],
        short=[maker.message(plan.short_tokens) for _ in range(plan.short_requests)],
        first_turn=[maker.message(plan.first_turn_tokens) for _ in range(plan.first_turn_requests)],
        conversation=[
            [maker.message(plan.turn_tokens) for _ in range(plan.turns)]
            for _ in range(plan.conversations)
        ],
        concurrency8=[
            maker.message(plan.concurrent_tokens) for _ in range(plan.concurrent_requests)
        ],
    )


def chat_body(
    model: str, messages: list[dict[str, str]], max_tokens: int, ignore_eos: bool = False
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "system", "content": SYSTEM_PROMPT}, *messages],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        # The server's own token count on the last chunk (both servers send it when asked).
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:  # only where asked: a natural reply ends at EOS on both servers
        body["ignore_eos"] = True
    return body


# -- driving one server ------------------------------------------------------------------


@dataclass
class WorkloadRun:
    """One workload's requests on one server. `busy_s`: the time the server spent on them."""

    timings: list[RequestTiming]
    busy_s: float
    # Requests that failed but whose figures are not reported (a conversation's first turn).
    unreported_errors: int = 0


class ReplyText:
    """A token test for `stream_timing` that also keeps the reply's text (a conversation
    sends it back on the next turn)."""

    def __init__(self) -> None:
        self.parts: list[str] = []

    def __call__(self, choice: dict) -> bool:
        content = (choice.get("delta") or {}).get("content")
        if content:
            self.parts.append(content)
        return bool(content)  # chat_token's test, and a null delta is no token either

    @property
    def text(self) -> str:
        return "".join(self.parts)


Send = Callable[[list[dict[str, str]]], Awaitable[tuple[RequestTiming, str]]]


async def run_conversation(send: Send, users: Sequence[str]) -> list[RequestTiming]:
    """Turn after turn, each request the whole history so far plus the next user message.

    A failed turn ends the conversation: what the server would have said is unknown, so a
    next turn could not resend it.
    """
    history: list[dict[str, str]] = []
    timings = []
    for user in users:
        message = {"role": "user", "content": user}
        timing, reply = await send([*history, message])
        timings.append(timing)
        if timing.error is not None:
            break
        history += [message, {"role": "assistant", "content": reply}]
    return timings


def conversation_workload(conversations: list[list[RequestTiming]]) -> WorkloadRun:
    """Turns 2 and later of every conversation; a failed first turn still counts as an
    error (it is what ended its conversation)."""
    later = [t for turns in conversations for t in turns[1:]]
    first_errors = sum(1 for turns in conversations if turns and turns[0].error is not None)
    return WorkloadRun(later, sum(t.e2e_ms for t in later) / 1e3, unreported_errors=first_errors)


async def served_model(client: httpx.AsyncClient, base_url: str) -> str:
    resp = await client.get(f"{base_url}/models", timeout=30)
    resp.raise_for_status()
    models = resp.json().get("data") or []
    if not models:
        raise RuntimeError(f"{base_url}/models lists no model")
    return str(models[0]["id"])


async def drive(
    base_url: str,
    prompts: Prompts,
    plan: ServeBenchPlan,
    client: httpx.AsyncClient | None = None,
) -> dict[str, Any]:
    """Every workload on one server, in order. Returns its model and a WorkloadRun each."""
    if client is None:
        # A connection per request, for both servers alike: llama-server closes a streamed
        # response's connection without saying so, and reusing it then failed about one
        # request in six ("Server disconnected without sending a response"). A loopback
        # connect costs well under a millisecond of TTFT.
        limits = httpx.Limits(max_connections=plan.concurrency + 4, max_keepalive_connections=0)
        async with httpx.AsyncClient(limits=limits) as own:
            return await drive(base_url, prompts, plan, own)
    url = f"{base_url}/chat/completions"
    model = await served_model(client, base_url)

    async def send(
        messages: list[dict[str, str]], kind: str, max_tokens: int, ignore_eos: bool = False
    ) -> tuple[RequestTiming, str]:
        reply = ReplyText()
        body = chat_body(model, messages, max_tokens, ignore_eos)
        timing = await stream_timing(client, url, body, kind, is_token=reply)
        return timing, reply.text

    async def sequential(users: list[str], kind: str) -> WorkloadRun:
        timings = [
            (await send([{"role": "user", "content": u}], kind, plan.reply_tokens))[0]
            for u in users
        ]
        return WorkloadRun(timings, sum(t.e2e_ms for t in timings) / 1e3)

    # First-touch costs (page faults in the weights, thread pools) are not what we measure.
    await sequential(prompts.warmup, "warmup")
    runs = {
        "short": await sequential(prompts.short, "short"),
        "first_turn": await sequential(prompts.first_turn, "first_turn"),
    }

    async def turn(messages: list[dict[str, str]]) -> tuple[RequestTiming, str]:
        return await send(messages, "conversation", plan.reply_tokens)

    runs["conversation"] = conversation_workload(
        [await run_conversation(turn, users) for users in prompts.conversation]
    )

    queue = list(reversed(prompts.concurrency8))
    done: list[RequestTiming] = []

    async def worker() -> None:  # closed loop: the next prompt as soon as one ends
        while queue:
            message = [{"role": "user", "content": queue.pop()}]
            timing, _ = await send(
                message, "concurrency8", plan.concurrent_reply_tokens, ignore_eos=True
            )
            done.append(timing)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(plan.concurrency)))
    runs["concurrency8"] = WorkloadRun(done, time.perf_counter() - start)
    return {"model": model, "runs": runs}


# -- figures of one run ------------------------------------------------------------------


def workload_stats(run: WorkloadRun) -> dict[str, Any]:
    """The reported keys of one server on one workload, from its recorded timings."""
    s = summarize(run.timings)
    errors = [t.error for t in run.timings if t.error]
    ok = [t for t in run.timings if t.error is None]
    # The server's usage count where it sent one; else the text chunks the client saw.
    output_tokens = sum(
        t.tokens if t.completion_tokens is None else t.completion_tokens for t in ok
    )
    return {
        "requests": s["requests"] + run.unreported_errors,
        "errors": s["errors"] + run.unreported_errors,
        "ttft_p50_ms": s["ttft_p50_ms"],
        "ttft_p99_ms": s["ttft_p99_ms"],
        "itl_p50_ms": s["itl_p50_ms"],
        "itl_p99_ms": s["itl_p99_ms"],
        "output_tokens": output_tokens,
        "requests_without_usage": sum(1 for t in ok if t.completion_tokens is None),
        "busy_s": run.busy_s,
        "output_tok_s": output_tokens / run.busy_s if run.busy_s > 0 else None,
        "error_examples": sorted(set(errors))[:3],
    }


def ratio(ours: float | None, peer: float | None) -> float | None:
    """ours / peer; None when either is unknown or the peer's is 0."""
    if ours is None or not peer:
        return None
    return ours / peer


def workload_ratios(ours: dict[str, Any], peer: dict[str, Any]) -> dict[str, float | None]:
    return {name: ratio(ours.get(key), peer.get(key)) for name, key in RATIOS}


def assemble(
    plan: ServeBenchPlan,
    ours: dict[str, Any],
    peer: dict[str, Any] | None,
    prompt_tokens: dict[str, float],
) -> dict[str, Any]:
    """The result: per server and workload its figures, and with a peer the ratios.

    `ours` / `peer`: what `drive` returned, plus anything measured beside it (memory, KV
    capacity, url), which is kept as-is under the server's key.
    """
    result: dict[str, Any] = {
        "spec": asdict(plan),
        "workloads": list(WORKLOADS),
        "prompt_tokens": prompt_tokens,
        "samples": {},
    }
    servers = {"ours": ours} if peer is None else {"ours": ours, "peer": peer}
    for name, server in servers.items():
        entry = {k: v for k, v in server.items() if k != "runs"}
        for workload in WORKLOADS:
            run = server["runs"][workload]
            entry[workload] = workload_stats(run)
            result["samples"].setdefault(workload, {})[name] = timing_samples(run.timings)
        result[name] = entry
    if peer is not None:
        for workload in WORKLOADS:
            result[workload] = workload_ratios(result["ours"][workload], result["peer"][workload])
        result["rss_ratio"] = ratio(result["ours"].get("rss_mb"), result["peer"].get("rss_mb"))
        result["kv_tokens_ratio"] = ratio(
            result["ours"].get("kv_tokens"), result["peer"].get("kv_tokens")
        )
    return result


def table_rows(result: dict[str, Any]) -> list[tuple[str, object, object, object]]:
    """(metric, ours, peer, ours / peer) for `print_table`."""
    ours, peer = result["ours"], result.get("peer") or {}
    rows: list[tuple[str, object, object, object]] = []
    for workload in WORKLOADS:
        ratios = result.get(workload) or {}
        for key in _TABLE_KEYS:
            ratio_name = _TABLE_RATIOS.get(key)
            rows.append(
                (
                    f"{workload} {key}",
                    ours[workload][key],
                    (peer.get(workload) or {}).get(key),
                    ratios.get(ratio_name) if ratio_name else None,
                )
            )
    rows.append(
        ("rss_mb (every process)", ours["rss_mb"], peer.get("rss_mb"), result.get("rss_ratio"))
    )
    rows.append(
        ("kv_tokens", ours["kv_tokens"], peer.get("kv_tokens"), result.get("kv_tokens_ratio"))
    )
    return rows


def notes(result: dict[str, Any]) -> list[str]:
    """What the table leaves out: why a figure is missing, where a KV capacity came from,
    and what the failed requests said."""
    lines = []
    for name in ("ours", "peer"):
        server = result.get(name)
        if not server:
            continue
        if server.get("rss_note"):
            lines.append(f"{name} rss: {server['rss_note']}")
        if server.get("kv_tokens_source"):
            lines.append(f"{name} kv_tokens: {server['kv_tokens_source']}")
        for workload in WORKLOADS:
            for example in server[workload]["error_examples"]:
                lines.append(f"{name} {workload} error: {example}")
    return lines


def write_figures(result: dict[str, Any], directory: str | Path) -> list[Path]:
    """TTFT and ITL CDFs per workload, one line per server (their scales differ by workload:
    tens of ms for a short turn, seconds under concurrency)."""
    from tools.bench.plots import write_plots  # matplotlib: only when asked for

    written: list[Path] = []
    for workload, samples in (result.get("samples") or {}).items():
        written += write_plots(f"serve_{workload}", {"samples": samples}, directory)
    return written


# -- memory and KV capacity --------------------------------------------------------------


def _status_kb(pid: int, field_name: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(f"{field_name}:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _descendants(pid: int) -> list[int]:
    """Children of `pid`, theirs, and so on (a worker that starts a helper process)."""
    found: list[int] = []
    pending = [pid]
    while pending:
        parent = pending.pop()
        try:
            tasks = Path(f"/proc/{parent}/task").iterdir()
            children = [int(c) for t in tasks for c in (t / "children").read_text().split()]
        except OSError:
            continue
        found += children
        pending += children
    return found


def process_memory(pids: dict[str, int]) -> dict[str, Any]:
    """RSS per named process (and its descendants), summed; null with a reason where /proc
    cannot tell."""
    by_process: dict[str, float | None] = {}
    for name, pid in pids.items():
        by_process[name] = _mb(_status_kb(pid, "VmRSS"))
        for child in _descendants(pid):
            by_process[f"{name}/{child}"] = _mb(_status_kb(child, "VmRSS"))
    unread = [name for name, mb in by_process.items() if mb is None]
    memory: dict[str, Any] = {"rss_mb_by_process": by_process, "rss_mb": None}
    if unread:
        memory["rss_note"] = f"no RSS in /proc for {', '.join(unread)}"
    else:
        memory["rss_mb"] = sum(mb for mb in by_process.values() if mb is not None)
    return memory


def _mb(kb: int | None) -> float | None:
    return None if kb is None else kb / 1024


_BLOCKS_TOTAL = re.compile(r"^splitserve_kv_cache_blocks_total(?:\{[^}]*\})?\s+([0-9.eE+]+)$")


def kv_blocks_from_metrics(text: str) -> int | None:
    """`splitserve_kv_cache_blocks_total` of one worker's Prometheus page."""
    for line in text.splitlines():
        match = _BLOCKS_TOTAL.match(line.strip())
        if match:
            return int(float(match.group(1)))
    return None


def kv_tokens_from_config(
    kv_cache_bytes: int, block_size: int, model_path: str, kv_cache_dtype: str = "float32"
) -> int:
    """What a worker allocates: whole blocks of the budget (services/worker/runtime.py), each
    holding K and V of every layer in the dtype `kv_cache_dtype` resolves to on this machine."""
    from engine.kvcache.kv_dtype import resolve_kv_dtype
    from shared.modelfile.gguf_meta import read_gguf_config

    c = read_gguf_config(model_path)
    itemsize = resolve_kv_dtype(kv_cache_dtype)[0].itemsize
    block_bytes = c.num_layers * 2 * block_size * c.num_kv_heads * c.head_dim * itemsize
    return (kv_cache_bytes // block_bytes) * block_size


def our_kv_capacity(stack: Any, model_path: str) -> dict[str, Any]:
    """Each worker's KV pool in tokens: read from its /metrics, else from the config."""
    config = stack.config
    ready = httpx.get(stack.ready_url, timeout=10).json()
    by_worker: dict[str, int] = {}
    decode = 0
    source = "workers' /metrics (splitserve_kv_cache_blocks_total x block_size)"
    for worker_id, worker in sorted((ready.get("workers") or {}).items()):
        blocks = None
        if worker.get("metrics_address"):
            try:
                page = httpx.get(f"http://{worker['metrics_address']}/metrics", timeout=10)
                blocks = kv_blocks_from_metrics(page.text)
            except httpx.HTTPError:
                blocks = None
        if blocks is not None:
            tokens = blocks * config.block_size
        else:
            model = config.model(worker["model"])
            tokens = kv_tokens_from_config(
                model.worker.kv_cache_bytes,
                config.block_size,
                model_path,
                model.worker.kv_cache_dtype,
            )
            source = "config kv_cache_bytes and the model's KV layout (a worker had no /metrics)"
        name = f"{worker['role']} {worker_id}"
        by_worker[name] = tokens
        if worker["role"] in ("decode", "both"):
            decode += tokens
    return {
        "kv_tokens": sum(by_worker.values()) if by_worker else None,
        # What bounds the live sequences: a prefill pool holds prompts and cached prefixes.
        "kv_tokens_decode": decode if by_worker else None,
        "kv_tokens_by_worker": by_worker,
        "kv_tokens_source": source if by_worker else "no worker in /ready",
    }


def peer_kv_capacity(root_url: str, given: int | None) -> dict[str, Any]:
    if given is not None:
        return {"kv_tokens": given, "kv_tokens_source": "--peer-kv-tokens"}
    try:
        props = httpx.get(f"{root_url}/props", timeout=10).json()
        n_ctx = int(props["default_generation_settings"]["n_ctx"])
        slots = int(props["total_slots"])
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        return {
            "kv_tokens": None,
            "kv_tokens_source": f"unknown: no llama-server /props ({type(exc).__name__}); "
            "pass --peer-kv-tokens N",
        }
    return {
        "kv_tokens": n_ctx * slots,
        "kv_tokens_source": f"/props n_ctx {n_ctx} per slot x {slots} slots (with a unified "
        "KV cache, -kvu, each slot may use all of n_ctx: pass --peer-kv-tokens then)",
    }


def peer_memory(pid: int | None) -> dict[str, Any]:
    if pid is None:
        return {"rss_mb": None, "rss_note": "pass --peer-pid PID to read the peer's RSS"}
    if not Path(f"/proc/{pid}").exists():
        return {"rss_mb": None, "rss_note": f"no process {pid} (--peer-pid)"}
    return process_memory({"peer": pid})


# -- the whole bench ---------------------------------------------------------------------


def api_base(url: str) -> str:
    """The OpenAI API root of a server given as http://host:port or http://host:port/v1."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else f"{url}/v1"


class PeerUnavailable(RuntimeError):
    """The peer did not answer /v1/models."""


def check_reachable(base_url: str) -> None:
    """Fail before our stack spends minutes starting if the peer does not answer."""
    try:
        httpx.get(f"{base_url}/models", timeout=10).raise_for_status()
    except httpx.HTTPError as exc:
        raise PeerUnavailable(f"the peer at {base_url} did not answer /models: {exc}") from exc


@dataclass
class ServeBenchOptions:
    plan: ServeBenchPlan = field(default_factory=ServeBenchPlan)
    config_path: str | None = None
    weights: str | None = None
    threads: int | None = None
    peer: str | None = None
    peer_pid: int | None = None
    peer_kv_tokens: int | None = None
    startup_timeout_s: float = 300.0


def stack_config(options: ServeBenchOptions) -> Any:
    """The deployment `splitserve up` would run (or --config's), on free ports: a fixed
    port would collide with a stack already running here."""
    from services.launcher.stack import available_cpus
    from services.launcher.topology import local_topology
    from shared.config.schema import load_config

    config = load_config(options.config_path)
    if options.config_path is None:  # the topology `splitserve up` picks for this machine
        config = local_topology(config, available_cpus()).config
    coordinator = config.coordinator.model_copy(update={"port": 0, "registry_port": 0})
    models = []
    for model in config.models:
        update: dict[str, Any] = {}
        if options.weights is not None:
            update["weights"] = options.weights
        if options.threads is not None:
            update["worker"] = model.worker.model_copy(update={"threads": options.threads})
        models.append(model.model_copy(update=update))
    return config.model_copy(update={"coordinator": coordinator, "models": models})


def run(options: ServeBenchOptions) -> dict[str, Any]:
    from services.launcher import start_local_stack
    from shared.modelfile.default import default_model_path
    from shared.tokenizer import Tokenizer

    config = stack_config(options)
    peer_base = api_base(options.peer) if options.peer else None
    if peer_base:
        check_reachable(peer_base)
    model = config.models[0]
    model_path = model.path or default_model_path()
    # Prompt sizes are counted in the served model's tokens where it is a GGUF (the peer is
    # meant to serve the same file); the bundled model's tokenizer otherwise.
    tokenizer = Tokenizer.from_gguf(
        model_path if model_path.endswith(".gguf") else default_model_path()
    )

    def count(text: str) -> int:
        return len(tokenizer.encode(text))

    plan = options.plan
    prompts = make_prompts(plan, count, corpus_sentences())
    prompt_tokens = {
        "short": _mean([count(p) for p in prompts.short]),
        "first_turn": _mean([count(p) for p in prompts.first_turn]),
        "conversation_turn": _mean([count(p) for c in prompts.conversation for p in c]),
        "concurrency8": _mean([count(p) for p in prompts.concurrency8]),
    }
    with start_local_stack(config, options.startup_timeout_s) as stack:
        ours = asyncio.run(drive(stack.base_url, prompts, plan))
        # Measured after the run: caches and pools have grown to what serving needed.
        ours.update(process_memory({n: p.pid for n, p in stack.processes.items()}))
        ours.update(our_kv_capacity(stack, model_path))
        ours.update(
            url=stack.base_url,
            weights=model.weights,
            threads={m.id: m.worker.threads for m in stack.config.models},
            pools={role: getattr(model.pools, role) for role in ("prefill", "decode", "both")},
        )
    peer = None
    if peer_base:
        peer = asyncio.run(drive(peer_base, prompts, plan))
        peer.update(peer_memory(options.peer_pid))
        peer.update(peer_kv_capacity(peer_base.removesuffix("/v1"), options.peer_kv_tokens))
        peer["url"] = peer_base
    return assemble(plan, ours, peer, prompt_tokens)


def _mean(values: list[int]) -> float:
    return sum(values) / len(values) if values else 0.0
