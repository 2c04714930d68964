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
promise a call whose arguments match the schema: the tools are rendered as for "auto", and
the reply is constrained by a grammar to the call's JSON (`tool_constraint`, enforced by the
workers), read back whole when it ends.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from services.coordinator.errors import APIError, bad_request
from services.coordinator.prepare.schemas import ChatCompletionRequest, ChatMessage
from services.coordinator.prepare.tool_call_schema import ToolChoiceError, tool_call_output
from services.coordinator.prepare.tool_calls import CLOSE, OPEN, ToolCallParsing
from shared.sampling.structured import StructuredOutput
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
    # `tool_choice` "required" or a named function: the grammar the reply must follow.
    tool_constraint: StructuredOutput | None = None


def render_chat(body: ChatCompletionRequest, tokenizer: Tokenizer) -> ChatPrompt:
    """The prompt text and how to read the reply; a 400 naming the field for bad input."""
    _check_messages(body.messages)
    offered, forced = _offered_tools(body)
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
    parsing, constraint = None, None
    if offered:
        names = frozenset(t["function"]["name"] for t in offered)
        parsing = ToolCallParsing(names, body.parallel_tool_calls, forced=forced)
    if forced:
        choice = body.tool_choice
        if not isinstance(choice, str):
            choice = {"type": "function", "function": dict(choice.function)}
        try:
            constraint = tool_call_output(offered, choice, parallel=body.parallel_tool_calls)
        except ToolChoiceError as exc:
            raise bad_request(str(exc), exc.param) from exc
    return ChatPrompt(text, parsing, constraint)


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


def _offered_tools(body: ChatCompletionRequest) -> tuple[list[dict[str, Any]], bool]:
    """The tools to render (OpenAI's shape), after checking `tool_choice` against them, and
    whether the reply must be a call (required or named: enforced by a grammar)."""
    choice = body.tool_choice
    if not body.tools:
        if choice is not None and choice != "none":
            raise bad_request("tool_choice is only allowed when tools are specified", "tool_choice")
        return [], False
    if isinstance(choice, str) or choice is None:
        mode = choice or "auto"
    else:
        name = choice.function["name"]
        if name not in {t.function.name for t in body.tools}:
            raise bad_request(
                f"tool_choice names function {name!r}, which is not in tools", "tool_choice"
            )
        mode = "named"
    if mode == "none":
        return [], False
    forced = mode in ("required", "named")
    for i, tool in enumerate(body.tools):
        if tool.function.strict and not forced:  # arguments guaranteed to match the schema
            raise _strict_needs_forcing(f"tools[{i}].function.strict")
    return [tool.model_dump(exclude_none=True) for tool in body.tools], forced


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


def _strict_needs_forcing(param: str) -> APIError:
    return APIError(
        400,
        "Unsupported value: strict function arguments are enforced when the reply must be a "
        "call (tool_choice 'required' or a named function); with 'auto' the model may answer "
        "in text, which no grammar constrains.",
        param=param,
        code="unsupported_value",
    )
