"""Tool calls parsed from a reply's text (`tool_choice: "auto"`), as the text arrives.

The model calls a function by writing one block per call:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

the format the fallback prompt asks for (`chat_prompt`) and the one Hermes- and Qwen-style
templates teach their models (`"parameters"` is read as `"arguments"` too). A block whose JSON
does not parse, names a function that was not offered or has no arguments object stays in
the content as text, so nothing the model wrote is lost. With `parallel_tool_calls: false`
only the first block is a call; later ones stay text.

The same splitter serves a stream and a whole reply (the whole reply is one delta), so both
give the same content and calls. Text that could still be the start of a block is held back
until it is known not to be one; whitespace around calls is not content.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


@dataclass(frozen=True)
class ToolCallParsing:
    """What a request's output is parsed for: calls to these functions."""

    names: frozenset[str]
    parallel: bool = True
    # tool_choice "required" or named: the whole reply is the call(s), as JSON the workers'
    # grammar enforces (prepare/tool_call_schema.py), read once the reply has ended.
    forced: bool = False


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def message_entry(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }

    def delta_entry(self, index: int) -> dict[str, Any]:
        """The whole call in one streamed delta (OpenAI may split `arguments` over several;
        clients concatenate them, so one is the same call)."""
        return {"index": index, **self.message_entry()}


def parse_call(body: str, names: frozenset[str]) -> ToolCall | None:
    """The call in one block's text, or None if it is not a call to an offered function."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


@dataclass
class Split:
    """What a piece of reply text turned out to be."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class ToolCallSplitter:
    """Splits one choice's text deltas into content and tool calls."""

    def __init__(self, parsing: ToolCallParsing):
        self.parsing = parsing
        self.calls: list[ToolCall] = []  # every call so far, in order
        self._buffer = ""  # text not yet classified
        self._in_call = False  # the buffer is the inside of an open block
        self._blank = ""  # whitespace held back: content only if more content follows
        self._after_call = False  # the last thing found was a call (its gap is no content)

    def feed(self, text: str) -> Split:
        self._buffer += text
        if self.parsing.forced:
            return Split()  # JSON until the reply ends: nothing is content or a call before
        out = Split()
        while self._buffer:
            if self._in_call:
                end = self._buffer.find(CLOSE)
                if end < 0:
                    break  # the block goes on
                body, self._buffer = self._buffer[:end], self._buffer[end + len(CLOSE) :]
                self._in_call = False
                call = parse_call(body, self.parsing.names)
                if call is None:
                    self._content(out, OPEN + body + CLOSE)
                else:
                    self._blank, self._after_call = "", True
                    self.calls.append(call)
                    out.calls.append(call)
                continue
            start = self._buffer.find(OPEN) if self._accepts_calls else -1
            if start >= 0:
                self._content(out, self._buffer[:start])
                self._buffer = self._buffer[start + len(OPEN) :]
                self._in_call = True
                continue
            keep = _partial_open(self._buffer) if self._accepts_calls else 0
            self._content(out, self._buffer[: len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep :]
            break
        return out

    def finish(self) -> Split:
        """The rest once the reply ended: an unclosed block or a held prefix is content."""
        if self.parsing.forced:
            return self._forced()
        out = Split()
        rest = (OPEN if self._in_call else "") + self._buffer
        self._buffer, self._in_call = "", False
        self._content(out, rest)
        if not self.calls and self._blank:
            out.content += self._blank
        self._blank = ""
        return out

    def _forced(self) -> Split:
        """A forced reply: the calls, or (cut short by max_tokens) its text as content."""
        text, self._buffer = self._buffer, ""
        try:
            value = json.loads(text)
        except ValueError:
            return Split(content=text)
        items = value if isinstance(value, list) else [value]
        calls = [parse_call(json.dumps(item), self.parsing.names) for item in items]
        if not calls or any(c is None for c in calls):
            return Split(content=text)
        self.calls = [c for c in calls if c is not None]
        return Split(calls=list(self.calls))

    @property
    def _accepts_calls(self) -> bool:
        return self.parsing.parallel or not self.calls

    def _content(self, out: Split, text: str) -> None:
        # Whitespace at either end is held, as it arrives: it is content only between content.
        held = self._blank + text
        core = held.strip()
        if not core:
            self._blank = held
            return
        lead = held[: len(held) - len(held.lstrip())]
        out.content += ("" if self._after_call else lead) + core
        self._blank = held[len(held.rstrip()) :]
        self._after_call = False


def _partial_open(text: str) -> int:
    """Length of the longest end of `text` that is a proper start of OPEN."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:n]):
            return n
    return 0
