"""Backend failures as the client should see them, in OpenAI's error shape."""

from __future__ import annotations

import logging

from starlette.responses import JSONResponse

from services.coordinator.errors import SERVER_ERROR, APIError, bad_request, unavailable
from services.coordinator.generation_backend import (
    BackendError,
    BackendRequestError,
    BackendUnavailable,
)
from services.coordinator.prepare.prepared import PreparedRequest

log = logging.getLogger(__name__)


def backend_api_error(exc: BaseException, prepared: PreparedRequest) -> APIError:
    """A backend failure as the client should see it."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, BackendUnavailable):
        return unavailable(str(exc), exc.retry_after_s)
    if isinstance(exc, BackendRequestError):
        param = prepared.param_names.get(exc.param, exc.param)
        return bad_request(exc.message, param)
    if isinstance(exc, BackendError):
        return APIError(
            502, f"The model backend failed: {exc}", type=SERVER_ERROR, code="backend_error"
        )
    log.error("unexpected error serving %s", prepared.response_id, exc_info=exc)
    return APIError(
        500, "The server had an internal error.", type=SERVER_ERROR, code="internal_error"
    )


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)
