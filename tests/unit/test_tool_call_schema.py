"""Forced tool calls as a JSON-schema constraint: the schema built from OpenAI tool shapes,
refusals naming the parameter, and greedy output on the real model that is a call to one of
the tools with arguments matching its schema."""

from __future__ import annotations

import json

import jsonschema
import pytest

from engine.core.config import EngineConfig
from engine.core.engine import Engine
from services.coordinator.prepare.tool_call_schema import (
    MAX_TOOLS,
    ToolChoiceError,
    parse_tool_calls,
    tool_call_output,
)
from shared.sampling.params import SamplingParams

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string", "maxLength": 30}},
            "required": ["query"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, SEARCH]


def test_required_accepts_a_call_to_any_tool_and_named_only_that_one():
    required = json.loads(tool_call_output(TOOLS, "required").schema)
    named = json.loads(
        tool_call_output(TOOLS, {"type": "function", "function": {"name": "search"}}).schema
    )
    call = {"name": "search", "arguments": {"query": "moon"}}
    jsonschema.validate(call, required)
    jsonschema.validate(call, named)
    weather = {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}
    jsonschema.validate(weather, required)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(weather, named)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "search", "arguments": {"q": 1}}, required)
    parallel = json.loads(tool_call_output(TOOLS, "required", parallel=True).schema)
    jsonschema.validate([call, weather], parallel)
    assert tool_call_output(TOOLS, "auto") is None and tool_call_output(TOOLS, "none") is None


@pytest.mark.parametrize(
    ("tools", "choice", "param"),
    [
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
        (TOOLS, "always", "tool_choice"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
            "required",
            "tools[0].function.parameters",
        ),
        ([{"type": "retrieval"}], "required", "tools[0].type"),
        ([WEATHER, WEATHER], "required", "tools[1].function.name"),
        ([SEARCH] * (MAX_TOOLS + 1), "required", "tools"),
    ],
)
def test_bad_tools_and_choices_name_the_parameter(tools, choice, param):
    with pytest.raises(ToolChoiceError) as err:
        tool_call_output(tools, choice)
    assert err.value.param == param


@pytest.mark.real_model
def test_greedy_forced_call_parses_to_a_tool_with_valid_arguments(real_model, real_tokenizer):
    spec = tool_call_output(TOOLS, "required")
    prompt = real_tokenizer.encode(
        real_tokenizer.apply_chat_template(
            [{"role": "user", "content": "What is the weather in Paris?"}]
        )
    )
    engine = Engine(EngineConfig(num_blocks=64, block_size=16), real_model, real_tokenizer)
    (ids,) = engine.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=48, structured=spec)
    )
    text = real_tokenizer.decode(ids)
    jsonschema.validate(json.loads(text), json.loads(spec.schema))
    ((name, arguments),) = parse_tool_calls(text)
    parameters = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[name]
    jsonschema.validate(json.loads(arguments), parameters)
