"""The coordinator's OpenAI-compatible HTTP surface over a `GenerationBackend`.

`/v1/chat/completions`, `/v1/completions` and `/v1/models` behave as OpenAI's do (bodies,
SSE streaming, usage, errors); `/tokenize`, `/detokenize` and `/tokenizer_info` as vLLM's
do (for evaluation harnesses); `/health` (liveness), `/ready` (the backend can serve) and
`/metrics` (Prometheus) are for operators and need no API key. `/playground` is the browser
playground (services/coordinator/playground/routes.py), when the settings enable it.
"""

from __future__ import annotations

from fastapi import FastAPI
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from services.coordinator.api.failures import error_response
from services.coordinator.api.handlers import GenerationHandler
from services.coordinator.api.last_resort import LastResortErrors
from services.coordinator.api.metrics import APIMetrics
from services.coordinator.api.tokenizer_routes import add_tokenizer_routes
from services.coordinator.errors import INVALID_REQUEST, APIError, error_body
from services.coordinator.generation_backend import GenerationBackend, ModelInfo
from services.coordinator.keys import KeyRing
from services.coordinator.playground.routes import PlaygroundSources, add_playground
from services.coordinator.route.saved_routers import PREFIX as ROUTER_PREFIX
from services.coordinator.settings import APISettings
from shared.telemetry.tracing import Tracing

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def create_app(
    backend: GenerationBackend,
    settings: APISettings | None = None,
    tracing: Tracing | None = None,
    playground: PlaygroundSources | None = None,
) -> FastAPI:
    """An app serving `backend`; the caller owns the backend's (and tracing's) lifecycle.
    `playground`: where the playground's fleet and trace views read (default: the traces
    `tracing` keeps, no fleet)."""
    settings = settings or APISettings()
    metrics = APIMetrics()
    if tracing is not None:
        tracing.register_metrics(metrics.registry)  # span drops are counted on /metrics
    handler = GenerationHandler(backend, settings, metrics, tracing)
    keyring = settings.keyring
    app = FastAPI(title="splitserve coordinator", docs_url=None, redoc_url=None)
    app.add_middleware(LastResortErrors)  # inside Starlette's own, which would drop the connection
    app.state.backend = backend
    app.state.settings = settings
    app.state.metrics = metrics
    _add_error_shapes(app)
    _add_generation_routes(app, handler)
    _add_model_routes(app, backend, handler, keyring)
    add_tokenizer_routes(app, backend, settings)
    _add_operator_routes(app, backend, metrics)
    if settings.playground_enabled:
        if playground is None:
            playground = PlaygroundSources(traces=tracing.recent if tracing else None)
        add_playground(app, keyring, playground)
    return app


def _add_error_shapes(app: FastAPI) -> None:
    """Every error, ours or Starlette's, in OpenAI's shape."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        # Unknown routes and wrong methods, in the same shape as every other error.
        message = f"{exc.detail} ({request.method} {request.url.path})"
        code = {404: "unknown_url", 405: "method_not_allowed"}.get(exc.status_code)
        return JSONResponse(
            error_body(message, INVALID_REQUEST, None, code),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )


def _add_generation_routes(app: FastAPI, handler: GenerationHandler) -> None:
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handler.handle(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handler.handle(request, "completion")


def _add_model_routes(
    app: FastAPI, backend: GenerationBackend, handler: GenerationHandler, keyring: KeyRing
) -> None:
    def model_cards() -> list[dict]:
        # Saved routers are addressed like models, so clients (the playground's picker)
        # find them where they find models.
        cards = [_model_card(m) for m in backend.models()]
        return cards + [_router_card(name) for name in handler.saved_routers.names()]

    @app.get("/v1/models")
    async def list_models(request: Request) -> JSONResponse:
        keyring.authenticate(request)
        return JSONResponse({"object": "list", "data": model_cards()})

    @app.get("/v1/models/{model_id:path}")
    async def get_model(request: Request, model_id: str) -> JSONResponse:
        keyring.authenticate(request)
        for card in model_cards():
            if card["id"] == model_id:
                return JSONResponse(card)
        raise APIError(
            404, f"The model '{model_id}' does not exist.", param="model", code="model_not_found"
        )


def _add_operator_routes(app: FastAPI, backend: GenerationBackend, metrics: APIMetrics) -> None:
    """Liveness, readiness and metrics: for operators, without an API key."""

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> JSONResponse:
        try:
            status = await backend.health()
        except Exception as exc:  # a broken backend is "not ready", not a 500
            status = {"ready": False, "error": f"{type(exc).__name__}: {exc}"}
        return JSONResponse(status, status_code=200 if status.get("ready") else 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=PROMETHEUS_CONTENT_TYPE)


def _router_card(name: str) -> dict:
    return {"id": f"{ROUTER_PREFIX}{name}", "object": "model", "created": 0, "owned_by": "router"}


def _model_card(info: ModelInfo) -> dict:
    return {
        "id": info.id,
        "object": "model",
        "created": info.created,
        "owned_by": info.owned_by,
        "context_length": info.context_length,
    }
