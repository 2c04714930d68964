"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Everything a client can cause ends up as an `APIError` with the status code and the request
parameter to blame, spelled the way the client spelled it (`messages[2].role`, not a pydantic
location tuple or an engine-internal name).
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import ValidationError

# OpenAI's own error types: client mistakes (400/401/404/413) are all "invalid_request_error"
# and told apart by `code`; failures on our side (5xx) are "server_error".
INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code or "invalid_value")


def unavailable(message: str, retry_after_s: float) -> APIError:
    # Retry-After takes whole seconds; never tell a client to retry "now" in a tight loop.
    seconds = max(1, math.ceil(retry_after_s))
    return APIError(
        503,
        message,
        type=SERVER_ERROR,
        code="service_unavailable",
        headers={"Retry-After": str(seconds)},
    )


def param_path(loc: tuple[int | str, ...]) -> str:
    """('messages', 2, 'role') -> 'messages[2].role'."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path


def from_validation_error(exc: ValidationError) -> APIError:
    """The first pydantic error as a 400 naming the field the client sent."""
    first = exc.errors(include_url=False)[0]
    param = param_path(tuple(first["loc"])) or None
    kind = first["type"]
    msg = first["msg"]
    if kind == "missing":
        return APIError(
            400,
            f"Missing required parameter: '{param}'.",
            param=param,
            code="missing_required_parameter",
        )
    if kind.endswith("_type"):
        if kind in ("model_type", "model_attributes_type", "dict_type"):
            msg = "expected an object"  # not pydantic's class names
        return APIError(
            400,
            f"Invalid type for '{param}': {_lower_first(msg)}, "
            f"got {_json_type(first.get('input'))}.",
            param=param,
            code="invalid_type",
        )
    return APIError(400, f"Invalid value for '{param}': {msg}", param=param, code="invalid_value")


def _lower_first(text: str) -> str:
    return text[:1].lower() + text[1:]


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__
