"""Bad requests and backend failures get OpenAI-shaped errors, and the server keeps serving.

Each case checks the status, `error.type`, `error.param` (spelled as the client sent it) and
`error.code`, then sends a good request that must succeed. Backend failures (no replica, a
worker dying mid-stream) are injected by a thin wrapper around the real engine backend.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections import Counter

import httpx
import openai
import pytest

from engine.core.config import EngineConfig
from engine.core.engine import Engine
from services.coordinator.api.app import create_app
from services.coordinator.api.server import ServerThread
from services.coordinator.generation_backend import (
    BackendError,
    BackendUnavailable,
    GenerationRequest,
)
from services.coordinator.settings import APISettings
from shared.modelfile.default import DEFAULT_MODEL_ID
from tools.inprocess.engine_backend import EngineBackend

pytestmark = pytest.mark.real_model

MODEL = DEFAULT_MODEL_ID
KEY = "sk-test-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
CONTEXT = 256
SETTINGS = APISettings(
    model_id=MODEL,
    max_body_bytes=32 * 1024,
    max_tokens_limit=200,
    default_max_tokens=32,
    api_keys=(KEY,),
)
USER = [{"role": "user", "content": "Hi"}]


class ScriptedBackend:
    """The real engine backend, with failures on demand for the next request."""

    def __init__(self, inner: EngineBackend):
        self.inner = inner
        self.fail_next: str | None = None  # "unavailable" | "error" | "midstream"

    def models(self):
        return self.inner.models()

    async def health(self):
        return await self.inner.health()

    async def generate(self, req: GenerationRequest):
        mode, self.fail_next = self.fail_next, None
        if mode == "unavailable":
            raise BackendUnavailable("every decode replica is draining", retry_after_s=2.5)
        if mode == "error":
            raise BackendError("prefill replica p-0 crashed")
        async with contextlib.aclosing(self.inner.generate(req)) as stream:
            async for chunk in stream:
                yield chunk
                if mode == "midstream":
                    raise BackendError("decode replica d-1 went away")


def count_steps(engine: Engine) -> Counter[str]:
    """Engine steps per request id, counted on the engine thread as they happen."""
    steps: Counter[str] = Counter()

    def observe(batch, start_ns: int, end_ns: int) -> None:
        steps.update(item.seq.request_id for item in batch.scheduled)

    engine.step_observers.append(observe)
    return steps


@pytest.fixture(scope="module")
def served(real_model, real_tokenizer):
    config = EngineConfig(num_blocks=64, block_size=16, max_model_len=CONTEXT)
    engine = Engine(config, real_model, real_tokenizer)
    steps = count_steps(engine)
    inner = EngineBackend(engine, model_id=MODEL).start()
    backend = ScriptedBackend(inner)
    with ServerThread(create_app(backend, SETTINGS)) as server:
        yield server, engine, backend, steps
    inner.close()


@pytest.fixture(scope="module")
def http(served):
    with httpx.Client(base_url=served[0].url, headers=AUTH, timeout=60) as http:
        yield http


def _assert_error(response: httpx.Response, status: int, param: str | None, code: str | None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    expected_type = "server_error" if status >= 500 else "invalid_request_error"
    assert error["type"] == expected_type
    assert error["param"] == param, error
    assert error["code"] == code, error
    assert error["message"]
    return error


def _assert_still_serving(http: httpx.Client, engine: Engine) -> None:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1, "unknown_extension": {"x": 1}}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 1
    assert not engine.has_work


def _chat(**fields):
    return {"model": MODEL, "messages": USER, "max_tokens": 1, **fields}


def _completion(**fields):
    return {"model": MODEL, "prompt": "Hi", "max_tokens": 1, **fields}


LONG_TEXT = "word " * (CONTEXT + 10)

# (id, path, json body, status, param, code)
JSON_CASES = [
    ("max_tokens_string", "chat", _chat(max_tokens="5"), 400, "max_tokens", "invalid_type"),
    ("temperature_string", "chat", _chat(temperature="hot"), 400, "temperature", "invalid_type"),
    ("stream_string", "chat", _chat(stream="yes"), 400, "stream", "invalid_type"),
    ("seed_float", "completion", _completion(seed=1.5), 400, "seed", "invalid_type"),
    (
        "content_number",
        "chat",
        _chat(messages=[{"role": "user", "content": 5}]),
        400,
        "messages[0].content",
        "invalid_value",
    ),
    (
        "image_part",
        "chat",
        _chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        400,
        "messages[0].content",
        "invalid_value",
    ),
    (
        "unknown_role",
        "chat",
        _chat(messages=[*USER, {"role": "wizard", "content": "x"}]),
        400,
        "messages[1].role",
        "invalid_value",
    ),
    (
        "tool_result_without_a_call",
        "chat",
        _chat(messages=[*USER, {"role": "tool", "content": "x", "tool_call_id": "1"}]),
        400,
        "messages[1].tool_call_id",
        "invalid_value",
    ),
    ("empty_messages", "chat", _chat(messages=[]), 400, "messages", "invalid_value"),
    (
        "missing_messages",
        "chat",
        {"model": MODEL},
        400,
        "messages",
        "missing_required_parameter",
    ),
    ("unknown_model", "chat", _chat(model="gpt-7"), 404, "model", "model_not_found"),
    (
        "prompt_over_context",
        "chat",
        _chat(messages=[{"role": "user", "content": LONG_TEXT}]),
        400,
        "messages",
        "context_length_exceeded",
    ),
    (
        "prompt_plus_output_over_context",
        "completion",
        _completion(prompt="word " * (CONTEXT - 40), max_tokens=60),
        400,
        "max_tokens",
        "context_length_exceeded",
    ),
    ("max_tokens_over_limit", "chat", _chat(max_tokens=201), 400, "max_tokens", "invalid_value"),
    (
        "max_completion_tokens_over_limit",
        "chat",
        _chat(max_tokens=None, max_completion_tokens=1000),
        400,
        "max_completion_tokens",
        "invalid_value",
    ),
    ("max_tokens_zero_chat", "chat", _chat(max_tokens=0), 400, "max_tokens", "invalid_value"),
    ("temperature_negative", "chat", _chat(temperature=-1), 400, "temperature", "invalid_value"),
    ("top_p_zero", "chat", _chat(top_p=0), 400, "top_p", "invalid_value"),
    ("top_k_negative", "completion", _completion(top_k=-1), 400, "top_k", "invalid_value"),
    (
        "presence_penalty",
        "chat",
        _chat(presence_penalty=3),
        400,
        "presence_penalty",
        "invalid_value",
    ),
    ("seed_too_big", "chat", _chat(seed=2**70), 400, "seed", "invalid_value"),
    (
        "too_many_stops",
        "chat",
        _chat(stop=[str(i) for i in range(17)]),
        400,
        "stop",
        "invalid_value",
    ),
    ("stop_number", "chat", _chat(stop=5), 400, "stop", "invalid_value"),
    (
        "top_logprobs_too_many",
        "chat",
        _chat(logprobs=True, top_logprobs=21),
        400,
        "top_logprobs",
        "invalid_value",
    ),
    ("top_logprobs_alone", "chat", _chat(top_logprobs=2), 400, "top_logprobs", "invalid_value"),
    ("n_zero", "chat", _chat(n=0), 400, "n", "invalid_value"),
    ("n_too_many", "chat", _chat(n=100), 400, "n", "invalid_value"),
    ("unknown_tier", "chat", _chat(service_tier="gold"), 400, "service_tier", "invalid_value"),
    (
        "stream_options_without_stream",
        "chat",
        _chat(stream_options={"include_usage": True}),
        400,
        "stream_options",
        "invalid_value",
    ),
    (
        "logit_bias",
        "chat",
        _chat(logit_bias={"50": 10}),
        400,
        "logit_bias",
        "unsupported_parameter",
    ),
    (
        "token_out_of_vocab",
        "completion",
        _completion(prompt=[1, 10**6]),
        400,
        "prompt",
        "invalid_value",
    ),
    ("empty_prompt_list", "completion", _completion(prompt=[]), 400, "prompt", "invalid_value"),
    ("prompt_object", "completion", _completion(prompt={"a": 1}), 400, "prompt", "invalid_value"),
    ("empty_prompt_text", "completion", _completion(prompt=""), 400, "prompt", "invalid_value"),
    ("suffix", "completion", _completion(suffix="end"), 400, "suffix", "unsupported_parameter"),
]

PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "code"),
    [case[1:] for case in JSON_CASES],
    ids=[case[0] for case in JSON_CASES],
)
def test_invalid_json_body(served, http, path, body, status, param, code):
    body = {k: v for k, v in body.items() if v is not None}
    _assert_error(http.post(PATHS[path], json=body), status, param, code)
    _assert_still_serving(http, served[1])


def test_unknown_tier_lists_the_valid_ones(http):
    error = _assert_error(
        http.post(PATHS["chat"], json=_chat(service_tier="gold")),
        400,
        "service_tier",
        "invalid_value",
    )
    for tier in ("auto", "default", "priority", "flex", "batch"):
        assert tier in error["message"]


RAW_CASES = [
    ("malformed_json", b'{"model": "x", ', 400, "invalid_json"),
    ("not_an_object", b"[1, 2, 3]", 400, "invalid_json"),
    ("empty_body", b"", 400, "invalid_json"),
    ("nan", b'{"prompt": "Hi", "temperature": NaN}', 400, "invalid_json"),
    ("invalid_utf8", b'{"prompt": "caf\xe9 \xff"}', 400, "invalid_encoding"),
    ("lone_surrogate", b'{"prompt": "\\ud800"}', 400, "invalid_encoding"),
    ("too_large", b'{"prompt": "' + b"a" * (40 * 1024) + b'"}', 413, "request_too_large"),
]


@pytest.mark.parametrize(
    ("content", "status", "code"), [c[1:] for c in RAW_CASES], ids=[c[0] for c in RAW_CASES]
)
def test_unparseable_body(served, http, content, status, code):
    headers = {"Content-Type": "application/json"}
    response = http.post(PATHS["completion"], content=content, headers=headers)
    _assert_error(response, status, None, code)
    _assert_still_serving(http, served[1])


def test_chunked_body_over_the_limit_is_refused(served, http):
    def parts():  # no Content-Length: the limit must hold while reading
        yield b'{"prompt": "'
        for _ in range(40):
            yield b"a" * 1024
        yield b'"}'

    response = http.post(PATHS["completion"], content=parts())
    _assert_error(response, 413, None, "request_too_large")
    _assert_still_serving(http, served[1])


@pytest.mark.parametrize("header", [None, "Bearer wrong-key", "Basic " + KEY, f"Bearer {KEY}x"])
def test_api_key_required(served, http, header):
    headers = {"Authorization": header} if header else {}
    with httpx.Client(base_url=served[0].url, headers=headers) as anonymous:
        response = anonymous.post(PATHS["chat"], json=_chat())
        models = anonymous.get("/v1/models")
        assert anonymous.get("/health").status_code == 200  # probes need no key
    _assert_error(response, 401, None, "invalid_api_key")
    _assert_error(models, 401, None, "invalid_api_key")
    _assert_still_serving(http, served[1])


def test_unknown_route(http):
    _assert_error(http.post("/v1/embeddings", json={}), 404, None, "unknown_url")
    _assert_error(http.get("/v1/chat/completions"), 405, None, "method_not_allowed")


def test_sdk_sees_typed_errors(served, http):
    client = openai.OpenAI(base_url=f"{served[0].url}/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError) as not_found:
        client.chat.completions.create(model="gpt-7", messages=USER)
    assert not_found.value.code == "model_not_found" and not_found.value.param == "model"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=USER, temperature=-1)
    assert bad.value.param == "temperature"
    wrong_key = openai.OpenAI(base_url=f"{served[0].url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong_key.models.list()
    _assert_still_serving(http, served[1])


@pytest.mark.parametrize("stream", [False, True])
def test_no_healthy_replica_is_503_with_retry_after(served, http, stream):
    served[2].fail_next = "unavailable"
    response = http.post(PATHS["chat"], json=_chat(stream=stream))
    error = _assert_error(response, 503, None, "service_unavailable")
    assert response.headers["Retry-After"] == "3"
    assert "draining" in error["message"]
    _assert_still_serving(http, served[1])


def test_backend_failure_before_output_is_502(served, http):
    served[2].fail_next = "error"
    _assert_error(http.post(PATHS["chat"], json=_chat()), 502, None, "backend_error")
    _assert_still_serving(http, served[1])


def test_backend_failure_mid_stream_is_an_sse_error_event(served, http):
    _, engine, backend, steps_per_request = served
    backend.fail_next = "midstream"
    aborted, seen = engine.num_aborted, set(steps_per_request)
    # It could run 200 tokens (ignore_eos): only the abort ends it within the test.
    body = _chat(max_tokens=200, ignore_eos=True, stream=True)
    with http.stream("POST", PATHS["chat"], json=body) as response:
        assert response.status_code == 200  # the stream had begun
        events = [
            line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")
        ]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and error["code"] == "backend_error"
    assert "d-1 went away" in error["message"]
    first = json.loads(events[0])
    assert first["choices"][0]["delta"]["role"] == "assistant"
    # The failed request's engine work was aborted, not left running: counted as an abort,
    # gone from the engine at once, and no step computes it any more.
    deadline = time.monotonic() + 1.0
    while engine.has_work and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not engine.has_work
    assert engine.num_aborted == aborted + 1
    # Steps are counted after their outputs are delivered, so the previous test's one-token
    # completion (`cmpl-…`) may be counted only after `seen` was taken: the chat request is
    # the one to follow.
    (failed,) = {r for r in set(steps_per_request) - seen if r.startswith("chatcmpl-")}
    steps = steps_per_request[failed]
    assert steps < 100, steps
    time.sleep(0.3)
    assert steps_per_request[failed] == steps
    engine.blocks.check_integrity()
    _assert_still_serving(http, engine)


def test_ready_reports_the_backend(http):
    response = http.get("/ready")
    assert response.status_code == 200
    assert response.json()["ready"] is True


def test_escaped_surrogate_pair_is_valid_text(served, http):
    body = b'{"model": "%s", "prompt": "\\ud83d\\ude00", "max_tokens": 1}' % MODEL.encode()
    response = http.post(PATHS["completion"], content=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] >= 1
