"""The browser playground: its static page at /playground (and / redirects there), and the
two JSON views only it needs, the fleet and the recent traces.

The JSON views sit behind the same API keys as /v1; the page itself holds no secret, so it
is served to anyone (it asks for a key when `auth_required`). Every generation the page makes
goes through /v1 like any client's: keys, tiers and entitlements all apply.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response

from services.coordinator.errors import APIError
from services.coordinator.keys import KeyRing
from services.coordinator.playground.fleet import FleetView
from services.coordinator.playground.static_files import SECURITY_HEADERS, StaticBundle
from services.coordinator.service_tiers import VALID_TIERS

if TYPE_CHECKING:  # the OpenTelemetry SDK is loaded only by a coordinator that traces
    from shared.telemetry.recent_traces import RecentTraces, TraceFileTail

MAX_TRACE_LIST = 50


@dataclass
class PlaygroundSources:
    """Where the playground's views read from; None: this coordinator has no such source
    (an in-process backend has no registry; tracing off keeps no traces)."""

    fleet: FleetView | None = None
    traces: RecentTraces | None = None
    trace_file: TraceFileTail | None = None  # workers' spans, when all trace to one file


def add_playground(app: FastAPI, keyring: KeyRing, sources: PlaygroundSources) -> None:
    bundle = StaticBundle("services.coordinator.playground", "web")

    @app.get("/", include_in_schema=False)
    async def root() -> Response:
        return RedirectResponse("/playground/", status_code=307)

    @app.get("/playground", include_in_schema=False)
    async def playground_bare() -> Response:
        return RedirectResponse("/playground/", status_code=307)

    @app.get("/playground/", include_in_schema=False)
    async def playground_index(request: Request) -> Response:
        return bundle.response("index.html", request)  # type: ignore[return-value]

    @app.get("/playground/api/config")
    async def playground_config() -> JSONResponse:
        # What the page needs before it has a key; a 401 on /v1 would tell as much.
        return JSONResponse(
            {
                "auth_required": bool(keyring.keys),
                "service_tiers": list(VALID_TIERS),
                "tracing": sources.traces is not None,
                "fleet": sources.fleet is not None,
            },
            headers=SECURITY_HEADERS,
        )

    @app.get("/playground/api/fleet")
    async def playground_fleet(request: Request) -> JSONResponse:
        keyring.authenticate(request)
        if sources.fleet is None:
            raise APIError(404, "This coordinator has no worker registry.", code="no_fleet")
        return JSONResponse(await sources.fleet.snapshot(), headers=SECURITY_HEADERS)

    @app.get("/playground/api/traces")
    async def playground_traces(request: Request) -> JSONResponse:
        keyring.authenticate(request)
        traces = _traces(sources)
        await _tail(sources)
        listed = [s.to_json() for s in traces.summaries(MAX_TRACE_LIST)]
        return JSONResponse({"object": "list", "data": listed}, headers=SECURITY_HEADERS)

    @app.get("/playground/api/traces/{trace_id}")
    async def playground_trace(request: Request, trace_id: str) -> JSONResponse:
        keyring.authenticate(request)
        traces = _traces(sources)
        await _tail(sources)
        spans = traces.trace(trace_id)
        if spans is None:
            raise APIError(
                404,
                f"No trace '{trace_id}' among the last {traces.max_traces} kept here.",
                code="trace_not_found",
            )
        body = {"trace_id": trace_id, "spans": [s.to_json() for s in spans]}
        return JSONResponse(body, headers=SECURITY_HEADERS)

    @app.get("/playground/{name}", include_in_schema=False)
    async def playground_file(request: Request, name: str) -> Response:
        found = bundle.response(name, request)
        if found is None:
            raise APIError(404, f"No playground file '{name}'.", code="unknown_url")
        return found


def _traces(sources: PlaygroundSources) -> RecentTraces:
    if sources.traces is None:
        raise APIError(
            404,
            "Tracing is off on this coordinator: set telemetry.exporter (file, otlp_grpc or "
            "otlp_http) in the deployment config to see request waterfalls.",
            code="tracing_off",
        )
    return sources.traces


async def _tail(sources: PlaygroundSources) -> None:
    if sources.trace_file is not None:  # file reads off the event loop
        await asyncio.to_thread(sources.trace_file.poll)
