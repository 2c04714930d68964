"""Fallback through the real stack: one replica stalls its first token (fault injection, a
test-only knob), the coordinator cancels it at the TTFT deadline and the next model answers;
and when that model's replica then dies mid-stream, the same retry loop migrates the stream
to its other replica (the last test: it kills one)."""

from __future__ import annotations

import json
import signal

import httpx
import pytest

from services.launcher import start_local_stack
from services.launcher.presets import LOOPBACK_COORDINATOR
from shared.config.schema import parse_config

pytestmark = pytest.mark.real_model

SLOW, FAST = "smol-stalled", "smol-healthy"
STALL_MS = 20_000  # far past the deadline: only a cancelled attempt can answer in time
DEADLINE_MS = 1500


def _model(model_id: str, stall_ms: int, replicas: int = 1) -> dict:
    return {
        "id": model_id,
        "weights": "fp32",
        "pools": {"prefill": 0, "decode": 0, "both": replicas},
        "worker": {
            "kv_cache_bytes": 64 << 20,
            "host_cache_bytes": 0,
            "threads": 1,
            "fault_injection": {"first_token_delay_ms": stall_ms},
        },
    }


@pytest.fixture(scope="module")
def stack():
    config = {
        "coordinator": dict(LOOPBACK_COORDINATOR),
        "transfer": {"backend": "shm"},
        "models": [_model(SLOW, STALL_MS), _model(FAST, 0, replicas=2)],
        "routers": {
            "resilient": {"models": [SLOW, FAST], "fallback": {"ttft_timeout": DEADLINE_MS}}
        },
    }
    with start_local_stack(parse_config(config), startup_timeout_s=240) as running:
        yield running


def _body(**extra) -> dict:
    return {
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 8,
        "temperature": 0,
        **extra,
    }


def test_stalled_model_is_cancelled_and_the_next_one_answers(stack):
    body = _body(model="router/resilient", stream=True, stream_options={"include_usage": True})
    events = []
    with httpx.stream("POST", f"{stack.base_url}/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: ") :]))
    first, last = events[0], events[-1]
    for event in (first, last):
        attempts = json.loads(event["metadata"]["attempts"])
        assert [(a["model"], a["success"]) for a in attempts] == [(SLOW, False), (FAST, True)]
        assert f"{DEADLINE_MS} ms" in attempts[0]["error"]
        assert attempts[1]["replica"] and attempts[1]["ttft_ms"] is not None
        reasoning = json.loads(event["metadata"]["reasoning"])
        assert any("missed the 1500 ms TTFT deadline" in line for line in reasoning)
    assert first["model"] == FAST
    assert json.loads(last["metadata"]["cost"])["total_usd"] > 0
    text = "".join(c["delta"].get("content") or "" for e in events for c in e.get("choices", []))
    assert text


def test_request_level_models_list_falls_back_without_a_saved_router(stack):
    response = httpx.post(
        f"{stack.base_url}/chat/completions",
        json=_body(models=[SLOW, FAST], fallback={"ttft_timeout": DEADLINE_MS}),
        timeout=60,
    )
    assert response.status_code == 200
    data = response.json()
    assert data["model"] == FAST
    assert data["service_tier"] == "default"
    attempts = json.loads(data["metadata"]["attempts"])
    assert attempts[0]["model"] == SLOW and not attempts[0]["success"]


def _stream(stack, body: dict, kill_after_tokens: int | None = None) -> tuple[list[dict], str]:
    """Streams `body`; after `kill_after_tokens` content chunks, SIGKILLs the replica the
    first chunk's metadata named. Returns (events, that replica's worker id)."""
    events, victim, seen = [], "", 0
    with httpx.stream("POST", f"{stack.base_url}/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            events.append(event)
            if not victim and event.get("metadata", {}).get("replica"):
                victim = event["metadata"]["replica"].split("->")[-1]
            if any(c["delta"].get("content") for c in event.get("choices", [])):
                seen += 1
                if seen == kill_after_tokens:
                    # Worker ids end with the process id: the launcher's process of the replica.
                    (name,) = [
                        n for n, p in stack.processes.items() if victim.endswith(f"-{p.pid}")
                    ]
                    stack.processes[name].kill(signal.SIGKILL)
    return events, victim


def test_fallback_on_the_deadline_then_migration_after_a_replica_dies(stack):
    """One loop, three attempts: the stalled model misses its deadline, the next model's
    replica is killed mid-stream, its other replica carries the stream on to the end."""
    story = {"messages": [{"role": "user", "content": "Tell a long story about a fox."}]}
    common = {**story, "max_tokens": 48, "temperature": 0, "ignore_eos": True, "stream": True}
    baseline, _ = _stream(stack, {**common, "model": FAST})
    events, victim = _stream(stack, {**common, "model": "router/resilient"}, kill_after_tokens=6)
    assert not [e for e in events if "error" in e]
    assert _content(events) == _content(baseline)  # greedy: the moves changed nothing
    attempts = json.loads(events[-1]["metadata"]["attempts"])
    assert [(a["model"], a["reason"], a["success"]) for a in attempts] == [
        (SLOW, "first", False),
        (FAST, "fallback", False),
        (FAST, "migration", True),
    ]
    stalled, lost, moved = attempts
    assert f"{DEADLINE_MS} ms" in stalled["error"]
    assert lost["replica"] == victim and victim in lost["error"]
    assert moved["replica"] not in (None, victim) and moved["after_tokens"] >= 6
    reasoning = json.loads(events[-1]["metadata"]["reasoning"])
    assert any("missed the 1500 ms TTFT deadline" in line for line in reasoning)
    assert any(line.startswith("migration: ") for line in reasoning)
    assert events[0]["model"] == FAST


def _content(events: list[dict]) -> str:
    return "".join(c["delta"].get("content") or "" for e in events for c in e.get("choices", []))
