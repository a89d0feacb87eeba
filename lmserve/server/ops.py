"""The routes for operators, open without the API key: /health, /ping (vLLM's, as SageMaker probes
it), /version, /metrics."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from lmserve.server import openapi as oa
from lmserve.server.async_engine import AsyncEngine
from lmserve.server.errors import ApiError
from lmserve.server.metrics import ServerMetrics
from lmserve.version import __version__

TEXT = {"content": {"text/plain": {"schema": {"type": "string"}}}}


def register(app: FastAPI, ae: AsyncEngine, metrics: ServerMetrics) -> None:
    """GET /health (and GET / POST /ping): 200 while the engine loop runs, else 503; GET /version;
    GET /metrics (Prometheus text)."""
    async def health() -> Response:
        if ae.alive:
            return PlainTextResponse("ok")
        return ApiError(503, "the engine loop is not running", type_="server_error").response()

    probe = {"response_class": PlainTextResponse,
             "responses": {200: {"description": "ok", **TEXT}, **oa.errors(statuses=(503,))}}
    app.add_api_route("/health", health, methods=["GET"], **probe)
    for method in ("GET", "POST"):  # (one route each: one operation id each in the OpenAPI document)
        app.add_api_route("/ping", health, methods=[method], name=f"ping_{method.lower()}", **probe)

    @app.get("/version", responses={200: {"model": oa.Version}})
    async def version() -> Response:
        return JSONResponse({"version": __version__})

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus metrics", **TEXT}})
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
