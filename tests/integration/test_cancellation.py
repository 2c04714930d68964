"""Clients that go away cancel their work on every service: a disconnect during the prefill
of a long prompt and one in the middle of decoding both leave every worker idle with the
free blocks it started with — promptly, not after a transfer deadline or a parked-KV TTL —
and the stack keeps serving."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from services.launcher import start_local_stack
from shared.config.schema import parse_config
from shared.modelfile.default import DEFAULT_MODEL_ID
from shared.proto_gen import worker_pb2 as pb
from shared.proto_gen import worker_pb2_grpc as pb_grpc
from tests.integration.test_local_stack import stack_config

pytestmark = pytest.mark.real_model

# Well under the transfer deadline (10 s) and the parked-KV TTL (30 s): only an active
# cancellation frees the blocks this fast.
SETTLE_S = 5.0
# The mid-decode request ignores EOS and may run this long (minutes on this CPU): it cannot
# end by itself while the test watches, so only the abort can settle the workers.
LONG = 1000


@pytest.fixture(scope="module")
def stack():
    cfg = parse_config(stack_config(prefill=1, decode=1))
    with start_local_stack(cfg, startup_timeout_s=240) as running:
        yield running


def _workers(stack) -> dict[str, str]:
    health = httpx.get(f"{stack.url}/ready", timeout=10).json()
    return {wid: w["address"] for wid, w in health["workers"].items() if w["alive"]}


def _stats(stack, address: str) -> dict:
    with stack.internal_auth.sync_channel(address) as channel:
        return json.loads(pb_grpc.WorkerStub(channel).Stats(pb.StatsRequest(), timeout=5).json)


def _body(content: str, max_tokens: int, **extra) -> dict:
    return {
        "model": DEFAULT_MODEL_ID,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        **extra,
    }


def _wait_settled(stack, workers: dict[str, str], start: dict[str, int]) -> dict[str, dict]:
    deadline = time.monotonic() + SETTLE_S
    while True:
        stats = {wid: _stats(stack, addr) for wid, addr in workers.items()}
        if all(_idle(s, start[wid]) for wid, s in stats.items()):
            return stats
        if time.monotonic() > deadline:
            pytest.fail(f"workers did not settle within {SETTLE_S}s: {stats}")
        time.sleep(0.1)


def _idle(s: dict, free_at_start: int) -> bool:
    load = s["load"]
    return (
        load["running"] == 0
        and load["waiting"] == 0
        and s["parked_kv"] == 0
        and load["free_blocks"] == free_at_start
    )


async def _leave_during_prefill(stack, prefill_address: str) -> dict:
    """Start a long-prompt stream, wait until the prefill replica is busy with it, leave."""
    # Distinct text: a prefix-cache hit would make the prefill too short to catch.
    words = " ".join(f"item{i}" for i in range(250))
    async with httpx.AsyncClient(timeout=60) as client:

        async def run() -> None:
            async with client.stream(
                "POST", f"{stack.base_url}/chat/completions", json=_body(words, 20)
            ) as resp:
                assert resp.status_code == 200, await resp.aread()
                async for _ in resp.aiter_lines():
                    pass

        task = asyncio.create_task(run())
        busy = {}
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not task.done():
            busy = await asyncio.to_thread(_stats, stack, prefill_address)
            if busy["load"]["running"] or busy["load"]["waiting"]:
                break
            await asyncio.sleep(0.02)
        if task.done():
            task.result()  # a request that failed surfaces here
        task.cancel()  # closes the connection: the client is gone
        await asyncio.gather(task, return_exceptions=True)
    return busy


def test_disconnects_free_every_workers_blocks(stack):
    workers = _workers(stack)
    start = {wid: _stats(stack, addr)["load"]["free_blocks"] for wid, addr in workers.items()}
    (prefill_address,) = [a for wid, a in workers.items() if "-prefill-" in wid]

    busy = asyncio.run(_leave_during_prefill(stack, prefill_address))
    assert busy["load"]["running"] or busy["load"]["waiting"], "never caught the prefill busy"
    _wait_settled(stack, workers, start)

    (decode_address,) = [a for wid, a in workers.items() if "-decode-" in wid]
    before = _stats(stack, decode_address)
    with httpx.stream(
        "POST",
        f"{stack.base_url}/chat/completions",
        json=_body("Write a long story about the sea.", LONG, ignore_eos=True),
        timeout=60,
    ) as resp:
        chunks = 0
        for line in resp.iter_lines():
            chunks += line.startswith("data: ")
            if chunks == 5:
                break  # leaving the block closes the connection mid-decode
    assert chunks == 5
    stats = _wait_settled(stack, workers, start)
    # The abort itself: the decode engine counted it, stopped long before the request's
    # budget, and steps no more.
    decode = stats[next(w for w, a in workers.items() if a == decode_address)]
    assert decode["aborted"] == before["aborted"] + 1
    assert decode["steps"] - before["steps"] < LONG // 2
    time.sleep(0.5)
    assert _stats(stack, decode_address)["steps"] == decode["steps"]

    # Nothing hangs: the stack still serves, and is idle again afterwards.
    r = httpx.post(
        f"{stack.base_url}/chat/completions",
        json={**_body("Hi", 4), "stream": False},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    _wait_settled(stack, workers, start)
