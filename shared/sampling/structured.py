"""What a request's output must be (OpenAI `response_format`), as the workers receive it.

The coordinator checks the shape of `response_format` and sends the schema as JSON text; the
grammar itself is compiled on the workers (`engine.grammar`), where the tokenizer and the
sampler are. This record is plain data so that the coordinator can build it without loading
the grammar engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

OutputKind = Literal["json_object", "json_schema"]
OUTPUT_KINDS: tuple[OutputKind, ...] = ("json_object", "json_schema")
# Schemas beyond this are refused before anything compiles them (OpenAI caps theirs too).
MAX_SCHEMA_CHARS = 100_000


class StructuredOutputError(ValueError):
    """A malformed structured-output spec; the API reports it on `response_format`."""


@dataclass(frozen=True)
class StructuredOutput:
    kind: OutputKind
    # The JSON schema as compact JSON text, keys in the client's order (the output's
    # properties follow it); the text is the workers' cache key for the compiled grammar.
    # Empty for `json_object`.
    schema: str = ""
    # The last `replay_tokens` tokens of the prompt were generated under this constraint by
    # an earlier attempt (a migration, or a first token whose KV never arrived): the
    # grammar state is rebuilt by feeding them through it before anything is sampled.
    replay_tokens: int = 0

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def json_schema(cls, schema: dict) -> StructuredOutput:
        return cls("json_schema", canonical_json(schema))

    def validate(self) -> None:
        if self.kind not in OUTPUT_KINDS:
            raise StructuredOutputError(
                f"type must be one of {', '.join(OUTPUT_KINDS)}, got {self.kind!r}"
            )
        if self.kind == "json_object" and self.schema:
            raise StructuredOutputError("json_object takes no schema")
        if self.kind == "json_schema":
            if len(self.schema) > MAX_SCHEMA_CHARS:
                raise StructuredOutputError(
                    f"the schema is {len(self.schema)} characters; at most "
                    f"{MAX_SCHEMA_CHARS} are allowed"
                )
            try:
                parsed = json.loads(self.schema)
            except json.JSONDecodeError as exc:
                raise StructuredOutputError(f"the schema is not valid JSON: {exc}") from exc
            if not isinstance(parsed, dict):
                raise StructuredOutputError("the schema must be a JSON object")
        if not isinstance(self.replay_tokens, int) or self.replay_tokens < 0:
            raise StructuredOutputError(
                f"replay_tokens must be a non-negative integer, got {self.replay_tokens!r}"
            )

    @property
    def grammar_key(self) -> tuple[str, str]:
        """What the compiled grammar depends on (not on where generation resumes)."""
        return (self.kind, self.schema)


def canonical_json(value: object) -> str:
    # Not sorted: a schema's property order is the order the output's properties come in.
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
