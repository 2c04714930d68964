"""`kill -9` of the decode process serving a stream: the coordinator migrates the request to
the other decode replica and the client's stream goes on as if nothing happened — at
temperature 0 the whole text equals an uninterrupted reply, and a structured (JSON-schema)
reply stays valid: the new replica rebuilds the grammar state from the tokens already
streamed. With no replica left to move to, the stream ends with a clear error event."""

from __future__ import annotations

import json
import signal

import httpx
import jsonschema
import pytest

from services.launcher import start_local_stack
from shared.config.schema import parse_config
from shared.modelfile.default import DEFAULT_MODEL_ID
from tests.integration.test_local_stack import stack_config

pytestmark = pytest.mark.real_model

MAX_TOKENS = 60


@pytest.fixture(scope="module")
def stack():
    # Three decode replicas: the structured test and the plain one each kill one (and migrate
    # to another), the last test kills the one left. Unsupervised: a victim stays dead.
    cfg = parse_config(stack_config(prefill=1, decode=3))
    with start_local_stack(cfg, startup_timeout_s=240, supervise=False) as running:
        yield running


SCHEMA = {
    "type": "object",
    "properties": {
        "facts": {
            "type": "array",
            "items": {"type": "string", "maxLength": 40},
            "minItems": 2,
            "maxItems": 3,
        }
    },
    "required": ["facts"],
    "additionalProperties": False,
}


def _body(content: str, response_format: dict | None = None) -> dict:
    body = {
        "model": DEFAULT_MODEL_ID,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if response_format is not None:
        body["response_format"] = response_format
    return body


def _stream_killing(
    stack, content: str, kill_after_tokens: int | None, response_format: dict | None = None
):
    """Stream a reply; after `kill_after_tokens` content chunks, SIGKILL the decode process
    the first chunk's metadata named. Returns (events, victim worker id)."""
    events, victim, seen = [], None, 0
    body = _body(content, response_format)
    with httpx.stream("POST", f"{stack.base_url}/chat/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            payload = line.removeprefix("data: ")
            if payload == "[DONE]":
                break
            data = json.loads(payload)
            events.append(data)
            if victim is None and data.get("metadata", {}).get("replica"):
                victim = data["metadata"]["replica"].split("->")[-1]
            if any(c["delta"].get("content") for c in data.get("choices", [])):
                seen += 1
            if kill_after_tokens is not None and seen == kill_after_tokens:
                _kill(stack, victim)
    return events, victim


def _kill(stack, worker_id: str) -> None:
    # Worker ids end with the process id: match the launcher's process to the replica.
    (name,) = [n for n, p in stack.processes.items() if worker_id.endswith(f"-{p.pid}")]
    stack.processes[name].kill(signal.SIGKILL)


def _text(events: list[dict]) -> str:
    return "".join(c["delta"].get("content") or "" for e in events for c in e.get("choices", []))


def _attempt_reasons(events: list[dict]) -> list[str]:
    finals = [e for e in events if e.get("choices") and e["choices"][0].get("finish_reason")]
    return [a["reason"] for a in json.loads(finals[-1]["metadata"]["attempts"])]


def test_kill_decode_mid_structured_stream_keeps_the_json_valid(stack):
    prompt = "List facts about the moon as JSON."
    fmt = {"type": "json_schema", "json_schema": {"name": "facts", "schema": SCHEMA}}
    baseline, _ = _stream_killing(stack, prompt, None, fmt)
    events, _ = _stream_killing(stack, prompt, 5, fmt)
    assert not [e for e in events if "error" in e]
    assert _attempt_reasons(events) == ["first", "migration"]
    assert _text(events) == _text(baseline)
    jsonschema.validate(json.loads(_text(events)), SCHEMA)


def test_kill_decode_mid_stream_migrates_and_text_is_unchanged(stack):
    prompt = "Write a long story about a lighthouse keeper and the sea."
    baseline, _ = _stream_killing(stack, prompt, None)
    events, victim = _stream_killing(stack, prompt, 10)
    assert not [e for e in events if "error" in e]
    assert _text(events) == _text(baseline)
    finals = [e for e in events if e.get("choices") and e["choices"][0].get("finish_reason")]
    attempts = json.loads(finals[-1]["metadata"]["attempts"])
    assert [a["reason"] for a in attempts] == ["first", "migration"]
    lost, moved = attempts
    assert lost["replica"].endswith(victim) and victim in lost["error"] and not lost["success"]
    assert victim not in moved["replica"] and moved["success"]
    assert moved["after_tokens"] >= 10
    usage = next(e["usage"] for e in reversed(events) if e.get("usage"))
    base_usage = next(e["usage"] for e in reversed(baseline) if e.get("usage"))
    assert usage["prompt_tokens"] == base_usage["prompt_tokens"]
    assert usage["completion_tokens"] == base_usage["completion_tokens"]
    # The coordinator marked the dead replica and routes around it from now on.
    health = httpx.get(f"{stack.url}/ready", timeout=10).json()
    assert health["workers"][victim]["alive"] is False


def test_no_decode_left_ends_with_a_clear_error(stack):
    # Runs after the first test killed one decode replica: this kill leaves none.
    events, _ = _stream_killing(stack, "Tell me everything about the moon.", 5)
    errors = [e["error"] for e in events if "error" in e]
    assert errors, "the stream must end with an error event"
    assert "giving up" in errors[-1]["message"]
