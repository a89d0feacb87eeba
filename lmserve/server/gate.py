"""The gate in front of every route: the header limits and the API key.

Pure ASGI middleware, not Starlette's BaseHTTPMiddleware (`@app.middleware("http")`): under that one a
route's `request.is_disconnected()` never turns true, since the middleware consumes the client's
messages itself, so an unstreamed request whose client had gone ran on to its end, holding its KV
blocks. Here the routes read the client's own `receive`."""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from lmserve.server import anthropic_api
from lmserve.server.errors import ApiError
from lmserve.server.limits import ServerLimits


# What a server with an API key still answers without it: the probes, the metrics, the API's documents and
# the console's page (which asks for the key and sends it). Every other route needs it: vLLM gates only /v1,
# which leaves /score, /rerank and its SageMaker route running the model for anyone (its issue #58144).
OPEN_PATHS = frozenset({"/health", "/ping", "/version", "/metrics", "/openapi.json", "/docs", "/redoc",
                        "/docs/oauth2-redirect", "/"})


def needs_key(path: str) -> bool:
    """Whether a request to path needs the API key (when the server has one)."""
    return path not in OPEN_PATHS and not path.startswith("/web/")


class Gate:
    """Refuses a request whose headers are too big (whatever the HTTP parser let through) or, with an
    API key set, one to a route that is not open (`needs_key`) without it (Anthropic's clients send
    x-api-key); `error` shapes the answer."""

    def __init__(self, app: Any, limits: ServerLimits, api_key: str | None,
                 error: Callable[[Request, ApiError], Response]) -> None:
        self.app, self.limits, self.api_key, self.error = app, limits, api_key, error

    def refusal(self, request: Request) -> ApiError | None:
        too_big = self.limits.check_headers(request.scope["headers"])
        if too_big is not None:
            return too_big
        path = request.scope["path"]  # (what the router routes by; request.url is rebuilt from the Host header)
        if self.api_key and needs_key(path):
            header = request.headers.get("authorization", "")
            tokens = [header[7:] if header.lower().startswith("bearer ") else ""]
            if anthropic_api.is_route(path):
                tokens.append(request.headers.get("x-api-key", ""))
            if not any([hmac.compare_digest(t.encode(), self.api_key.encode()) for t in tokens]):
                return ApiError(401, "invalid or missing API key", type_="authentication_error", code="invalid_api_key")
        return None

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        refused = self.refusal(request)
        if refused is not None:
            await self.error(request, refused)(scope, receive, send)
            return
        started = False

        async def watched(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except ApiError as e:  # (the routes' own ApiErrors are answered by the app's handler)
            if started:
                raise
            await self.error(request, e)(scope, receive, send)
