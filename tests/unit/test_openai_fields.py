"""Every request field is honoured or refused with a 400 naming it; none is silently ignored.

Refusals (fields asking for what this build lacks, tool definitions and tool history that do
not add up) are checked against a scripted backend: they never reach it. `null` for a field
with a default means that default, as OpenAI's schema marks those fields nullable. And an
error nothing else handled is OpenAI's 500, on a connection that stays usable.
"""

from __future__ import annotations

import http.client
import json

import pytest

from services.coordinator.api.app import create_app
from services.coordinator.api.server import ServerThread
from services.coordinator.settings import APISettings
from tests.unit.coordinator_client import run_with_client
from tests.unit.scripted_backend import Script, ScriptedTestBackend

MODEL = "m"
USER = [{"role": "user", "content": "Hi"}]
PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


def _chat(**fields) -> dict:
    return {"model": MODEL, "messages": USER, "max_tokens": 2, **fields}


def _completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "Hi", "max_tokens": 2, **fields}


def _tool(name: str = "get_weather", **function) -> dict:
    spec = {"name": name, "parameters": {"type": "object", "properties": {}}, **function}
    return {"type": "function", "function": spec}


def _call_turn(arguments: str = "{}") -> dict:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


NAMED = {"type": "function", "function": {"name": "get_weather"}}

# (id, endpoint, body, param, code)
REFUSED = [
    ("logit_bias", "chat", _chat(logit_bias={"50": 10}), "logit_bias", "unsupported_parameter"),
    ("audio", "chat", _chat(audio={"voice": "alloy"}), "audio", "unsupported_parameter"),
    (
        "modalities",
        "chat",
        _chat(modalities=["text", "audio"]),
        "modalities",
        "unsupported_parameter",
    ),
    (
        "prediction",
        "chat",
        _chat(prediction={"type": "content", "content": "x"}),
        "prediction",
        "unsupported_parameter",
    ),
    (
        "web_search",
        "chat",
        _chat(web_search_options={}),
        "web_search_options",
        "unsupported_parameter",
    ),
    ("functions", "chat", _chat(functions=[{"name": "f"}]), "functions", "unsupported_parameter"),
    (
        "function_call",
        "chat",
        _chat(function_call="auto"),
        "function_call",
        "unsupported_parameter",
    ),
    (
        "reasoning_effort",
        "chat",
        _chat(reasoning_effort="high"),
        "reasoning_effort",
        "unsupported_parameter",
    ),
    ("verbosity", "chat", _chat(verbosity="low"), "verbosity", "unsupported_parameter"),
    ("chat_echo", "chat", _chat(echo=True), "echo", "unsupported_parameter"),
    (
        "chat_template",
        "chat",
        _chat(chat_template="{{ x }}"),
        "chat_template",
        "unsupported_parameter",
    ),
    (
        "guided_json",
        "completion",
        _completion(guided_json={}),
        "guided_json",
        "unsupported_parameter",
    ),
    (
        "beam_search",
        "completion",
        _completion(use_beam_search=True),
        "use_beam_search",
        "unsupported_parameter",
    ),
    ("min_tokens", "completion", _completion(min_tokens=3), "min_tokens", "unsupported_parameter"),
    ("suffix", "completion", _completion(suffix="end"), "suffix", "unsupported_parameter"),
    ("best_of", "completion", _completion(best_of=3), "best_of", "invalid_value"),
    (
        "format_unknown",
        "chat",
        _chat(response_format={"type": "yaml"}),
        "response_format.type",
        "invalid_value",
    ),
    (
        "strict_tool_auto",
        "chat",
        _chat(tools=[_tool(strict=True)]),
        "tools[0].function.strict",
        "unsupported_value",
    ),
    (
        "choice_unknown_function",
        "chat",
        _chat(tools=[_tool()], tool_choice={"type": "function", "function": {"name": "nope"}}),
        "tool_choice",
        "invalid_value",
    ),
    ("choice_without_tools", "chat", _chat(tool_choice="auto"), "tool_choice", "invalid_value"),
    (
        "choice_word",
        "chat",
        _chat(tools=[_tool()], tool_choice="any"),
        "tool_choice",
        "invalid_value",
    ),
    (
        "parameters_array",
        "chat",
        _chat(tools=[_tool(parameters=["city"])]),
        "tools[0].function.parameters",
        "invalid_type",
    ),
    (
        "parameters_string_schema",
        "chat",
        _chat(tools=[_tool(parameters={"type": "string"})]),
        "tools[0].function.parameters",
        "invalid_value",
    ),
    (
        "too_many_tools",
        "chat",
        _chat(tools=[_tool(f"f{i}") for i in range(129)]),
        "tools",
        "invalid_value",
    ),
    ("duplicate_tools", "chat", _chat(tools=[_tool(), _tool()]), "tools", "invalid_value"),
    (
        "tool_name",
        "chat",
        _chat(tools=[_tool("get weather")]),
        "tools[0].function.name",
        "invalid_value",
    ),
    (
        "custom_tool",
        "chat",
        _chat(tools=[{"type": "custom", "custom": {}}]),
        "tools[0].type",
        "invalid_value",
    ),
    (
        "result_for_no_call",
        "chat",
        _chat(messages=[*USER, {"role": "tool", "content": "x", "tool_call_id": "1"}]),
        "messages[1].tool_call_id",
        "invalid_value",
    ),
    (
        "result_without_call_id",
        "chat",
        _chat(messages=[*USER, _call_turn(), {"role": "tool", "content": "x"}]),
        "messages[2].tool_call_id",
        "missing_required_parameter",
    ),
    (
        "assistant_with_nothing",
        "chat",
        _chat(messages=[*USER, {"role": "assistant", "content": None}, *USER]),
        "messages[1].content",
        "missing_required_parameter",
    ),
    (
        "arguments_not_json",
        "chat",
        _chat(messages=[*USER, _call_turn("{city"), *USER]),
        "messages[1].tool_calls[0].function.arguments",
        "invalid_value",
    ),
    (
        "arguments_not_an_object",
        "chat",
        _chat(messages=[*USER, _call_turn("[1]"), *USER]),
        "messages[1].tool_calls[0].function.arguments",
        "invalid_value",
    ),
    (
        "user_with_calls",
        "chat",
        _chat(messages=[{**_call_turn(), "role": "user", "content": "x"}]),
        "messages[0].tool_calls",
        "invalid_value",
    ),
]

# Values that mean what the server does anyway, and fields that do not change the output.
ACCEPTED = [
    ("stream_null", "completion", _completion(stream=None)),
    (
        "nulls_everywhere",
        "completion",
        _completion(echo=None, logprobs=None, n=None, stop=None, seed=None, suffix=None, user=None),
    ),
    (
        "chat_nulls",
        "chat",
        _chat(
            stream=None,
            logprobs=None,
            top_logprobs=None,
            tools=None,
            tool_choice=None,
            parallel_tool_calls=None,
            stream_options=None,
            response_format=None,
        ),
    ),
    ("text_format", "chat", _chat(response_format={"type": "text"})),
    ("json_object", "chat", _chat(response_format={"type": "json_object"})),
    (
        "json_schema",
        "chat",
        _chat(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object"}},
            }
        ),
    ),
    ("completion_json", "completion", _completion(response_format={"type": "json_object"})),
    ("choice_required", "chat", _chat(tools=[_tool()], tool_choice="required")),
    ("choice_named", "chat", _chat(tools=[_tool()], tool_choice=NAMED)),
    ("strict_forced", "chat", _chat(tools=[_tool(strict=True)], tool_choice="required")),
    ("text_modality", "chat", _chat(modalities=["text"])),
    ("empty_logit_bias", "chat", _chat(logit_bias={})),
    ("empty_suffix", "completion", _completion(suffix="")),
    ("best_of_n", "completion", _completion(best_of=2, n=2)),
    ("tool_choice_none", "chat", _chat(tools=[_tool()], tool_choice="none")),
    ("tools_auto", "chat", _chat(tools=[_tool()], parallel_tool_calls=False)),
    ("strict_with_none", "chat", _chat(tools=[_tool(strict=True)], tool_choice="none")),
    (
        "bookkeeping",
        "chat",
        _chat(
            user="u1", store=False, metadata={"k": "v"}, prompt_cache_key="c", safety_identifier="s"
        ),
    ),
    (
        "vllm_defaults",
        "chat",
        _chat(skip_special_tokens=True, min_tokens=0, add_generation_prompt=True, echo=False),
    ),
]


@pytest.fixture(scope="module")
def backend(real_tokenizer) -> ScriptedTestBackend:
    return ScriptedTestBackend(real_tokenizer, {MODEL: Script(num_tokens=2)})


def _post(backend, path: str, body: dict):
    async def work(client):
        return await client.post(path, json=body)

    return run_with_client(backend, APISettings(model_id=MODEL), work)


@pytest.mark.parametrize(
    ("endpoint", "body", "param", "code"),
    [case[1:] for case in REFUSED],
    ids=[case[0] for case in REFUSED],
)
def test_refused_with_a_400_naming_the_field(backend, endpoint, body, param, code):
    calls = len(backend.calls)
    response = _post(backend, PATHS[endpoint], body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert (error["param"], error["code"]) == (param, code), error
    assert error["message"]
    assert len(backend.calls) == calls  # refused before anything ran


@pytest.mark.parametrize(
    ("endpoint", "body"), [case[1:] for case in ACCEPTED], ids=[case[0] for case in ACCEPTED]
)
def test_accepted(backend, endpoint, body):
    response = _post(backend, PATHS[endpoint], body)
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert len(choices) == (body.get("n") or 1)
    assert all(c["finish_reason"] == "length" for c in choices)


def test_an_unhandled_error_is_a_500_on_a_connection_that_stays_open(backend):
    # The scripted backend sends no prompt logprobs: formatting an echo with logprobs fails
    # the way a backend bug would, after the request was served.
    with ServerThread(create_app(backend, APISettings(model_id=MODEL))) as server:
        conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
        headers = {"Content-Type": "application/json"}

        def post(body: dict) -> tuple[int, dict]:
            conn.request("POST", "/v1/completions", json.dumps(body), headers)
            response = conn.getresponse()
            return response.status, json.loads(response.read())

        status, body = post(_completion(prompt="Hello there, friend", echo=True, logprobs=1))
        assert status == 500
        assert body == {
            "error": {
                "message": "The server had an internal error.",
                "type": "server_error",
                "param": None,
                "code": "internal_error",
            }
        }
        sock = conn.sock
        assert sock is not None  # not closed after the response
        status, body = post(_completion())
        assert status == 200 and body["usage"]["completion_tokens"] == 2
        assert conn.sock is sock  # the same connection served the next request
        conn.request("GET", "/metrics")
        metrics = conn.getresponse().read().decode()
        conn.close()
    counted = (
        'splitserve_requests_total{endpoint="completion",model="m",status="500",tier="default"}'
    )
    assert f"{counted} 1.0" in metrics  # counted as the 500 it was, not as the 200 it began as
