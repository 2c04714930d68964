"""Reading a request body: size limit, strict UTF-8, JSON object — each refusal in API shape.

Hostile bodies are refused here, before anything walks them: a body nested deeper than
MAX_JSON_DEPTH, or so deep that the parser itself gives up, would otherwise reach code that
recurses over it (validation, the chat template's `tojson`, span attributes) and fail there
as a 500, and a 500 closes the keep-alive connection it arrived on.
"""

from __future__ import annotations

import json
import math
import re
from itertools import accumulate
from typing import Any

from starlette.requests import Request

from services.coordinator.errors import APIError, bad_request

# Arrays/objects inside one another, counting the body itself as 1. Legitimate requests nest far
# less: a tool whose parameter schema is ten objects deep is about 25 levels of request JSON.
MAX_JSON_DEPTH = 64


async def read_json_object(request: Request, max_bytes: int) -> dict[str, Any]:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > max_bytes:  # chunked uploads declare no length: count as they arrive
            raise _too_large(max_bytes)
    try:
        text = bytes(body).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(
            f"The request body is not valid UTF-8 (bad byte at offset {exc.start}).",
            code="invalid_encoding",
        ) from exc
    if not text.strip():
        raise bad_request("The request body is empty; expected a JSON object.", code="invalid_json")
    try:
        data = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except RecursionError as exc:  # nested past the interpreter's recursion limit
        raise _too_deep() from exc
    except (json.JSONDecodeError, ValueError) as exc:
        raise bad_request(
            f"The request body is not valid JSON: {exc}.", code="invalid_json"
        ) from exc
    if not isinstance(data, dict):
        raise bad_request("The request body must be a JSON object.", code="invalid_json")
    if nested_deeper_than(text, MAX_JSON_DEPTH):
        raise _too_deep()
    if "\\ud" in text.lower() and _has_lone_surrogate(data):
        raise bad_request(
            "The request body contains an unpaired UTF-16 surrogate escape (\\ud800-\\udfff), "
            "which is not valid Unicode text.",
            code="invalid_encoding",
        )
    return data


def _has_lone_surrogate(data: Any) -> bool:
    # JSON escapes can spell a lone surrogate, which no tokenizer (or UTF-8 reply) can carry;
    # properly paired escapes were already combined into one character by the parser.
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


# For measuring nesting on the text of a body already parsed (so valid JSON): escapes out,
# then string literals out, then only the brackets are left.
_ESCAPE = re.compile(r"\\.", re.DOTALL)
_STRING = re.compile(r'"[^"]*"')


class _OnlyBrackets(dict):
    """A str.translate table: [ and { become +, ] and } become -, everything else goes."""

    def __missing__(self, key: int) -> None:
        return None


_BRACKETS = _OnlyBrackets({ord("["): "+", ord("{"): "+", ord("]"): "-", ord("}"): "-"})
_STEP = {"+": 1, "-": -1}


def nested_deeper_than(text: str, limit: int) -> bool:
    """Whether arrays/objects in `text` (valid JSON) nest more than `limit` levels.

    On the text, not the parsed value: a walk over the parsed value costs Python work per
    container, up to twice the parse itself for a 4 MiB body of small arrays, while these are
    C-speed passes (about 0.1 s for the worst 4 MiB body, nothing for an ordinary one).
    """
    if text.count("[") + text.count("{") <= limit:  # too few brackets to nest that deep
        return False
    brackets = _STRING.sub("", _ESCAPE.sub("", text)).translate(_BRACKETS)
    return max(accumulate(map(_STEP.__getitem__, brackets)), default=0) > limit


def _too_deep() -> APIError:
    return bad_request(
        f"The request body nests arrays and objects more than {MAX_JSON_DEPTH} levels deep.",
        code="invalid_json",
    )


def _finite_float(text: str) -> float:
    # 1e999 parses to inf, which no parameter takes and JSON cannot send back.
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:32]} is out of range")
    return value


def _reject_constant(name: str) -> Any:
    # Python's json accepts NaN and Infinity; JSON does not, and no parameter takes them.
    raise ValueError(f"{name} is not a valid JSON value")


def _too_large(max_bytes: int) -> APIError:
    return APIError(
        413,
        f"The request body exceeds this server's limit of {max_bytes} bytes.",
        code="request_too_large",
    )
