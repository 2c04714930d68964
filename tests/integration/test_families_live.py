"""Every family on a real loopback stack: one coordinator serving the tiny model of each
family, each with its own prefill and decode worker processes. A first turn runs prefill ->
KV transfer -> decode and replies with transformers' greedy tokens; the next turn, whose
prompt the decode replica holds but for a short tail, is prefilled there (no transfer),
reports the cached prefix, and replies with transformers' greedy tokens again."""

from __future__ import annotations

import json
import random
import time

import httpx
import pytest

from engine.model.tiny_families import (
    FAMILIES,
    VOCAB,
    char_token_ids,
    reference_greedy,
    save_char_tokenizer,
    save_family,
)
from services.launcher import start_local_stack
from shared.config.schema import parse_config

pytest.importorskip("transformers")

MAX_TOKENS = 8
PROMPT_TOKENS = 45  # past the 12-token window, not a whole number of 16-token blocks


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(stack, family -> transformers reference): one stack, every family a model of it."""
    references, models = {}, []
    for name in FAMILIES:
        folder = tmp_path_factory.mktemp(name)
        references[name] = save_family(name, folder)
        save_char_tokenizer(folder)
        models.append(
            {
                "id": name,
                "path": str(folder),
                "weights": "fp32",
                "pools": {"prefill": 1, "decode": 1},
                "worker": {
                    "kv_cache_bytes": 8 << 20,
                    "kv_cache_dtype": "float32",  # the reference's precision
                    "host_cache_bytes": 0,
                    "threads": 1,
                },
            }
        )
    config = parse_config(
        {
            "coordinator": {
                "port": 0,
                "registry_port": 0,
                "heartbeat_interval_s": 0.3,
                # Sixteen workers on two loaded cores: a starved minute must not read as
                # every replica gone (this test is about serving, not failure detection).
                "heartbeat_timeout_s": 60.0,
            },
            "transfer": {"backend": "shm"},
            "models": models,
            "router": {"local_prefill_max_tokens": 64},
        }
    )
    with start_local_stack(config, startup_timeout_s=300) as stack:
        yield stack, references


def _complete(client: httpx.Client, model: str, prompt: list[int]) -> tuple[dict, list[int]]:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    resp = client.post("/completions", json=body | {"ignore_eos": True}, timeout=120)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    return out, char_token_ids(out["choices"][0]["text"])


def _routing(out: dict) -> str:
    routing = out["metadata"]["routing"]
    return "\n".join(json.loads(routing) if isinstance(routing, str) else routing)


@pytest.mark.parametrize("name", FAMILIES)
def test_disaggregated_turns_equal_transformers(served, name):
    stack, references = served
    reference = references[name]
    rng = random.Random(FAMILIES.index(name))
    turn1 = [rng.randrange(3, VOCAB) for _ in range(PROMPT_TOKENS)]
    with httpx.Client(base_url=stack.base_url) as client:
        first, reply = _complete(client, name, turn1)
        assert "->" in first["metadata"]["replica"]  # prefill replica -> decode replica
        assert reply == reference_greedy(reference, turn1, MAX_TOKENS)
        turn2 = turn1 + reply + [7, 8, 9]
        deadline = time.monotonic() + 30
        while True:  # the decode replica's KV events reach the router with its heartbeat
            second, reply2 = _complete(client, name, turn2)
            if "local prefill" in _routing(second) or time.monotonic() > deadline:
                break
            time.sleep(0.3)
    assert "local prefill" in _routing(second), _routing(second)
    assert "->" not in second["metadata"]["replica"]
    # What the decode replica holds: the pushed prompt and its own reply, in whole blocks.
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == (len(turn1) + MAX_TOKENS - 1) // 16 * 16
    assert reply2 == reference_greedy(reference, turn2, MAX_TOKENS)
