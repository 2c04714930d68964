"""Fallback across models on a TTFT deadline or an early failure, through the HTTP layer."""

from __future__ import annotations

import pytest

from services.coordinator.generation_backend import BackendError, BackendUnavailable
from services.coordinator.settings import APISettings
from tests.unit.coordinator_client import chat_body, meta, run_with_client, sse_events
from tests.unit.scripted_backend import Script, ScriptedTestBackend

SLOW, FAST, SPARE = "slow-model", "fast-model", "spare-model"


def _backend(tokenizer, **scripts: Script) -> ScriptedTestBackend:
    return ScriptedTestBackend(tokenizer, {k.replace("_", "-"): v for k, v in scripts.items()})


def _post(backend, body, settings=None):
    settings = settings or APISettings(model_id=backend.models()[0].id)

    async def work(client):
        return await client.post("/v1/chat/completions", json=body)

    return run_with_client(backend, settings, work)


def test_missed_ttft_deadline_falls_back_and_lists_attempts(real_tokenizer):
    backend = _backend(
        real_tokenizer,
        slow_model=Script(first_token_delay_s=5.0, replica="slow-r"),
        fast_model=Script(replica="fast-r"),
    )
    body = chat_body(model=SLOW, models=[FAST], fallback={"ttft_timeout": 100})
    response = _post(backend, body)
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["model"] == FAST
    assert data["choices"][0]["message"]["content"] == "t0 t1 t2 "
    attempts = meta(data, "attempts")
    assert [a["model"] for a in attempts] == [SLOW, FAST]
    assert attempts[0]["success"] is False and "100 ms" in attempts[0]["error"]
    assert attempts[0]["ttft_ms"] is None
    assert attempts[1]["success"] is True and attempts[1]["replica"] == "fast-r"
    assert attempts[1]["ttft_ms"] is not None  # its first token arrived and was recorded
    # The slow attempt was cancelled (its stream closed), not left running.
    assert backend.calls_for(SLOW)[0].closed_early
    reasoning = meta(data, "reasoning")
    assert any("missed the 100 ms TTFT deadline" in r for r in reasoning)
    assert any("fast-r picked for fast-model" in r for r in reasoning)


@pytest.mark.parametrize(
    "error", [BackendError("transfer failed"), BackendUnavailable("no replica")]
)
def test_failure_before_first_token_falls_back(real_tokenizer, error):
    backend = _backend(real_tokenizer, slow_model=Script(fail=error), fast_model=Script())
    response = _post(backend, chat_body(models=[SLOW, FAST]))
    assert response.status_code == 200, response.text
    attempts = meta(response.json(), "attempts")
    assert [(a["model"], a["success"]) for a in attempts] == [(SLOW, False), (FAST, True)]
    assert type(error).__name__ in attempts[0]["error"]


def test_last_model_is_waited_for_and_its_failure_is_the_answer(real_tokenizer):
    backend = _backend(
        real_tokenizer,
        slow_model=Script(first_token_delay_s=5.0),
        fast_model=Script(first_token_delay_s=0.3, fail=BackendError("decode died")),
    )
    body = chat_body(models=[SLOW, FAST], fallback={"ttft_timeout": 50})
    response = _post(backend, body)
    assert response.status_code == 502
    assert "decode died" in response.json()["error"]["message"]


def test_last_model_gets_no_deadline(real_tokenizer):
    backend = _backend(
        real_tokenizer,
        slow_model=Script(first_token_delay_s=5.0),
        fast_model=Script(first_token_delay_s=0.3),
    )
    body = chat_body(models=[SLOW, FAST], fallback={"ttft_timeout": 50})
    response = _post(backend, body)
    assert response.status_code == 200
    attempts = meta(response.json(), "attempts")
    # Its first token came after the 50 ms deadline, yet it was kept: the last model has none.
    assert [a["success"] for a in attempts] == [False, True]
    assert attempts[1]["ttft_ms"] is not None
    assert response.json()["choices"][0]["message"]["content"] == "t0 t1 t2 "


def test_no_fallback_after_the_first_token(real_tokenizer):
    # A model that starts in time but streams slowly is kept: the deadline is for TTFT only.
    backend = _backend(
        real_tokenizer,
        slow_model=Script(token_delay_s=0.2, num_tokens=3),
        fast_model=Script(),
    )
    body = chat_body(models=[SLOW, FAST], fallback={"ttft_timeout": 100})
    response = _post(backend, body)
    assert response.json()["model"] == SLOW
    assert backend.calls_for(FAST) == []
    assert [a["model"] for a in meta(response.json(), "attempts")] == [SLOW]


def test_streaming_carries_attempts_in_first_and_last_chunk(real_tokenizer):
    backend = _backend(
        real_tokenizer, slow_model=Script(first_token_delay_s=5.0), fast_model=Script()
    )
    body = chat_body(
        models=[SLOW, FAST],
        fallback={"ttft_timeout": 80},
        stream=True,
        stream_options={"include_usage": True},
    )
    response = _post(backend, body)
    events = sse_events(response.text)
    first, last_choice = events[0], [e for e in events if e["choices"]][-1]
    for event in (first, last_choice, events[-1]):
        attempts = meta(event, "attempts")
        assert [a["model"] for a in attempts] == [SLOW, FAST]
        assert meta(event, "reasoning")
    assert first["model"] == FAST
    # The middle chunks stay lean.
    assert all("metadata" not in e for e in events[1:-2])


def test_single_model_still_reports_attempts_and_reasoning(real_tokenizer):
    backend = _backend(real_tokenizer, fast_model=Script(replica="r9"))
    response = _post(backend, chat_body())
    data = response.json()
    assert meta(data, "attempts") == [
        {
            "model": FAST,
            "reason": "first",
            "after_tokens": 0,
            "replica": "r9",
            "ttft_ms": meta(data, "attempts")[0]["ttft_ms"],
            "success": True,
            "error": None,
        }
    ]
    assert meta(data, "reasoning") == ["fast-model: r9 picked for fast-model"]


@pytest.mark.parametrize("timeout", [0, -5])
def test_non_positive_ttft_timeout_is_a_400(real_tokenizer, timeout):
    backend = _backend(real_tokenizer, fast_model=Script())
    response = _post(backend, chat_body(models=[FAST], fallback={"ttft_timeout": timeout}))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "fallback.ttft_timeout"
    assert "positive" in error["message"]


def test_unknown_fallback_model_is_a_404_naming_it(real_tokenizer):
    backend = _backend(real_tokenizer, fast_model=Script())
    response = _post(backend, chat_body(models=[FAST, "nope"]))
    assert response.status_code == 404
    assert "'nope'" in response.json()["error"]["message"]
    assert backend.calls == []


def test_completions_fall_back_too_and_each_choice_is_served(real_tokenizer):
    backend = _backend(
        real_tokenizer, slow_model=Script(first_token_delay_s=5.0), fast_model=Script()
    )
    body = {
        "model": SLOW,
        "models": [SLOW, FAST],
        "fallback": {"ttft_timeout": 80},
        "prompt": "Once upon a time",
        "max_tokens": 3,
        "n": 2,
    }

    async def work(client):
        return await client.post("/v1/completions", json=body)

    response = run_with_client(backend, APISettings(model_id=SLOW), work)
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["model"] == FAST
    assert [c["text"] for c in data["choices"]] == ["t0 t1 t2 "] * 2
    assert len(backend.calls_for(SLOW)) == 2 and all(
        c.closed_early for c in backend.calls_for(SLOW)
    )
    assert [a["model"] for a in meta(data, "attempts")] == [SLOW, FAST]


def test_metrics_count_the_attempt_that_served(real_tokenizer):
    backend = _backend(
        real_tokenizer, slow_model=Script(fail=BackendError("x")), fast_model=Script()
    )

    async def work(client):
        await client.post("/v1/chat/completions", json=chat_body(models=[SLOW, FAST]))
        return (await client.get("/metrics")).text

    text = run_with_client(backend, APISettings(model_id=SLOW), work)
    served = [
        line
        for line in text.splitlines()
        if line.startswith("splitserve_request_outcomes_total{") and 'attempt="2"' in line
    ]
    assert served and served[0].endswith(" 1.0")
