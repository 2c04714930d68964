"""Killing a decode process mid-stream: the client's stream ends with a clear error, the
coordinator marks the replica dead, and later requests succeed on the other replica."""

from __future__ import annotations

import json
import signal
import time

import httpx
import pytest

from services.launcher import start_local_stack
from shared.config.schema import parse_config
from shared.model.loader import DEFAULT_MODEL_ID
from tests.integration.test_local_stack import stack_config

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def stack():
    cfg = parse_config(stack_config(prefill=1, decode=2))
    with start_local_stack(cfg, startup_timeout_s=240) as running:
        yield running


def _stream(base_url: str, max_tokens: int):
    body = {
        "model": DEFAULT_MODEL_ID,
        "messages": [{"role": "user", "content": "Write a long story about the sea."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    return httpx.stream("POST", f"{base_url}/chat/completions", json=body, timeout=60)


def test_decode_killed_mid_stream(stack):
    events = []
    victim = None
    with _stream(stack.base_url, 200) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            payload = line.removeprefix("data: ")
            events.append(payload)
            if payload == "[DONE]":
                break
            data = json.loads(payload)
            if victim is None and "metadata" in data:
                victim = data["metadata"]["replica"].split("->")[-1]
            if len(events) == 5:
                name = next(
                    n for n, p in stack.processes.items() if victim and _serves(n, p, victim)
                )
                stack.processes[name].kill(signal.SIGKILL)
    errors = [json.loads(e) for e in events if e != "[DONE]" and "error" in json.loads(e)]
    assert errors, "the stream must end with an error event"
    assert "replica" in errors[-1]["error"]["message"]
    assert events[-1] == "[DONE]"
    # The coordinator now routes around the dead replica.
    deadline = time.monotonic() + 10
    health = {}
    while time.monotonic() < deadline:
        health = httpx.get(f"{stack.url}/ready", timeout=10).json()
        if not health["workers"][victim]["alive"]:
            break
        time.sleep(0.2)
    assert health["workers"][victim]["alive"] is False
    for _ in range(3):
        r = httpx.post(
            f"{stack.base_url}/chat/completions",
            json={
                "model": DEFAULT_MODEL_ID,
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 4,
            },
            timeout=60,
        )
        assert r.status_code == 200, r.text
        assert victim not in r.json()["metadata"]["replica"]


def _serves(name: str, process, worker_id: str) -> bool:
    """Worker ids end with the process id: match the launcher's process to the replica."""
    return worker_id.endswith(f"-{process.pid}")
