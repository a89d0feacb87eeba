"""The web console: the page at / (static files in server/static/, no build step) and its read-only live
feed GET /v1/engine/stream (server-sent events, one engine snapshot per event; engine_view.py).

The page talks to the server's own routes (/v1/chat/completions, /v1/completions) like any client, with
the API key the user types in when the server has one; /v1/engine/stream sits under /v1 and so needs the
key too. The page itself holds no data and is served to anyone who can reach the server. `serve
--no-web-ui` leaves all of this out. The stream is not in the OpenAPI document (it never ends)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from lmserve.server.async_engine import AsyncEngine
from lmserve.server.errors import ApiError

STATIC = Path(__file__).parent / "static"
ASSETS = {"app.js": "text/javascript; charset=utf-8", "style.css": "text/css; charset=utf-8"}
MAX_VIEWERS = 16  # engine-view streams open at once; more get a 429
POLL_S = 0.05  # how often a stream looks for a new snapshot
KEEPALIVE_S = 15.0


def register(app: Any, ae: AsyncEngine, served_model: str) -> None:
    from fastapi.responses import HTMLResponse, Response, StreamingResponse

    page = (STATIC / "index.html").read_text().replace("{{MODEL}}", _html(served_model))
    assets = {name: (STATIC / name).read_bytes() for name in ASSETS}

    @app.get("/", include_in_schema=False)
    async def index() -> Response:
        return HTMLResponse(page, headers={"Cache-Control": "no-cache"})

    @app.get("/web/{name}", include_in_schema=False)
    async def asset(name: str) -> Response:
        if name not in assets:
            raise ApiError(404, f"no such file: {name}", type_="not_found_error")
        return Response(assets[name], media_type=ASSETS[name], headers={"Cache-Control": "no-cache"})

    class Viewed(StreamingResponse):
        """The stream, counted as a viewer from the check that let it in until the response ends, whether
        it ran, failed or never started (a client gone first): counted where it is checked, so views
        opened at once cannot all pass the check before the first is counted."""

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            try:
                await super().__call__(scope, receive, send)
            finally:
                ae.watch(-1)

    @app.get("/v1/engine/stream", include_in_schema=False)
    async def stream() -> Response:
        if ae.view.viewers >= MAX_VIEWERS:
            raise ApiError(429, f"{MAX_VIEWERS} engine views are already open", type_="rate_limit_error",
                           headers={"Retry-After": "5"})
        ae.watch(+1)  # (no await between the check and the count)
        return Viewed(_events(ae), media_type="text/event-stream",
                      headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _events(ae: AsyncEngine):  # type: ignore[no-untyped-def]
    """Each new snapshot as one `data:` event, a comment now and then to keep proxies from closing an idle
    stream, an `error` event if the engine stops."""
    seen, last = -1, time.monotonic()
    while True:
        latest = ae.view.latest  # (seq, snapshot): one read, never a torn pair
        seq, snap = latest if latest is not None else (seen, None)
        if snap is not None and seq != seen:
            seen, last = seq, time.monotonic()
            yield f"data: {json.dumps(snap, separators=(',', ':'))}\n\n"
        elif time.monotonic() - last > KEEPALIVE_S:
            last = time.monotonic()
            yield ": keep-alive\n\n"
        if not ae.alive or ae.draining:  # (a view left open must not hold a shutdown's drain)
            why = "the server is shutting down" if ae.draining else "the engine loop is not running"
            yield f"event: error\ndata: {json.dumps({'message': why})}\n\n"
            return
        await asyncio.sleep(POLL_S)


def _html(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")
