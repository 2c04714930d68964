"""Bearer API keys on the /v1 endpoints: the 401 a missing or wrong key gets.

Which key a request bears, and what it may do, is `entitlements.KeyRing`'s job.
"""

from __future__ import annotations

from services.coordinator.errors import APIError


def unauthorized(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
