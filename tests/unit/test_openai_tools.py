"""Tool calling through the official `openai` SDK: tools rendered, calls parsed (`auto`), and a
whole user -> assistant(tool_calls) -> tool -> assistant conversation served.

The replies are scripted (the bundled model is too small to call tools on its own); the
prompts they answer are the real tokenizer's, so what the model would read is checked too.
SmolLM2's template does not render tools, so they take the documented fallback format; a
template that does gets them itself (the last test).
"""

from __future__ import annotations

import json

import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from services.coordinator.api.app import create_app
from services.coordinator.api.server import ServerThread
from services.coordinator.prepare.chat_prompt import render_chat
from services.coordinator.prepare.schemas import ChatCompletionRequest
from services.coordinator.settings import APISettings
from shared.tokenizer.chat_template import ChatTemplate
from tests.unit.scripted_backend import Script, ScriptedTestBackend

CALLER, TALKER, TWICE, FORCED = "caller", "talker", "twice", "forced"
FORCED_TEXT = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def served(real_tokenizer):
    scripts = {
        CALLER: Script(text=CALL_TEXT),
        TALKER: Script(text="It is sunny in Paris."),
        TWICE: Script(text=f"Let me check.\n{CALL_TEXT}\n{CALL_TEXT.replace('Paris', 'Rome')}"),
        # What the grammar makes the model write when the reply must be a call.
        FORCED: Script(text=FORCED_TEXT),
    }
    backend = ScriptedTestBackend(real_tokenizer, scripts)
    with ServerThread(create_app(backend, APISettings(model_id=CALLER))) as server:
        yield server, backend


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served[0].url}/v1", api_key="unused", max_retries=0)


def _last_prompt(served, tokenizer) -> str:
    return tokenizer.decode(served[1].calls[-1].request.prompt_token_ids)


def test_auto_call_is_parsed_from_the_reply(served, client, real_tokenizer):
    assert not real_tokenizer.chat_template_supports_tools  # so: the fallback format
    raw = client.chat.completions.with_raw_response.create(
        model=CALLER, messages=ASK, tools=[WEATHER], max_tokens=64
    )
    ChatCompletion.model_validate(raw.http_response.json())
    choice = raw.parse().choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    prompt = _last_prompt(served, real_tokenizer)
    assert "<tools>\n" + json.dumps(WEATHER) + "\n</tools>" in prompt
    assert prompt.startswith("<|im_start|>system\n# Tools")  # its own system turn


def test_streamed_deltas_assemble_to_the_same_call(client):
    stream = client.chat.completions.create(
        model=TWICE, messages=ASK, tools=[WEATHER], max_tokens=128, stream=True
    )
    content, calls, reasons = "", {}, []
    for chunk in stream:
        ChatCompletionChunk.model_validate(chunk.to_dict())
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or ():
                entry = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = delta.id or entry["id"]
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    whole = client.chat.completions.create(
        model=TWICE, messages=ASK, tools=[WEATHER], max_tokens=128
    ).choices[0]
    assert reasons == ["tool_calls"] == [whole.finish_reason]
    assert content == whole.message.content == "Let me check."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls
    ]
    assert [json.loads(c["arguments"])["city"] for c in calls.values()] == ["Paris", "Rome"]
    assert all(c["id"] for c in calls.values())


def test_a_whole_tool_conversation(served, client, real_tokenizer):
    first = client.chat.completions.create(
        model=CALLER, messages=ASK, tools=[WEATHER], max_tokens=64
    )
    assistant = first.choices[0].message
    call = assistant.tool_calls[0]
    history = [
        *ASK,
        assistant.model_dump(exclude_none=True),  # content null/absent, tool_calls set
        {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny"}'},
    ]
    assert "content" not in history[1]
    second = client.chat.completions.create(
        model=TALKER, messages=history, tools=[WEATHER], max_tokens=64
    )
    assert second.choices[0].message.content == "It is sunny in Paris."
    assert second.choices[0].finish_reason == "stop"
    assert not second.choices[0].message.tool_calls
    prompt = _last_prompt(served, real_tokenizer)
    called = json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})
    assert f"<|im_start|>assistant\n<tool_call>\n{called}\n</tool_call><|im_end|>" in prompt
    result = json.dumps(
        {"tool_call_id": call.id, "name": "get_weather", "content": '{"sky": "sunny"}'}
    )
    assert f"<|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_tool_choice_none_renders_no_tools_and_parses_nothing(served, client, real_tokenizer):
    reply = client.chat.completions.create(
        model=CALLER, messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=64
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert choice.message.content == CALL_TEXT
    assert "<tools>" not in _last_prompt(served, real_tokenizer)


def test_parallel_tool_calls_false_returns_one_call(served, client, real_tokenizer):
    reply = client.chat.completions.create(
        model=TWICE, messages=ASK, tools=[WEATHER], parallel_tool_calls=False, max_tokens=128
    )
    message = reply.choices[0].message
    assert [json.loads(c.function.arguments)["city"] for c in message.tool_calls] == ["Paris"]
    assert message.content.startswith("Let me check.") and "Rome" in message.content
    assert "at most one function" in _last_prompt(served, real_tokenizer)


def test_a_call_cut_off_by_max_tokens_stays_text(client):
    reply = client.chat.completions.create(
        model=CALLER, messages=ASK, tools=[WEATHER], max_tokens=5
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    assert CALL_TEXT.startswith(choice.message.content)


# A template in the Hugging Face tools convention (as Qwen's and Hermes' are, much shortened).
TOOLS_TEMPLATE = """
{%- if tools %}[tools:{% for t in tools %} {{ t.function.name }}{% endfor %}]{% endif %}
{%- for m in messages %}<{{ m.role }}>{{ m.content }}
{%- for c in m.tool_calls or [] %}[call {{ c.function.name }} {{ c.function.arguments | tojson }}]
{%- endfor %}
{%- if m.tool_call_id %}[for {{ m.tool_call_id }}]{% endif %}</{{ m.role }}>
{%- endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"""


def test_a_template_that_renders_tools_gets_them_itself(real_tokenizer, monkeypatch):
    template = ChatTemplate(TOOLS_TEMPLATE, bos_token="", eos_token="", origin="test")
    assert template.supports_tools
    monkeypatch.setattr(real_tokenizer, "_chat_template", template)
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    body = ChatCompletionRequest.model_validate(
        {
            "messages": [
                *ASK,
                {"role": "assistant", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            ],
            "tools": [WEATHER],
        }
    )
    prompt = render_chat(body, real_tokenizer)
    assert prompt.text == (
        "[tools: get_weather]<user>What is the weather in Paris?</user>"
        '<assistant>[call get_weather {"city": "Paris"}]</assistant>'
        "<tool>sunny[for c1]</tool><assistant>"
    )
    assert prompt.tool_parsing is not None and prompt.tool_parsing.names == {"get_weather"}


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
@pytest.mark.parametrize("stream", [False, True])
def test_forced_call_is_constrained_and_read_whole(served, client, tool_choice, stream):
    """`required` and a named function: the workers get the call's JSON schema as the reply's
    grammar, and the reply (JSON, no tags) comes back as the call."""
    args = dict(model=FORCED, messages=ASK, tools=[WEATHER], tool_choice=tool_choice, max_tokens=64)
    if stream:
        calls, reasons, content = [], [], ""
        for chunk in client.chat.completions.create(**args, stream=True):
            for choice in chunk.choices:
                content += choice.delta.content or ""
                calls += choice.delta.tool_calls or []
                reasons += [choice.finish_reason] if choice.finish_reason else []
        assert content == "" and reasons == ["tool_calls"]
        got = [(c.function.name, json.loads(c.function.arguments)) for c in calls]
    else:
        choice = client.chat.completions.create(**args).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        got = [
            (c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls
        ]
    assert got == [("get_weather", {"city": "Oslo"})]
    structured = served[1].calls[-1].request.params.structured
    assert structured is not None and structured.kind == "json_schema"
    schema = json.loads(structured.schema)
    assert schema["type"] == "array"  # parallel_tool_calls defaults to true: one or more calls
    schema = schema["items"]
    assert schema["properties"]["name"] == {"const": "get_weather"}
    assert schema["properties"]["arguments"] == WEATHER["function"]["parameters"]


def test_forced_call_with_response_format_is_refused(served):
    import httpx

    body = {
        "model": FORCED,
        "messages": ASK,
        "tools": [WEATHER],
        "tool_choice": "required",
        "response_format": {"type": "json_object"},
    }
    reply = httpx.post(f"{served[0].url}/v1/chat/completions", json=body)
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "response_format"
