"""Request bodies of the OpenAI endpoints, validated with pydantic.

Types are strict (no "5" for 5, no 1 for true): OpenAI answers such bodies with a 400 naming
the parameter, and a client sending them has a bug worth hearing about. `null` for a field
that has a default means that default (OpenAI's schema marks most fields nullable). Unknown
fields are ignored; the known ones this server does not implement are refused before this
(`unsupported`). Fields that accept several shapes (`stop`, `prompt`, message `content`,
`tool_choice`) are checked by one function each, so an error names the field the client sent
rather than a pydantic union member. Checks that span fields (a tool message answering an
earlier call, a named tool being offered) are made where the prompt is built (`chat_prompt`).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from services.coordinator.service_tiers import VALID_TIERS

# Strict floats still take JSON integers (`"temperature": 1`), never strings or booleans.
Number = StrictFloat


def _invalid(message: str) -> PydanticCustomError:
    return PydanticCustomError("invalid_value", message)


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return tuple(value)
    raise _invalid("must be a string or an array of strings")


def _content(value: Any) -> str | list[dict[str, str]]:
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _invalid("must be a string or an array of text content parts")
    for index, part in enumerate(value):
        if not isinstance(part, dict) or "type" not in part:
            raise _invalid(f"content part {index} must be an object with a 'type'")
        if part["type"] != "text":
            raise _invalid(
                f"content part {index} has type {part['type']!r}; this model accepts only "
                "'text' parts"
            )
        if not isinstance(part.get("text"), str):
            raise _invalid(f"content part {index} needs a string 'text'")
    return [{"type": "text", "text": part["text"]} for part in value]


def _prompt(value: Any) -> list[str | list[int]]:
    """One or more prompts, each text or token ids."""

    def is_ids(v: Any) -> bool:
        return isinstance(v, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in v
        )

    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if is_ids(value):
            return [value]
        if all(isinstance(p, str) for p in value):
            return list(value)
        if all(is_ids(p) for p in value):
            return list(value)
    if isinstance(value, list) and not value:
        raise _invalid("must not be empty")
    raise _invalid(
        "must be a string, an array of strings, an array of token ids, or an array of arrays "
        "of token ids"
    )


Stop = Annotated[str | list[str] | None, PlainValidator(_stop)]
Content = Annotated[str | list[dict[str, str]], PlainValidator(_content)]
Prompt = Annotated[str | list[str] | list[int] | list[list[int]], PlainValidator(_prompt)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {
            key: value
            for key, value in data.items()
            if value is not None or key not in fields or fields[key].is_required()
        }


class StreamOptions(_Body):
    include_usage: StrictBool = False
    # Usage on every chunk, not only on a final one (a common extension).
    continuous_usage_stats: StrictBool = False


class FunctionCall(_Body):
    name: StrictStr
    arguments: StrictStr  # JSON text, as the model wrote it


class AssistantToolCall(_Body):
    id: StrictStr
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Body):
    # `developer` is OpenAI's newer name for `system`. Which fields each role needs (content,
    # or tool_calls for an assistant; tool_call_id for a tool) is checked in `chat_prompt`.
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content | None = None
    name: StrictStr | None = None
    tool_calls: list[AssistantToolCall] | None = None  # assistant turns
    tool_call_id: StrictStr | None = None  # tool turns: the call this answers
    refusal: StrictStr | None = None  # an assistant turn that refused


MAX_TOOLS = 128  # OpenAI's limit
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


class FunctionDefinition(_Body):
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema for the arguments object
    strict: StrictBool | None = None

    @field_validator("name")
    @classmethod
    def _valid_name(cls, value: str) -> str:
        if not _FUNCTION_NAME.fullmatch(value):
            raise _invalid(
                f"must be 1 to 64 letters, digits, underscores or dashes, got {value[:80]!r}"
            )
        return value

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        # A function takes one arguments object; a schema for anything else cannot describe it.
        if value is not None and value.get("type", "object") != "object":
            raise _invalid(
                f"must be a JSON Schema of type 'object' (the arguments object), "
                f"got type {value['type']!r}"
            )
        return value


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: dict[str, StrictStr]

    @field_validator("function")
    @classmethod
    def _has_name(cls, value: dict[str, str]) -> dict[str, str]:
        if "name" not in value:
            raise _invalid("must name the function: {'name': ...}")
        return value


ToolChoiceMode = Literal["none", "auto", "required"]


def _tool_choice(value: Any) -> ToolChoiceMode | NamedToolChoice:
    if value in ("none", "auto", "required"):
        return value
    if isinstance(value, dict):
        if value.get("type") != "function":
            raise _invalid(
                f"an object tool_choice must have type 'function', got {value.get('type')!r}"
            )
        return NamedToolChoice.model_validate(value)
    raise _invalid(
        "must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}"
    )


ToolChoice = Annotated[ToolChoiceMode | NamedToolChoice, PlainValidator(_tool_choice)]


class Fallback(_Body):
    ttft_timeout: Number  # ms

    @field_validator("ttft_timeout")
    @classmethod
    def _positive(cls, value: float) -> float:
        if value <= 0:
            raise _invalid(f"must be a positive number of milliseconds, got {value}")
        return float(value)


def _metadata(value: Any) -> dict[str, str] | None:
    # OpenAI's request metadata: at most 16 string pairs, keys to 64 and values to 512 chars.
    if value is None:
        return None
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise _invalid("must be an object mapping strings to strings")
    if len(value) > 16:
        raise _invalid(f"may hold at most 16 pairs, got {len(value)}")
    for key, item in value.items():
        if len(key) > 64 or len(item) > 512:
            raise _invalid(f"key {key[:64]!r}: keys may be 64 and values 512 characters long")
    return dict(value)


Metadata = Annotated[dict[str, str] | None, PlainValidator(_metadata)]


class JsonSchemaFormat(_Body):
    """`response_format.json_schema`, as OpenAI defines it."""

    name: StrictStr
    description: StrictStr | None = None
    # `schema` would shadow a BaseModel attribute; the wire name stays `schema`.
    schema_: dict[str, Any] = Field(alias="schema")
    # Honoured either way: the grammar enforces the schema whether or not `strict` is set.
    strict: StrictBool | None = None

    @field_validator("name")
    @classmethod
    def _valid_name(cls, value: str) -> str:
        # OpenAI: a-z, A-Z, 0-9, underscores and dashes, at most 64 characters.
        if (
            not value
            or len(value) > 64
            or not all(c.isascii() and (c.isalnum() or c in "_-") for c in value)
        ):
            raise _invalid("must be 1 to 64 characters of a-z, A-Z, 0-9, underscores and dashes")
        return value


class ResponseFormat(_Body):
    """`response_format`: `text` (the default), `json_object` or `json_schema`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _GenerationBody(_Body):
    """Fields the two endpoints share."""

    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    min_p: Number | None = None
    repetition_penalty: Number | None = None
    frequency_penalty: Number | None = None
    presence_penalty: Number | None = None
    seed: StrictInt | None = None
    stop: Stop = ()
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool = False
    n: StrictInt | None = None
    user: StrictStr | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    service_tier: StrictStr | None = None
    # Models to try in order (`model`, when given and different, goes first), and when to
    # give up on one that has not produced its first token.
    models: list[StrictStr] | None = None
    fallback: Fallback | None = None
    metadata: Metadata = None
    response_format: ResponseFormat | None = None

    @field_validator("models")
    @classmethod
    def _some_models(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and not value:
            raise _invalid("must name at least one model")
        return value

    @field_validator("service_tier")
    @classmethod
    def _known_tier(cls, value: str | None) -> str | None:
        if value is not None and value not in VALID_TIERS:
            raise _invalid(f"must be one of {', '.join(VALID_TIERS)}; got {value!r}")
        return value


class ChatCompletionRequest(_GenerationBody):
    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None  # default: "auto" with tools, "none" without
    parallel_tool_calls: StrictBool = True

    @field_validator("tools")
    @classmethod
    def _tool_limits(cls, value: list[Tool] | None) -> list[Tool] | None:
        if value is None:
            return value
        if len(value) > MAX_TOOLS:
            raise _invalid(f"may hold at most {MAX_TOOLS} tools, got {len(value)}")
        names = [t.function.name for t in value]
        duplicate = next((n for n in names if names.count(n) > 1), None)
        if duplicate is not None:
            raise _invalid(f"function names must be unique; {duplicate!r} appears twice")
        return value

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, value: list[ChatMessage]) -> list[ChatMessage]:
        if not value:
            raise _invalid("must contain at least one message")
        return value


class CompletionRequest(_GenerationBody):
    prompt: Prompt
    echo: StrictBool = False
    logprobs: StrictInt | None = None  # number of alternatives per token, as in OpenAI's API
    best_of: StrictInt | None = None
