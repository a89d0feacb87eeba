"""The server's streamed (SSE) response."""

from __future__ import annotations

from typing import Any

from fastapi.responses import StreamingResponse

from lmserve.server.async_engine import AsyncEngine, EngineDeadError, QueueFullError
from lmserve.server.errors import ApiError


def submit_all(ae: AsyncEngine, jobs: list[Any]) -> list[Any]:
    """Queue every (request id, engine request) of a stream before its headers go out, or none (those
    queued are aborted): their streams. A full queue is a 429, a dead engine a 503."""
    streams: list[Any] = []
    try:
        for rid, req in jobs:
            streams.append(ae.submit(rid, req))
    except (QueueFullError, EngineDeadError) as e:
        for (rid, _), _s in zip(jobs, streams):
            ae.abort(rid)
        if isinstance(e, QueueFullError):
            raise ApiError(429, str(e), type_="rate_limit_error", headers={"Retry-After": "1"}) from None
        raise ApiError(503, str(e), type_="server_error") from None
    return streams


class ClosingStream(StreamingResponse):
    """An SSE response that closes its generators when it ends, a client hang-up included: Starlette
    leaves the body iterator suspended when send fails, and the merge's pumps (stream_all) then waited
    on a full queue until the garbage collector finalized the abandoned generators (seen as tasks left
    behind in the soak test)."""

    def __init__(self, events: Any, merged: Any, on_close: Any = None, **kw: Any) -> None:
        super().__init__(events, **kw)
        self._gens = (events, merged)
        self._on_close = on_close  # what the generators cannot do if they never started (abort queued requests)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for gen in self._gens:  # the formatter's events, then the merge (its finally cancels the pumps)
                await gen.aclose()
            if self._on_close is not None:
                self._on_close()
