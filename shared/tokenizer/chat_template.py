"""Rendering a conversation into the prompt text the model was fine-tuned on.

The template ships inside the GGUF (`tokenizer.chat_template`), so it is untrusted input: it
runs in Jinja's immutable sandbox, where it can read the messages but not reach Python.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, NoReturn

import jinja2
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

# OpenAI-style content parts are joined the way other OpenAI-compatible servers flatten them
# for text-only templates, so the same request yields the same prompt here and there.
TEXT_PART_SEPARATOR = "\n"


def _raise_exception(message: str) -> NoReturn:
    # Templates call this to refuse a conversation (e.g. roles out of order).
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None) -> str:
    # Jinja's own `tojson` HTML-escapes '<', '>' and '&', which would corrupt a prompt.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _flatten_content(content: Any, index: int) -> str:
    if content is None:  # an assistant turn that only made tool calls
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise ValueError(
                    f"messages[{index}]: content part of type {kind!r} is not supported; "
                    "this model accepts text parts only"
                )
            if not isinstance(part.get("text"), str):
                raise ValueError(f"messages[{index}]: a text content part needs a string 'text'")
            texts.append(part["text"])
        return TEXT_PART_SEPARATOR.join(texts)
    raise ValueError(
        f"messages[{index}]: content must be a string or a list of text parts, "
        f"not {type(content).__name__}"
    )


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Copies of the messages with `content` as a plain string; other keys pass through."""
    normalized = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{index}] must be an object, not {type(message).__name__}")
        if not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{index}] needs a string 'role'")
        flat = dict(message)
        flat["content"] = _flatten_content(message.get("content"), index)
        normalized.append(flat)
    return normalized


class ChatTemplate:
    """A compiled chat template together with the special tokens it may refer to."""

    def __init__(self, source: str, *, bos_token: str, eos_token: str, origin: str) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        env.filters["tojson"] = _tojson
        try:
            self._template = env.from_string(source)
            variables = jinja2.meta.find_undeclared_variables(env.parse(source))
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"{origin}: the chat template does not compile: {e}") from e
        # A template that reads `tools` renders tool definitions (and, by the Hugging Face
        # convention such templates follow, tool calls and tool results) itself.
        self.supports_tools = "tools" in variables
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The prompt text; ValueError if the messages are malformed or the template refuses.

        `tools` (OpenAI's `{"type": "function", "function": {...}}` objects) reach only a
        template that `supports_tools`; the caller renders them some other way otherwise.
        """
        if not messages:
            raise ValueError("messages must not be empty")
        if tools and not self.supports_tools:
            raise ValueError("this chat template does not render tools")
        extra = {"tools": list(tools)} if tools else {}  # absent, not null, as before tools
        try:
            return self._template.render(
                messages=normalize_messages(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **extra,
            )
        except jinja2.TemplateError as e:  # raise_exception, sandbox violations, undefined keys
            raise ValueError(f"the chat template rejected the conversation: {e}") from e
