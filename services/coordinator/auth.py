"""Bearer API keys on the /v1 endpoints."""

from __future__ import annotations

import hmac

from starlette.requests import Request

from services.coordinator.errors import APIError


def check_api_key(request: Request, keys: tuple[str, ...]) -> None:
    """Raise a 401 unless `keys` is empty or the request bears one of them."""
    if not keys:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise _unauthorized(
            "You didn't provide an API key. Send it in an Authorization header: "
            "'Authorization: Bearer YOUR_KEY'."
        )
    offered = token.encode()
    # Compare against every key, without stopping at a match, so timing says nothing about
    # which key (or how much of one) matched.
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(offered, key.encode())
    if not matched:
        raise _unauthorized("Incorrect API key provided.")


def _unauthorized(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
