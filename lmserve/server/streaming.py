"""The server's streamed (SSE) response: its requests queued at once (submit_all), their outputs merged
(merge_streams), and the response that closes both when it ends (ClosingStream)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse

from lmserve.outputs import RequestOutput
from lmserve.server.async_engine import AsyncEngine, EngineDeadError, QueueFullError
from lmserve.server.errors import ApiError
from lmserve.server.metrics import ServerMetrics


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


async def merge_streams(ae: AsyncEngine, metrics: ServerMetrics, jobs: list[Any], streams: list[Any] | None,
                        deadline: float | None, timed_out: Callable[[], ApiError]
                        ) -> AsyncIterator[tuple[int, RequestOutput | BaseException]]:
    """Merge the output streams of several (request id, engine request) jobs: (job index, output or
    error); past the deadline (monotonic clock), (-1, timed_out()). The merge holds a few outputs per
    request: when the client stops reading, the rest wait in the requests' own streams, where
    AsyncEngine cuts a stalled reader off (MAX_UNREAD). streams: the jobs as submit_all queued them
    (None: each queued when its pump starts)."""
    q: asyncio.Queue = asyncio.Queue(maxsize=2 * len(jobs) + 2)

    async def pump(i: int, rid: str, req: Any) -> None:
        try:
            async with contextlib.aclosing(ae.generate(rid, req, streams and streams[i])) as outs:  # closed (aborted) at once
                async for out in outs:
                    if out.finished:
                        metrics.observe(out, req.params)
                    await q.put((i, out))
        except asyncio.CancelledError:
            raise  # the merge is gone: nobody to tell (waiting on a full queue here would never end)
        except Exception as e:
            if not isinstance(e, QueueFullError):
                metrics.failed()
            await q.put((i, e))
        await q.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, *j)) for i, j in enumerate(jobs)]
    open_jobs = len(jobs)
    try:
        while open_jobs:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                i, item = await asyncio.wait_for(q.get(), timeout)
            except asyncio.TimeoutError:
                yield -1, timed_out()
                return
            if item is None:
                open_jobs -= 1
                continue
            yield i, item
    finally:
        unfinished = sum(not t.done() for t in tasks)
        for t in tasks:
            t.cancel()
        if unfinished:
            metrics.aborted(unfinished)


class ClosingStream(StreamingResponse):
    """An SSE response that closes its generators when it ends, a client hang-up included: Starlette
    leaves the body iterator suspended when send fails, and the merge's pumps (merge_streams) then waited
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
