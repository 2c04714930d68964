"""The output constraint for a forced tool call (OpenAI `tool_choice: "required"` or a named
function): a JSON value naming one of the tools, with arguments that match that function's
`parameters` schema. It is an ordinary JSON-schema constraint, so everything structured
outputs do (masks in mixed batches, speculation, migration) applies to it unchanged.

The reply has the shape ``{"name": "<function>", "arguments": {...}}``, or with parallel calls
an array of one or more of those; `parse_tool_calls` turns it into (name, arguments JSON)
pairs for `message.tool_calls`. Torch-free: the coordinator builds it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from shared.sampling.structured import StructuredOutput, canonical_json

MAX_TOOLS = 128


class ToolChoiceError(ValueError):
    """A tool definition or tool_choice that cannot be enforced; `param` names it."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def tool_call_output(
    tools: Sequence[dict[str, Any]], tool_choice: str | dict[str, Any], parallel: bool = False
) -> StructuredOutput | None:
    """The constraint for `tool_choice` over `tools` (OpenAI's request shapes); None for
    "none" and "auto", which no grammar enforces ("auto" is parsed from free output)."""
    functions = _functions(tools)
    if tool_choice in ("none", "auto"):
        return None
    if tool_choice == "required":
        chosen = functions
    elif isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if name not in functions:
            raise ToolChoiceError(
                "tool_choice", f"tool_choice names function {name!r}, which is not in tools"
            )
        chosen = {name: functions[name]}
    else:
        raise ToolChoiceError(
            "tool_choice",
            'must be "none", "auto", "required" or {"type": "function", "function": {"name": '
            f"...}}}}, got {tool_choice!r}",
        )
    if not chosen:
        raise ToolChoiceError("tools", f"tool_choice {tool_choice!r} needs at least one tool")
    branches = [_call_schema(name, parameters) for name, parameters in chosen.items()]
    call = branches[0] if len(branches) == 1 else {"anyOf": branches}
    schema = {"type": "array", "items": call, "minItems": 1} if parallel else call
    return StructuredOutput("json_schema", canonical_json(schema))


def parse_tool_calls(text: str) -> list[tuple[str, str]]:
    """(function name, arguments as JSON text) for each call in a constrained reply."""
    value = json.loads(text)
    calls = value if isinstance(value, list) else [value]
    return [(c["name"], canonical_json(c["arguments"])) for c in calls]


def _functions(tools: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    if len(tools) > MAX_TOOLS:
        raise ToolChoiceError("tools", f"at most {MAX_TOOLS} tools are allowed, got {len(tools)}")
    functions: dict[str, dict[str, Any]] = {}
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ToolChoiceError(f"{where}.type", "only tools of type 'function' are supported")
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ToolChoiceError(f"{where}.function.name", "every function needs a name")
        name = function["name"]
        if name in functions:
            raise ToolChoiceError(f"{where}.function.name", f"function {name!r} is defined twice")
        # A function without parameters takes none: an empty object.
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict) or parameters.get("type") != "object":
            raise ToolChoiceError(
                f"{where}.function.parameters", "must be a JSON schema of type 'object'"
            )
        functions[name] = parameters
    return functions


def _call_schema(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
