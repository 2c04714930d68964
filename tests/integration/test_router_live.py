"""Conditional disaggregation on a real stack: the second turn of a conversation, whose prompt
the decode replica already holds but for a short tail, is prefilled by that decode replica
itself (no prefill replica, no transfer) and gives the same greedy text as one process."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from engine.core.config import EngineConfig
from engine.core.engine import Engine
from services.launcher import start_local_stack
from shared.config.schema import parse_config
from shared.modelfile.default import DEFAULT_MODEL_ID
from shared.sampling.params import SamplingParams

pytestmark = pytest.mark.real_model


def greedy(real_model, prompt: list[int], max_tokens: int) -> list[int]:
    # auto: the KV dtype the stack's workers take on this machine.
    config = EngineConfig(num_blocks=64, kv_cache_dtype="auto", num_threads=1)  # as a worker
    engine = Engine(config, model=real_model)
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return [t for o in engine.run_until_done() for t in o.new_token_ids]


def reasons(routing: str | list[str]) -> str:
    """metadata values are strings (OpenAI's metadata shape): the list arrives JSON-encoded."""
    return "\n".join(json.loads(routing) if isinstance(routing, str) else routing)


def complete(client: httpx.Client, prompt: list[int], max_tokens: int) -> dict:
    resp = client.post(
        "/completions",
        json={
            "model": DEFAULT_MODEL_ID,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        },
        timeout=120,
    )
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_short_tail_is_prefilled_on_the_decode_replica(real_model, real_tokenizer):
    config = parse_config(
        {
            "coordinator": {
                "port": 0,
                "registry_port": 0,
                "heartbeat_interval_s": 0.3,
                "heartbeat_timeout_s": 3.0,
            },
            "transfer": {"backend": "shm"},
            "models": [
                {
                    "id": DEFAULT_MODEL_ID,
                    "weights": "fp32",
                    "pools": {"prefill": 1, "decode": 1},
                    "worker": {"kv_cache_bytes": 64 << 20, "host_cache_bytes": 0, "threads": 1},
                }
            ],
            "router": {"local_prefill_max_tokens": 64},
        }
    )
    text = "The quick brown fox jumps over the lazy dog. " * 8
    turn1 = real_tokenizer.encode(text)[:96]
    with start_local_stack(config, startup_timeout_s=240) as stack:
        with httpx.Client(base_url=stack.base_url) as client:
            first = complete(client, turn1, 4)
            assert "->" in first["metadata"]["replica"]  # nothing cached: disaggregated
            turn2 = turn1 + real_tokenizer.encode(" And then the dog slept.")
            deadline = time.monotonic() + 10
            while True:  # the decode replica's KV events reach the router with its heartbeat
                second = complete(client, turn2, 6)
                routing = reasons(second["metadata"]["routing"])
                if "local prefill" in routing or time.monotonic() > deadline:
                    break
                time.sleep(0.3)
    assert "local prefill" in routing, routing
    assert "->" not in second["metadata"]["replica"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 80
    expected = real_tokenizer.decode(greedy(real_model, turn2, 6))
    assert second["choices"][0]["text"] == expected
