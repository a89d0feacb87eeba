"""The server's streamed (SSE) response."""

from __future__ import annotations

from typing import Any

from fastapi.responses import StreamingResponse


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
