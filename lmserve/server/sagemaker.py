"""POST /invocations: Amazon SageMaker's one inference route (its health probe is /ping, in ops.py), as
vLLM serves it: the body's shape picks the API, and the request is that route's, answered as it answers
(streamed when the body asks): `messages` -> /v1/chat/completions, `prompt` -> /v1/completions, `input`
-> /v1/embeddings, `text_1` -> /score, `query` -> /rerank (a conversation is a chat, in vLLM's order too:
its embeddings come from /v1/embeddings). Behind the API key like those routes (vLLM leaves it open). The
router counts it as generating load and routes a prompt or conversation by its prefix (no disaggregated
prefill for it)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from fastapi.routing import APIRoute
from pydantic import RootModel

from lmserve.server import openapi as oa
from lmserve.server.embeddings_api import EmbeddingRequest, RerankRequest, ScoreRequest
from lmserve.server.errors import ApiError
from lmserve.server.protocol import ChatCompletionRequest, CompletionRequest

KINDS = (("messages", "/v1/chat/completions"), ("prompt", "/v1/completions"), ("input", "/v1/embeddings"),
         ("text_1", "/score"), ("query", "/rerank"))  # (in this order: a chat body may also hold `prompt`-less extras)


class InvocationRequest(RootModel[ChatCompletionRequest | CompletionRequest | EmbeddingRequest | ScoreRequest
                                  | RerankRequest]):
    """The OpenAPI document's body of /invocations: any of the bodies it passes on (never parsed as such)."""


ANSWERS = ("ChatCompletionResponse", "CompletionResponse", "EmbeddingResponse", "ScoreResponse", "RerankResponse")


def register(app: FastAPI, srv: Any) -> list[type[Any]]:
    """Add POST /invocations over the app's routes (register it after them); srv: the OpenAIServer. Returns
    its body model for the document (to come before the others there: its schema refers to theirs)."""
    endpoints: dict[str, Callable[[Request], Awaitable[Response]]] = {
        r.path: r.endpoint for r in app.routes if isinstance(r, APIRoute) and "POST" in r.methods}
    kinds = [(key, path) for key, path in KINDS if path in endpoints]

    async def invocations(request: Request) -> Response:
        chunks: list[bytes] = []

        async def recording() -> dict[str, Any]:  # the body's bytes, as read_json reads (and bounds) them
            message = await request.receive()
            if message["type"] == "http.request":
                chunks.append(message.get("body", b""))
            return message
        data = await srv.read_json(Request(request.scope, recording))
        path = next((path for key, path in kinds if key in data), None)
        if path is None:
            raise ApiError(400, "the body is none of the APIs /invocations serves: give one of "
                           + ", ".join(f"{key!r} ({path})" for key, path in kinds))
        sent = False

        async def replaying() -> dict[str, Any]:  # the body again for the route, then the client's own messages
            nonlocal sent
            if sent:
                return await request.receive()  # (a disconnect, which a route watches for)
            sent = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        return await endpoints[path](Request(request.scope, replaying))

    answer = {"anyOf": [{"$ref": f"#/components/schemas/{name}"} for name in ANSWERS]}
    app.add_api_route("/invocations", invocations, methods=["POST"], openapi_extra=oa.request_body(InvocationRequest),
                      responses={200: {"description": "the chosen route's answer, or its SSE stream",
                                       "content": {"application/json": {"schema": answer}, **oa.SSE}}, **oa.errors()})
    return [InvocationRequest]
