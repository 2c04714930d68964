"""From a chat request's messages and tools to the prompt text the model reads.

Tool definitions, the assistant's earlier tool calls and the tools' results are rendered by
the model's own chat template when it renders tools (it reads `tools`; calls and results
then go to it in the Hugging Face convention, arguments as objects). Otherwise they are
written in this fallback format, plain text in system, user and assistant turns that any
template carries:

- the tools offered: a section appended to the first system message (one is added if there
  is none) listing each `{"type": "function", "function": {...}}` as JSON, one a line, inside
  `<tools>`...`</tools>`, and asking for calls as below;
- an assistant turn's calls: its content, then per call
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`;
- tool results: a user turn holding per result
  `<tool_response>\\n{"tool_call_id": ..., "name": ..., "content": ...}\\n</tool_response>`
  (results that follow one another share one turn).

`tool_choice`: "none" renders no tools (the model is not to call one; calls and results in
the history are still rendered) and parses nothing; "auto" (the default with tools) renders
them and parses calls from the output (`tool_calls`). "required" and a named function
promise a call whose arguments match the schema, which takes grammar-constrained decoding
this build does not have: refused with a 400, never served as free text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from services.coordinator.errors import APIError, bad_request
from services.coordinator.schemas import ChatCompletionRequest, ChatMessage
from services.coordinator.tool_calls import CLOSE, OPEN, ToolCallParsing
from shared.tokenizer.chat_template import TEXT_PART_SEPARATOR
from shared.tokenizer.tokenizer import Tokenizer

TOOLS_HEADER = (
    "# Tools\n\nYou can call the functions listed in <tools></tools> below to help answer.\n"
)
CALL_INSTRUCTIONS = (
    "\nTo call a function, reply with a JSON object naming it and giving its arguments, "
    f"inside {OPEN}{CLOSE} tags:\n"
    f'{OPEN}\n{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}\n{CLOSE}'
)
ONE_CALL = "\nCall at most one function per reply."


@dataclass(frozen=True)
class ChatPrompt:
    text: str
    tool_parsing: ToolCallParsing | None  # None: the output is not parsed for calls


def render_chat(body: ChatCompletionRequest, tokenizer: Tokenizer) -> ChatPrompt:
    """The prompt text and how to read the reply; a 400 naming the field for bad input."""
    _check_messages(body.messages)
    offered = _offered_tools(body)
    native = tokenizer.chat_template_supports_tools
    arguments = _call_arguments(body.messages)
    if native:
        messages = [_native_message(m, arguments.get(i)) for i, m in enumerate(body.messages)]
    else:
        messages = _fallback_messages(body.messages, arguments)
        if offered:
            messages = _with_tools_section(messages, offered, body.parallel_tool_calls)
    try:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tools=offered if native and offered else None
        )
    except ValueError as exc:
        raise bad_request(str(exc), "messages") from exc
    parsing = None
    if offered:
        names = frozenset(t["function"]["name"] for t in offered)
        parsing = ToolCallParsing(names, body.parallel_tool_calls)
    return ChatPrompt(text, parsing)


def _check_messages(messages: list[ChatMessage]) -> None:
    call_ids: set[str] = set()
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if m.role != "assistant" and m.tool_calls is not None:
            raise bad_request("only assistant messages may have tool_calls", f"{where}.tool_calls")
        if m.role == "tool":
            if m.tool_call_id is None:
                raise _missing(f"{where}.tool_call_id")
            if m.tool_call_id not in call_ids:
                raise bad_request(
                    f"tool_call_id {m.tool_call_id!r} does not answer a tool call of an earlier "
                    "assistant message",
                    f"{where}.tool_call_id",
                )
        elif m.tool_call_id is not None:
            raise bad_request("only tool messages may have a tool_call_id", f"{where}.tool_call_id")
        if m.content is None and not (m.role == "assistant" and (m.tool_calls or m.refusal)):
            raise _missing(f"{where}.content")
        for call in m.tool_calls or ():
            call_ids.add(call.id)


def _offered_tools(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The tools to render (OpenAI's shape), after checking `tool_choice` against them."""
    choice = body.tool_choice
    if not body.tools:
        if choice is not None and choice != "none":
            raise bad_request("tool_choice is only allowed when tools are specified", "tool_choice")
        return []
    if isinstance(choice, str) or choice is None:
        mode = choice or "auto"
    else:
        name = choice.function["name"]
        if name not in {t.function.name for t in body.tools}:
            raise bad_request(
                f"tool_choice names function {name!r}, which is not in tools", "tool_choice"
            )
        mode = "named"
    if mode in ("required", "named"):
        what = "a required tool call" if mode == "required" else "a named tool choice"
        raise _needs_grammar(what, "tool_choice")
    if mode == "none":
        return []
    for i, tool in enumerate(body.tools):
        if tool.function.strict:  # arguments guaranteed to match the schema
            raise _needs_grammar("strict function arguments", f"tools[{i}].function.strict")
    return [tool.model_dump(exclude_none=True) for tool in body.tools]


def _call_arguments(messages: list[ChatMessage]) -> dict[int, list[dict[str, Any]]]:
    """Per assistant message with calls: each call's arguments as an object."""
    out: dict[int, list[dict[str, Any]]] = {}
    for i, m in enumerate(messages):
        if not m.tool_calls:
            continue
        parsed = []
        for j, call in enumerate(m.tool_calls):
            param = f"messages[{i}].tool_calls[{j}].function.arguments"
            try:
                value = json.loads(call.function.arguments)
            except ValueError as exc:
                raise bad_request(f"must be a JSON object's text: {exc}", param) from exc
            if not isinstance(value, dict):
                raise bad_request("must be a JSON object's text", param)
            parsed.append(value)
        out[i] = parsed
    return out


def _content(m: ChatMessage) -> Any:
    return m.content if m.content is not None else (m.refusal or "")


def _native_message(m: ChatMessage, arguments: list[dict[str, Any]] | None) -> dict[str, Any]:
    out: dict[str, Any] = {"role": _role(m), "content": _content(m)}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        assert arguments is not None
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": args},
            }
            for call, args in zip(m.tool_calls, arguments, strict=True)
        ]
    return out


def _fallback_messages(
    messages: list[ChatMessage], arguments: dict[int, list[dict[str, Any]]]
) -> list[dict[str, Any]]:
    names = {c.id: c.function.name for m in messages for c in m.tool_calls or ()}
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if m.role == "tool":
            assert m.tool_call_id is not None
            result = {
                "tool_call_id": m.tool_call_id,
                "name": names[m.tool_call_id],
                "content": _text(m.content),
            }
            block = f"<tool_response>\n{json.dumps(result, ensure_ascii=False)}\n</tool_response>"
            if i and messages[i - 1].role == "tool":  # results in a row share one turn
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
            continue
        message: dict[str, Any] = {"role": _role(m), "content": _content(m)}
        if m.name is not None:
            message["name"] = m.name
        if m.tool_calls:
            calls = [
                f"{OPEN}\n"
                + json.dumps({"name": c.function.name, "arguments": a}, ensure_ascii=False)
                + f"\n{CLOSE}"
                for c, a in zip(m.tool_calls, arguments[i], strict=True)
            ]
            text = _text(message["content"])
            message["content"] = "\n".join([text, *calls] if text else calls)
        out.append(message)
    return out


def _with_tools_section(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]], parallel: bool
) -> list[dict[str, Any]]:
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    section = f"{TOOLS_HEADER}\n<tools>\n{listing}\n</tools>\n{CALL_INSTRUCTIONS}"
    if not parallel:
        section += ONE_CALL
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0])
        text = _text(first["content"])
        first["content"] = f"{text}\n\n{section}" if text else section
        return [first, *messages[1:]]
    return [{"role": "system", "content": section}, *messages]


def _role(m: ChatMessage) -> str:
    return "system" if m.role == "developer" else m.role


def _text(content: Any) -> str:
    """Content parts joined as the template would join them (see chat_template)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return TEXT_PART_SEPARATOR.join(part["text"] for part in content)


def _missing(param: str) -> APIError:
    return APIError(
        400,
        f"Missing required parameter: '{param}'.",
        param=param,
        code="missing_required_parameter",
    )


def _needs_grammar(what: str, param: str) -> APIError:
    return APIError(
        400,
        f"Unsupported value: {what} needs grammar-constrained decoding, which this build does "
        "not have; use tool_choice 'auto' (calls parsed from the output) or 'none'.",
        param=param,
        code="unsupported_value",
    )
