"""Request fields that would change the output but that this server does not implement.

A client that sends one asked for something specific (audio, a predicted output, a JSON
reply, beam search); answering with ordinary text as if it had not asked hands it output it
cannot use, with nothing saying so. Each such field is refused with a 400 naming it, unless
it is absent, null, or holds the value that means what this server does anyway (listed
beside it). Fields that do not change the output (`user`, `metadata`, `store`,
`prompt_cache_key`, `safety_identifier`) are accepted; other unknown fields are ignored, as
OpenAI-compatible servers do. README's table lists what is honoured.

The check runs on the body as sent, before validation, so the error names the field exactly
as the client spelled it.
"""

from __future__ import annotations

import json
from typing import Any

from services.coordinator.errors import APIError, bad_request
from services.coordinator.prepare.prepared import Endpoint

# Both endpoints. vLLM's extensions are listed too: clients written for vLLM send them.
_COMMON: dict[str, tuple[Any, ...]] = {
    "logit_bias": ({},),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "guided_decoding_backend": (),
    "guided_whitespace_pattern": (),
    "structured_outputs": (),
    "min_tokens": (0,),
    "bad_words": ([],),
    "allowed_token_ids": (),
    "logits_processors": (),
    "use_beam_search": (False,),
    "length_penalty": (1, 1.0),
    "prompt_logprobs": (),
    "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "truncate_prompt_tokens": (),
    "return_tokens_as_token_ids": (False,),
}

_UNSUPPORTED: dict[Endpoint, dict[str, tuple[Any, ...]]] = {
    "chat": {
        **_COMMON,
        "audio": (),
        "modalities": (["text"],),
        "prediction": (),
        "web_search_options": (),
        "functions": (),  # the deprecated forerunners of `tools` and `tool_choice`
        "function_call": ("none",),
        "reasoning_effort": (),  # no served model reasons before it answers
        "verbosity": (),
        # vLLM's chat extensions
        "echo": (False,),
        "add_generation_prompt": (True,),
        "continue_final_message": (False,),
        "chat_template": (),
        "chat_template_kwargs": ({},),
        "documents": (),
    },
    "completion": {
        **_COMMON,
        "suffix": ("",),
    },
}

# `response_format`: the types OpenAI defines; JSON output is enforced by the workers'
# grammar-constrained decoding (engine/grammar).
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")


def refuse_unsupported(body: dict[str, Any], endpoint: Endpoint) -> None:
    """Raise a 400 for the first field that asks for behaviour this server lacks."""
    for name, allowed in _UNSUPPORTED[endpoint].items():
        value = body.get(name)
        if value is None or any(_same(value, a) for a in allowed):
            continue
        raise APIError(
            400,
            f"Unsupported parameter: '{name}' is not supported by this server"
            + (f" (only {_show(allowed)} is)." if allowed else "."),
            param=name,
            code="unsupported_parameter",
        )
    _check_response_format(body.get("response_format"))


def _check_response_format(value: Any) -> None:
    if not isinstance(value, dict):
        return  # not an object at all: the schema's own error names the field
    kind = value.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise bad_request(
            f"Invalid value for 'response_format.type': must be one of "
            f"{', '.join(RESPONSE_FORMAT_TYPES)}, got {kind!r}",
            "response_format.type",
        )


def _same(value: Any, allowed: Any) -> bool:
    # `True == 1` in Python; a boolean where a number is meant is not the number.
    return type(value) is type(allowed) and value == allowed


def _show(values: tuple[Any, ...]) -> str:
    return " or ".join(json.dumps(v) for v in values)
