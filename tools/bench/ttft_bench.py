"""`splitserve bench ttft`: where a disaggregated request's time to first token goes.

One local stack (coordinator + 1 prefill + 1 decode, tracing to a file), one request at a
time, each a fresh prompt of about 300 tokens (nothing to reuse from the prefix cache). Every
request's trace, joined with the client's own clock (one machine: spans and client use the
same wall clock), gives its parts:

- `coordinator_overhead`: the request entering the coordinator to its Prefill RPC leaving;
- `prefill_queue`, `prefill_compute`: the prefill replica's wait for the engine, then its
  chunks up to the end of the step that sampled the first token;
- `first_token_after_sample`: that sample to the client reading the token's SSE chunk (the
  prefill's message, the coordinator's relay, the HTTP stream) — since the first token no
  longer waits for the KV transfer, this is all that follows the prefill;
- `transfer` and `transfer_end_after_first_token` (the push goes on after the client has
  its token: positive means the transfer overlaps what the client already reads);
- `decode_kv_wait`, `decode_first_step`: the Decode call waiting for KV still in flight,
  then its first token once the KV is there;
- `second_token_gap`: the client's first to second token.

Each is reported as its p50 over the requests. Beside them: `coordinator_ready_s`, from
starting `splitserve serve coordinator` to its first successful HTTP answer (`/health`),
and `coordinator_rss_mb`, its resident memory after the requests.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from services.launcher.processes import ProcessGroup
from services.launcher.readiness import wait_until_ready
from services.launcher.stack import LocalStack, resolve_config, service_launches
from shared.config.schema import dump_config, parse_config
from shared.modelfile.default import DEFAULT_MODEL_ID, default_model_path
from shared.telemetry import attributes as A
from shared.telemetry.file_export import read_span_file
from shared.telemetry.propagation import TRACE_ID_HEADER
from shared.telemetry.records import SpanRecord
from shared.tokenizer import Tokenizer
from tools.bench.load import filler_text, percentile

PARTS = (
    "ttft",
    "coordinator_overhead",
    "prefill_queue",
    "prefill_compute",
    "first_token_after_sample",
    "prefill_send",
    "rpc_to_coordinator",
    "coordinator_relay",
    "client_delivery",
    "transfer",
    "transfer_end_after_first_token",
    "decode_kv_wait",
    "decode_first_step",
    "second_token_gap",
)


def _config(weights: str, trace_file: Path) -> dict:
    return {
        "coordinator": {"port": 0, "registry_port": 0},
        "transfer": {"backend": "shm"},
        "telemetry": {"exporter": "file", "file": str(trace_file), "sampling_ratio": 1.0},
        # Every request takes the disaggregated path, however the decode replica's cache looks.
        "router": {"local_prefill_max_tokens": 0},
        "models": [
            {
                "id": DEFAULT_MODEL_ID,
                "weights": weights,
                "pools": {"prefill": 1, "decode": 1},
                "worker": {"kv_cache_bytes": 96 << 20, "host_cache_bytes": 32 << 20},
            }
        ],
    }


@dataclass
class ClientSide:
    """What the client saw of one streamed request, on the wall clock (ns)."""

    trace_id: str
    sent_ns: int
    token_ns: list[int] = field(default_factory=list)
    prompt_tokens: int = 0


def _prompt_messages(i: int, tokenizer: Tokenizer, prompt_tokens: int) -> list[dict]:
    """A prompt of about `prompt_tokens` tokens that no earlier request shares a block of."""
    words = prompt_tokens
    while True:
        content = f"Note {uuid.uuid4().hex}: {filler_text(words, 1000 + i)}"
        messages = [{"role": "user", "content": content}]
        n = len(tokenizer.encode(tokenizer.apply_chat_template(messages)))
        if n <= prompt_tokens or words < 8:
            return messages
        words -= max(1, (n - prompt_tokens) // 2)


async def _one(http: httpx.AsyncClient, url: str, messages: list[dict], max_tokens: int):
    body = {
        "model": DEFAULT_MODEL_ID,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.time_ns()
    async with http.stream("POST", url, json=body, timeout=300) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        seen = ClientSide(resp.headers.get(TRACE_ID_HEADER, ""), sent)
        # A token's time is when its bytes arrive, taken before any parsing: the client's
        # own line splitting and JSON decoding are not the server's delivery.
        arrived: list[tuple[int, bytes]] = []
        async for raw in resp.aiter_raw():
            arrived.append((time.time_ns(), raw))
        for now, line in _sse_lines(arrived):
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                raise RuntimeError(f"stream error: {data['error']}")
            if any(c.get("delta", {}).get("content") for c in data.get("choices", [])):
                seen.token_ns.append(now)
            if data.get("usage"):
                seen.prompt_tokens = data["usage"]["prompt_tokens"]
    return seen


async def _drive(base_url: str, prompts: list[list[dict]], max_tokens: int) -> list[ClientSide]:
    url = f"{base_url}/chat/completions"
    async with httpx.AsyncClient() as http:
        return [await _one(http, url, messages, max_tokens) for messages in prompts]


def _sse_lines(arrived: list[tuple[int, bytes]]):
    """(arrival ns of the bytes that completed it, line) for each line of the stream."""
    pending = b""
    for now, raw in arrived:
        pending += raw
        *lines, pending = pending.split(b"\n")
        for line in lines:
            yield now, line.decode().rstrip("\r")


def _event_ns(span: SpanRecord | None, name: str) -> int | None:
    if span is None:
        return None
    return next((e.time_ns for e in span.events if e.name == name), None)


def _one_span(spans: list[SpanRecord], service: str, name: str, kind: str | None = None):
    found = [
        s
        for s in spans
        if s.service == f"splitserve-{service}"
        and s.name == name
        and (kind is None or s.kind == kind)
    ]
    return found[0] if len(found) == 1 else None


def breakdown(client: ClientSide, spans: list[SpanRecord]) -> dict[str, float | None]:
    """One request's parts in ms (None where its trace lacks the span)."""
    ms = 1e-6
    root = next((s for s in spans if s.parent_span_id is None), None)
    prefill_call = _one_span(spans, "coordinator", A.SPAN_PREFILL, "CLIENT")
    prefill = _one_span(spans, "prefill", A.SPAN_PREFILL, "SERVER")
    decode = _one_span(spans, "decode", A.SPAN_DECODE, "SERVER")
    transfer = _one_span(spans, "prefill", A.SPAN_TRANSFER)
    kv_wait = _one_span(spans, "decode", A.SPAN_KV_WAIT)
    chunks = sorted(
        (s for s in spans if s.name == A.SPAN_CHUNK and s.service == "splitserve-prefill"),
        key=lambda s: s.start_ns,
    )
    first_ns = client.token_ns[0] if client.token_ns else None
    out: dict[str, float | None] = dict.fromkeys(PARTS)
    if first_ns is not None:
        out["ttft"] = (first_ns - client.sent_ns) * ms
    if len(client.token_ns) > 1:
        out["second_token_gap"] = (client.token_ns[1] - client.token_ns[0]) * ms
    if root is not None and prefill_call is not None:
        out["coordinator_overhead"] = (prefill_call.start_ns - root.start_ns) * ms
    if prefill is not None and chunks:
        out["prefill_queue"] = (chunks[0].start_ns - prefill.start_ns) * ms
        out["prefill_compute"] = (chunks[-1].end_ns - chunks[0].start_ns) * ms
        if first_ns is not None:
            out["first_token_after_sample"] = (first_ns - chunks[-1].end_ns) * ms
    # first_token_after_sample in four legs: out of the prefill replica, over its RPC, through
    # the coordinator, and over HTTP into the client's parsed stream.
    sent = _event_ns(prefill, A.EVENT_FIRST_TOKEN)
    relay_from = _event_ns(prefill_call, A.EVENT_FIRST_TOKEN)
    relay_to = _event_ns(root, A.EVENT_FIRST_TOKEN)
    if sent is not None and chunks:
        out["prefill_send"] = (sent - chunks[-1].end_ns) * ms
    if sent is not None and relay_from is not None:
        out["rpc_to_coordinator"] = (relay_from - sent) * ms
    if relay_from is not None and relay_to is not None:
        out["coordinator_relay"] = (relay_to - relay_from) * ms
    if relay_to is not None and first_ns is not None:
        out["client_delivery"] = (first_ns - relay_to) * ms
    if transfer is not None:
        out["transfer"] = (transfer.end_ns - transfer.start_ns) * ms
        if first_ns is not None:
            out["transfer_end_after_first_token"] = (transfer.end_ns - first_ns) * ms
    if decode is not None:
        waited = (kv_wait.end_ns - kv_wait.start_ns) if kv_wait is not None else 0
        out["decode_kv_wait"] = waited * ms
        decoded = _event_ns(decode, A.EVENT_FIRST_TOKEN)
        if decoded is not None:
            out["decode_first_step"] = (decoded - decode.start_ns - waited) * ms
    return out


def _rss_mb(pid: int) -> tuple[float | None, float | None]:
    """(resident, peak resident) MiB of `pid`, from /proc; None where it cannot tell."""
    values: dict[str, float] = {}
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    values[key] = int(rest.split()[0]) / 1024
    except OSError:
        return None, None
    return values.get("VmRSS"), values.get("VmHWM")


def run(
    weights: str = "fp32",
    requests: int = 30,
    prompt_tokens: int = 300,
    max_tokens: int = 4,
    warmup: int = 3,
    startup_timeout_s: float = 300.0,
) -> dict:
    if requests < 1:
        raise ValueError("requests must be >= 1")
    tokenizer = Tokenizer.from_gguf(default_model_path())
    prompts = [_prompt_messages(i, tokenizer, prompt_tokens) for i in range(warmup + requests)]
    result: dict = {
        "weights": weights,
        "requests": requests,
        "warmup_requests": warmup,
        "target_prompt_tokens": prompt_tokens,
        "max_tokens": max_tokens,
    }
    with tempfile.TemporaryDirectory(prefix="splitserve-ttft-") as tmp:
        trace_file = Path(tmp) / "traces.jsonl"
        resolved = resolve_config(parse_config(_config(weights, trace_file)))
        run_dir = Path(tmp) / "stack"
        run_dir.mkdir()
        config_path = run_dir / "config.yaml"
        config_path.write_text(dump_config(resolved))
        stack = LocalStack(resolved, run_dir, config_path, ProcessGroup(run_dir))
        try:
            coordinator, *workers = service_launches(resolved, config_path)
            started = time.perf_counter()
            process = stack.group.start(coordinator)
            wait_until_ready(f"{stack.url}/health", stack.group, startup_timeout_s, interval_s=0.01)
            result["coordinator_ready_s"] = time.perf_counter() - started
            for spec in workers:
                stack.group.start(spec)
            wait_until_ready(stack.ready_url, stack.group, startup_timeout_s)
            seen = asyncio.run(_drive(stack.base_url, prompts, max_tokens))[warmup:]
            result["coordinator_rss_mb"], result["coordinator_peak_rss_mb"] = _rss_mb(process.pid)
        finally:
            stack.stop()  # flushes every service's spans
        by_trace: dict[str, list[SpanRecord]] = {}
        for span in read_span_file(trace_file) if trace_file.exists() else []:
            by_trace.setdefault(span.trace_id, []).append(span)
    rows = [breakdown(client, by_trace.get(client.trace_id, [])) for client in seen]
    samples = {part: [r[part] for r in rows if r[part] is not None] for part in PARTS}
    result["prompt_tokens_p50"] = percentile([float(c.prompt_tokens) for c in seen], 0.5)
    result["traced_requests"] = sum(1 for c in seen if by_trace.get(c.trace_id))
    parts = {f"{p}_ms_p50": percentile(samples[p], 0.5) for p in PARTS}
    result["ttft_breakdown_ms"] = parts
    for headline in ("coordinator_overhead_ms_p50", "first_token_after_sample_ms_p50"):
        result[headline] = parts[headline]
    result["samples_ms"] = samples
    # The CDF figure `--plot` draws from every benchmark's `samples`.
    result["samples"] = {"disaggregated": {"ttft_ms": samples["ttft"]}}
    return result


def table_rows(r: dict) -> list[tuple[str, object, object, object]]:
    parts = r["ttft_breakdown_ms"]
    ttft = parts.get("ttft_ms_p50")
    rows: list[tuple[str, object, object, object]] = []
    for part in PARTS:
        value = parts.get(f"{part}_ms_p50")
        share = value / ttft if value is not None and ttft else None
        rows.append((f"{part} ms p50", value, ttft if part != "ttft" else None, share))
    rows.append(("coordinator_ready_s", r.get("coordinator_ready_s"), None, None))
    rows.append(("coordinator_rss_mb", r.get("coordinator_rss_mb"), None, None))
    rows.append(("traced requests", r.get("traced_requests"), r.get("requests"), None))
    return rows
