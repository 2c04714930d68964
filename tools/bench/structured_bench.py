"""`splitserve bench structured`: JSON-schema outputs beside the same prompts unconstrained.

One in-process engine behind the real HTTP app (the coordinator's validation, retry loop and
SSE encoder included), on loopback: 64 streamed chat requests at concurrency 8, greedy, each
with one of 20 JSON schemas (request i uses schema i mod 20, so the first 20 compile their
grammar and the rest find it cached); then the same prompts without `response_format`, each
held to the token count its constrained twin produced (`ignore_eos`), so both phases decode
the same number of tokens per request and the throughput ratio is the grammar's cost alone.
Reported:

- `valid_fraction`: constrained outputs that parse and validate (`jsonschema`) against their
  schema and ended "stop" (target 1.0);
- `throughput_ratio`: output tokens/s constrained ÷ unconstrained (target >= 0.9);
- `mask_ms_p50`: the engine's per-step mask computation (all constrained rows of a step),
  and `mask_wait_ms_p50`, the part of it sampling waited for (the rest hid behind the
  forward pass);
- `ttft_delta_ms_p50`: median over prompts of TTFT constrained − TTFT unconstrained, and the
  same for first-use (grammar compiled) and cached schemas apart.

The two phases open with a different system message, so neither reuses the other's prefix
cache (within a phase, prompts share their prefix alike).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field
from importlib import resources

import httpx
import jsonschema
import torch

from engine.core.config import EngineConfig
from engine.core.engine import Engine
from engine.model.llama import LlamaModel
from engine.model.loader import read_checkpoint
from services.coordinator.api.app import create_app
from services.coordinator.api.server import ServerThread
from services.coordinator.settings import APISettings
from shared.modelfile.default import DEFAULT_MODEL_ID, default_model_path
from shared.tokenizer import Tokenizer
from tools.bench.load import StreamError, stream_events
from tools.inprocess.engine_backend import EngineBackend

NUM_REQUESTS = 64
CONCURRENCY = 8
# An upper bound only: a constrained reply ends itself when its value is complete.
MAX_TOKENS = 128


def load_schemas() -> dict[str, dict]:
    """The 20 schemas (nested objects, arrays, enums, bounds, anyOf, $ref, patterns)."""
    text = resources.files("tools.bench").joinpath("data/structured_schemas.json").read_text()
    return json.loads(text)


@dataclass
class Reply:
    schema: str | None
    ttft_ms: float | None = None
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int = 0
    error: str | None = None


@dataclass
class Phase:
    replies: list[Reply] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def tokens(self) -> int:
        return sum(r.completion_tokens for r in self.replies)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def _body(system: str, name: str, schema: dict | None, max_tokens: int = MAX_TOKENS) -> dict:
    body: dict = {
        "model": DEFAULT_MODEL_ID,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": f"Reply with a JSON object for: {name.replace('_', ' ')}."},
        ],
        "temperature": 0,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if schema is None:
        body["ignore_eos"] = True  # as many tokens as asked for: the constrained twin's count
    else:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": name, "schema": schema, "strict": True},
        }
    return body


async def _one(client: httpx.AsyncClient, body: dict, schema: str | None) -> Reply:
    reply = Reply(schema)
    start = time.perf_counter()
    try:
        async for data in stream_events(client, "/v1/chat/completions", body):
            usage = data.get("usage")
            if usage:
                reply.completion_tokens = int(usage["completion_tokens"])
            for choice in data.get("choices", []):
                content = choice.get("delta", {}).get("content")
                if content and reply.ttft_ms is None:
                    reply.ttft_ms = (time.perf_counter() - start) * 1e3
                reply.text += content or ""
                reply.finish_reason = choice.get("finish_reason") or reply.finish_reason
    except (StreamError, httpx.HTTPError) as exc:
        reply.error = str(exc)
    return reply


async def _phase(url: str, bodies: list[tuple[dict, str | None]]) -> Phase:
    gate = asyncio.Semaphore(CONCURRENCY)

    async def run(body: dict, schema: str | None) -> Reply:
        async with gate:
            return await _one(client, body, schema)

    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        start = time.perf_counter()
        replies = await asyncio.gather(*(run(b, s) for b, s in bodies))
        return Phase(list(replies), time.perf_counter() - start)


def _valid(reply: Reply, schema: dict) -> bool:
    if reply.error or reply.finish_reason != "stop":
        return False
    try:
        jsonschema.validate(json.loads(reply.text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def _p50_delta(pairs: list[tuple[Reply, Reply]]) -> float | None:
    deltas = [
        c.ttft_ms - f.ttft_ms for c, f in pairs if c.ttft_ms is not None and f.ttft_ms is not None
    ]
    return round(statistics.median(deltas), 3) if deltas else None


def run(weights: str = "fp32", model_path: str | None = None, threads: int = 2) -> dict:
    torch.set_num_threads(threads)
    path = model_path or default_model_path()
    tokenizer = Tokenizer.from_gguf(path)
    model = LlamaModel(read_checkpoint(path), weights=weights)
    engine = Engine(
        EngineConfig(
            model=path,
            weights=weights,  # type: ignore[arg-type]
            kv_cache_bytes=256 << 20,
            num_threads=threads,
            max_num_seqs=CONCURRENCY,
        ),
        model=model,
        tokenizer=tokenizer,
    )
    schemas = load_schemas()
    names = list(schemas)
    picks = [names[i % len(names)] for i in range(NUM_REQUESTS)]
    backend = EngineBackend(engine, model_id=DEFAULT_MODEL_ID).start()
    try:
        with ServerThread(create_app(backend, APISettings(model_id=DEFAULT_MODEL_ID))) as server:
            # Warm-up on prompts neither phase uses: first steps, thread pools, and the grammar
            # vocabulary (built once per engine, as a worker does at startup; what "first
            # use" measures below is each schema's own compile).
            warm = [(_body("Warm-up.", n, None, 8), None) for n in names[:3]]
            warm.append((_body("Warm-up.", "anything", {"type": "object"}, 8), "warm"))
            asyncio.run(_phase(server.url, warm))
            constrained = asyncio.run(
                _phase(
                    server.url,
                    [(_body("You answer in JSON.", n, schemas[n]), n) for n in picks],
                )
            )
            lengths = [max(1, r.completion_tokens) for r in constrained.replies]
            free = asyncio.run(
                _phase(
                    server.url,
                    [
                        (_body("You answer briefly.", n, None, k), None)
                        for n, k in zip(picks, lengths, strict=True)
                    ],
                )
            )
    finally:
        backend.close()
    stats = engine.structured_stats()
    valid = [_valid(r, schemas[n]) for r, n in zip(constrained.replies, picks, strict=True)]
    pairs = list(zip(constrained.replies, free.replies, strict=True))
    first_use = len(names)
    return {
        "weights": weights,
        "threads": threads,
        "requests": NUM_REQUESTS,
        "concurrency": CONCURRENCY,
        "max_tokens": MAX_TOKENS,
        "schemas": len(names),
        "valid_fraction": round(sum(valid) / len(valid), 4),
        "invalid": [n for n, ok in zip(picks, valid, strict=True) if not ok],
        "errors": [r.error for r in constrained.replies + free.replies if r.error],
        "throughput_ratio": round(constrained.tok_s / free.tok_s, 4) if free.tok_s else None,
        "constrained_tok_s": round(constrained.tok_s, 2),
        "unconstrained_tok_s": round(free.tok_s, 2),
        "constrained_tokens": constrained.tokens,
        "unconstrained_tokens": free.tokens,
        "mask_ms_p50": stats.get("mask_ms_p50"),
        "mask_wait_ms_p50": stats.get("mask_wait_ms_p50"),
        "mask_steps": stats.get("mask_steps"),
        "ttft_delta_ms_p50": _p50_delta(pairs),
        "ttft_delta_first_use_ms_p50": _p50_delta(pairs[:first_use]),
        "ttft_delta_cached_ms_p50": _p50_delta(pairs[first_use:]),
        "grammar_cache": {k: stats.get(k) for k in ("cached", "hits", "misses")},
        "ttft_ms": {
            "constrained": [r.ttft_ms and round(r.ttft_ms, 2) for r in constrained.replies],
            "unconstrained": [r.ttft_ms and round(r.ttft_ms, 2) for r in free.replies],
        },
    }


def table_rows(result: dict) -> list[tuple[str, object, object, object]]:
    return [
        ("valid_fraction", result["valid_fraction"], 1.0, result["valid_fraction"]),
        (
            "tok/s constrained vs free",
            result["constrained_tok_s"],
            result["unconstrained_tok_s"],
            result["throughput_ratio"],
        ),
        ("mask_ms_p50 (per step)", result["mask_ms_p50"], None, None),
        ("mask_wait_ms_p50 (not hidden)", result["mask_wait_ms_p50"], None, None),
        ("ttft_delta_ms_p50", result["ttft_delta_ms_p50"], None, None),
        (
            "ttft_delta first use / cached",
            result["ttft_delta_first_use_ms_p50"],
            result["ttft_delta_cached_ms_p50"],
            None,
        ),
    ]
