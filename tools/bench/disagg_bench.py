"""`splitserve bench disagg`: the same two worker processes run as two colocated replicas and
as one prefill + one decode replica, under a stream of short chat turns with long prompts
arriving periodically. Disaggregation should keep decode ITL smooth while long prompts
prefill; the coordinator's own overhead is measured against calling a worker directly."""

from __future__ import annotations

import asyncio
import time

import grpc
import httpx

from services.launcher import start_local_stack
from shared.config.schema import parse_config
from shared.modelfile.default import DEFAULT_MODEL_ID, default_model_path
from shared.proto_gen import worker_pb2 as pb
from shared.proto_gen import worker_pb2_grpc as pb_grpc
from shared.sampling.params import SamplingParams
from shared.tokenizer import Tokenizer
from shared.wire.convert import params_to_proto
from tools.bench.load import (
    RequestTiming,
    filler_text,
    percentile,
    stream_chat,
    summarize,
    timing_samples,
)


def _config(mode: str, weights: str) -> dict:
    pools = (
        {"both": 2, "prefill": 0, "decode": 0}
        if mode == "colocated"
        else {"prefill": 1, "decode": 1}
    )
    return {
        "coordinator": {"port": 0, "registry_port": 0, "max_tokens_limit": 4096},
        "transfer": {"backend": "shm"},
        "models": [
            {
                "id": DEFAULT_MODEL_ID,
                "weights": weights,
                "pools": pools,
                "worker": {
                    "kv_cache_bytes": 768 << 20,
                    "host_cache_bytes": 256 << 20,
                    "threads": 1,
                },
            }
        ],
    }


def _short_body(i: int, reply_tokens: int) -> dict:
    return {
        "model": DEFAULT_MODEL_ID,
        "messages": [
            {"role": "system", "content": "You are a cheerful companion in a chat app."},
            {"role": "user", "content": filler_text(60, i)},
            {"role": "assistant", "content": filler_text(30, 1000 + i)},
            {"role": "user", "content": f"Tell me more, please ({i})."},
        ],
        "max_tokens": reply_tokens,
        "temperature": 0.7,
        "seed": i,
        "ignore_eos": True,
        "stream": True,
    }


def _long_body(i: int, prompt_words: int) -> dict:
    return {
        "model": DEFAULT_MODEL_ID,
        "messages": [{"role": "user", "content": filler_text(prompt_words, 5000 + i)}],
        "max_tokens": 16,
        "ignore_eos": True,
        "stream": True,
    }


async def _drive(
    base_url: str,
    duration_s: float,
    short_every_s: float,
    long_every_s: float,
    reply_tokens: int,
    long_words: int,
) -> list[RequestTiming]:
    url = f"{base_url}/chat/completions"
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(limits=limits) as client:
        # Warm-up request (first-touch costs are not what we measure).
        await stream_chat(client, url, _short_body(-1, 8), "warmup")
        tasks = []
        start = time.perf_counter()
        next_short, next_long, i, j = 0.0, long_every_s / 2, 0, 0
        while (now := time.perf_counter() - start) < duration_s:
            if now >= next_short:
                tasks.append(
                    asyncio.create_task(
                        stream_chat(client, url, _short_body(i, reply_tokens), "short")
                    )
                )
                i += 1
                next_short += short_every_s
            if now >= next_long:
                tasks.append(
                    asyncio.create_task(stream_chat(client, url, _long_body(j, long_words), "long"))
                )
                j += 1
                next_long += long_every_s
            await asyncio.sleep(0.01)
        return list(await asyncio.gather(*tasks))


async def _overhead(stack, tokenizer: Tokenizer, repeats: int = 12) -> dict:
    """TTFT through the coordinator (non-streamed, max_tokens=1) vs a direct Prefill call."""
    messages = [{"role": "user", "content": "Say hello."}]
    ids = tokenizer.encode(tokenizer.apply_chat_template(messages))
    health = httpx.get(f"{stack.url}/ready", timeout=10).json()
    prefill_addr = next(
        w["address"] for w in health["workers"].values() if w["role"] in ("prefill", "both")
    )
    via, direct = [], []
    async with httpx.AsyncClient() as client, stack.internal_auth.channel(prefill_addr) as channel:
        stub = pb_grpc.WorkerStub(channel)
        params = params_to_proto(SamplingParams(temperature=0.0, max_tokens=1))
        for r in range(repeats):
            t = time.perf_counter()
            resp = await client.post(
                f"{stack.base_url}/chat/completions",
                json={
                    "model": DEFAULT_MODEL_ID,
                    "messages": messages,
                    "max_tokens": 1,
                    "temperature": 0,
                },
                timeout=60,
            )
            resp.raise_for_status()
            via.append((time.perf_counter() - t) * 1e3)
            t = time.perf_counter()
            call = stub.Prefill(
                pb.PrefillRequest(
                    generation=pb.Generation(
                        request_id=f"direct-{r}",
                        model=DEFAULT_MODEL_ID,
                        prompt_token_ids=ids,
                        sampling=params,
                    )
                )
            )
            await call.read()  # the first token
            direct.append((time.perf_counter() - t) * 1e3)
            while await call.read() is not grpc.aio.EOF:  # then the (skipped) push's outcome
                pass
    return {
        "ttft_via_coordinator_p50_ms": percentile(via, 0.5),
        "ttft_direct_worker_p50_ms": percentile(direct, 0.5),
        "coordinator_overhead_ms_p50": percentile(via, 0.5) - percentile(direct, 0.5),
    }


def run(
    weights: str = "auto",
    duration_s: float = 60.0,
    short_every_s: float = 1.0,
    long_every_s: float = 12.0,
    reply_tokens: int = 128,
    long_words: int = 2300,
) -> dict:
    tokenizer = Tokenizer.from_gguf(default_model_path())
    result: dict = {
        "weights": weights,
        "duration_s": duration_s,
        "short_every_s": short_every_s,
        "long_every_s": long_every_s,
        "reply_tokens": reply_tokens,
        "long_prompt_tokens": len(tokenizer.encode(filler_text(long_words, 5000))),
    }
    for mode in ("colocated", "disagg"):
        with start_local_stack(
            parse_config(_config(mode, weights)), startup_timeout_s=300
        ) as stack:
            timings = asyncio.run(
                _drive(
                    stack.base_url,
                    duration_s,
                    short_every_s,
                    long_every_s,
                    reply_tokens,
                    long_words,
                )
            )
            summary = summarize(timings)
            result.setdefault("samples", {})[mode] = timing_samples(timings)
            summary["short"] = summarize(timings, "short")
            summary["long"] = summarize(timings, "long")
            summary.update(asyncio.run(_overhead(stack, tokenizer)))
            result[mode] = summary
    c, d = result["colocated"], result["disagg"]
    result["itl_p99_ratio"] = (
        (d["itl_p99_ms"] / c["itl_p99_ms"]) if c["itl_p99_ms"] and d["itl_p99_ms"] else None
    )
    result["coordinator_overhead_ms_p50"] = d["coordinator_overhead_ms_p50"]
    return result


def table_rows(r: dict) -> list[tuple[str, object, object, object]]:
    c, d = r["colocated"], r["disagg"]
    rows = []
    for key in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "requests", "errors"):
        ratio = d[key] / c[key] if isinstance(d[key], float) and c[key] else None
        rows.append((f"{key} (disagg vs colocated)", d[key], c[key], ratio))
    rows.append(("coordinator overhead p50 (ms)", r["coordinator_overhead_ms_p50"], 3.0, None))
    return rows
