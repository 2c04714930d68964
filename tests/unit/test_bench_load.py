"""The benchmarks' streaming client against the real coordinator app (scripted backend):
tokens are counted per endpoint and a failed request is recorded, not raised."""

from __future__ import annotations

from services.coordinator.generation_backend import BackendError
from services.coordinator.settings import APISettings
from tests.unit.coordinator_client import chat_body, run_with_client
from tests.unit.scripted_backend import Script, ScriptedTestBackend
from tools.bench.load import completion_token, stream_timing

MODEL = "m"


def _run(real_tokenizer, script: Script, path: str, body: dict, **kwargs):
    backend = ScriptedTestBackend(real_tokenizer, {MODEL: script})

    async def work(client):
        return await stream_timing(client, path, {**body, "stream": True}, "test", **kwargs)

    return run_with_client(backend, APISettings(model_id=MODEL), work)


def test_chat_and_completion_streams_are_timed_token_by_token(real_tokenizer):
    chat = _run(real_tokenizer, Script(num_tokens=3), "/v1/chat/completions", chat_body())
    assert chat.error is None and chat.tokens == 3
    assert chat.ttft_ms is not None and len(chat.itl_ms) == 2
    completion = _run(
        real_tokenizer,
        Script(num_tokens=4),
        "/v1/completions",
        {"prompt": "hello", "max_tokens": 4},
        is_token=completion_token,
    )
    assert completion.error is None and completion.tokens == 4


def test_a_failed_request_is_recorded_as_its_error(real_tokenizer):
    failed = _run(
        real_tokenizer,
        Script(fail=BackendError("decode died")),
        "/v1/chat/completions",
        chat_body(),
    )
    assert failed.tokens == 0 and failed.ttft_ms is None
    assert failed.error.startswith("HTTP 502") and "decode died" in failed.error
