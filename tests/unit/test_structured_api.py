"""`response_format` over HTTP on the real SmolLM2 (in-process engine): honoured on chat and
completions, streamed or not, through the official `openai` SDK; malformed or uncompilable
formats answered with a 400 naming the parameter; a cut-off output reported as `length`
with a note."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from engine.core.config import EngineConfig
from engine.core.engine import Engine
from services.coordinator.api.app import create_app
from services.coordinator.api.server import ServerThread
from services.coordinator.settings import APISettings
from shared.modelfile.default import DEFAULT_MODEL_ID
from tools.inprocess.engine_backend import EngineBackend

pytestmark = pytest.mark.real_model

MODEL = DEFAULT_MODEL_ID
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
    },
    "required": ["city", "population"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Give the largest city of France as JSON."}]
JSON_SCHEMA_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "city", "schema": SCHEMA, "strict": True},
}


@pytest.fixture(scope="module")
def server(real_model, real_tokenizer):
    engine = Engine(EngineConfig(num_blocks=128, block_size=16), real_model, real_tokenizer)
    backend = EngineBackend(engine, model_id=MODEL).start()
    with ServerThread(create_app(backend, APISettings(model_id=MODEL))) as srv:
        yield srv
    backend.close()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        yield http


def _greedy_json_chat(client: openai.OpenAI, stream: bool):
    return client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        temperature=0,
        max_tokens=48,
        response_format=JSON_SCHEMA_FORMAT,
        stream=stream,
    )


def test_chat_json_schema_output_validates(client):
    choice = _greedy_json_chat(client, stream=False).choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_streamed_chat_deltas_assemble_to_the_same_json(client):
    stream = _greedy_json_chat(client, stream=True)
    text, reasons = "", []
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            reasons.append(chunk.choices[0].finish_reason)
    assert reasons[-1] == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_mode_on_completions(client):
    reply = client.completions.create(
        model=MODEL,
        prompt='Cat: {"name":"Tom","age":3}\nDog:',
        temperature=0,
        max_tokens=64,
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].text), dict)


def test_type_text_is_free_text(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, response_format={"type": "text"}
    )
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_a_cut_off_output_ends_with_length_and_a_note(http):
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 3,
        "response_format": JSON_SCHEMA_FORMAT,
    }
    reply = http.post("/v1/chat/completions", json=body).json()
    assert reply["choices"][0]["finish_reason"] == "length"
    # OpenAI types metadata values as strings: structured ones travel as JSON.
    assert any("response_format" in line for line in json.loads(reply["metadata"]["reasoning"]))


def _json_schema(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


@pytest.mark.parametrize(
    ("response_format", "param", "named"),
    [
        ({"type": "xml"}, "response_format.type", "json_schema"),
        ({"type": "json_schema"}, "response_format.json_schema", "json_schema"),
        (
            {"type": "json_schema", "json_schema": {"schema": SCHEMA}},
            "response_format.json_schema.name",
            "name",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "bad name!", "schema": SCHEMA}},
            "response_format.json_schema.name",
            "a-z",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}},
            "response_format.json_schema.schema",
            "object",
        ),
        ("json", "response_format", "object"),
        (_json_schema({"type": "array", "uniqueItems": True}), "response_format", "uniqueItems"),
        (_json_schema({"type": "strin"}), "response_format", "strin"),
        (_json_schema({"$ref": "#/$defs/missing"}), "response_format", "missing"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_bad_response_formats_are_refused_naming_the_parameter(
    http, response_format, param, named, stream
):
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 8,
        "stream": stream,
        "response_format": response_format,
    }
    reply = http.post("/v1/chat/completions", json=body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param
    assert named in error["message"]


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_forced_tool_call_from_the_real_model_parses_against_its_schema(client, tool_choice):
    """The bundled model cannot call tools on its own; the grammar makes its reply a call."""
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER_TOOL],
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        max_tokens=64,
        temperature=0,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])
