"""The last-resort handler: an exception nothing else caught becomes OpenAI's 500 body.

Pure ASGI middleware rather than an `exception_handler(Exception)`: Starlette routes that
handler through its outermost middleware, which sends the 500 and then re-raises, and uvicorn
closes the connection of any request whose application raised. Answered here, the exception
ends with the response and the client's keep-alive connection stays usable. (Once a response
has begun, half of it is on the wire and closing the connection is the only honest end:
that case is re-raised. Streams catch their own errors and end with an SSE error event.)
"""

from __future__ import annotations

import logging

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.coordinator.errors import SERVER_ERROR, error_body

log = logging.getLogger(__name__)


class LastResortErrors:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:
            if started:
                raise
            log.error(
                "unhandled error on %s %s", scope.get("method"), scope.get("path"), exc_info=exc
            )
            body = error_body(
                "The server had an internal error.", SERVER_ERROR, None, "internal_error"
            )
            await JSONResponse(body, status_code=500)(scope, receive, send)
