"""The errors the router writes itself, each in the shape of the API the request was for (the replicas
answer each route in its own): a JSON body for a request it refuses or cannot place, and the event that
ends a stream whose replica failed after bytes were sent."""

from __future__ import annotations

import json

from fastapi.responses import JSONResponse

ANTHROPIC = "/v1/messages"  # = lmserve.server.anthropic_api.ROUTE (the router does not import the server)
# = lmserve.server.anthropic_api.ERROR_TYPES
ANTHROPIC_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 408: "timeout_error",
                   413: "request_too_large", 429: "rate_limit_error", 504: "timeout_error", 529: "overloaded_error"}


def is_anthropic(path: str) -> bool:
    return path == ANTHROPIC or path.startswith(ANTHROPIC + "/")


def error(status: int, message: str, code: str | None, headers: dict[str, str] | None = None,
          path: str = "") -> JSONResponse:
    """The error body the replicas answer for this path: Anthropic's on /v1/messages, else OpenAI's."""
    if is_anthropic(path):
        kind = ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
        return JSONResponse({"type": "error", "error": {"type": kind, "message": message}}, status, headers=headers)
    return JSONResponse({"error": {"message": message, "type": "server_error" if status >= 500 else
                                   "invalid_request_error", "param": None, "code": code}}, status, headers=headers)


def stream_error(path: str, message: str) -> bytes:
    """The event that ends a stream its replica failed, in the stream's API: Anthropic's `event: error`;
    the Responses API's `error` event; the web console's engine view's `event: error`; else (completions,
    chat) OpenAI's error then [DONE], as the server's own error path."""
    if is_anthropic(path):
        body = {"type": "error", "error": {"type": "api_error", "message": message}}
    elif path.startswith("/v1/responses"):
        body = {"type": "error", "code": "replica_failed", "message": message, "param": None}
    elif path.startswith("/v1/engine/"):
        body = {"message": message}
    else:
        err = {"error": {"message": message, "type": "server_error", "param": None, "code": "replica_failed"}}
        return f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
    return f"event: error\ndata: {json.dumps(body)}\n\n".encode()
