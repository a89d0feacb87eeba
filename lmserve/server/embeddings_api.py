"""POST /v1/embeddings (OpenAI's Embeddings API, as vLLM serves a decoder model's embeddings): each input
runs as an embedding request (pooling.py: the final hidden state of its last token by default, L2-
normalised), batched with whatever else the engine runs. Inputs are texts or token ids, one or a list;
`dimensions` keeps the first k (Matryoshka models); `encoding_format` "base64" gives little-endian
float32 bytes, as OpenAI's. vLLM's extras: `truncate_prompt_tokens`, `add_special_tokens`, `normalize`,
`pooling_type` ("last" / "mean"), `priority`."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import time
import uuid
from typing import Any, Literal

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field, StrictBool

from lmserve.pooling import PoolingParams
from lmserve.server import openapi as oa
from lmserve.server.errors import invalid_request
from lmserve.server.protocol import BaseRequest, Int


class EmbeddingRequest(BaseRequest):
    input: str | list[Int] | list[str] | list[list[Int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int | None = Field(None, ge=1)
    user: str | None = None
    truncate_prompt_tokens: Int | None = None
    add_special_tokens: StrictBool = True
    normalize: StrictBool = True
    pooling_type: Literal["last", "mean"] = "last"
    priority: Int = 0

    def prompts(self) -> list[str | list[int]]:
        """The inputs, each text or token ids."""
        p = self.input
        if isinstance(p, str) or (p and all(isinstance(x, int) for x in p)):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]

    def check(self) -> None:
        if not self.prompts() or any(len(p) == 0 for p in self.prompts()):
            raise ValueError("input: must not be empty (nor any of its items)")
        super().check()


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[Embedding]
    usage: EmbeddingUsage


def register(app: FastAPI, srv: Any) -> list[type[BaseRequest]]:
    """Add POST /v1/embeddings, served by srv (the app's OpenAIServer); returns its request model."""

    def prepare(prompt: str | list[int], body: EmbeddingRequest) -> Any:
        with invalid_request():
            ids = srv.ae.tokenize(prompt, body.add_special_tokens)
            ids = srv.ae.truncate(prompt, ids, body.truncate_prompt_tokens)
            pooling = PoolingParams(pooling_type=body.pooling_type, normalize=body.normalize, dimensions=body.dimensions)
            req = srv.ae.process_request(ids, pooling, srv.adapter(body.model))
            return dataclasses.replace(req, priority=body.priority)

    async def create(request: Request) -> Response:
        body = await srv.parse(request, EmbeddingRequest)
        prompts = body.prompts()
        with invalid_request():
            srv.limits.check_prompts(len(prompts))
        rid = f"embd-{uuid.uuid4().hex}"
        jobs = [(f"{rid}-{i}", await asyncio.to_thread(prepare, p, body)) for i, p in enumerate(prompts)]
        srv.first_check(jobs)
        outs = await srv.run_all(request, jobs)

        def encode(v: list[float]) -> list[float] | str:
            return v if body.encoding_format == "float" else base64.b64encode(np.asarray(v, "<f4").tobytes()).decode()
        used = sum(len(o.prompt_token_ids) for o in outs)
        return JSONResponse({"id": rid, "object": "list", "created": int(time.time()), "model": srv.response_model(body),
                             "data": [{"object": "embedding", "index": i, "embedding": encode(o.embedding)}
                                      for i, o in enumerate(outs)],
                             "usage": {"prompt_tokens": used, "total_tokens": used}})

    app.add_api_route("/v1/embeddings", create, methods=["POST"],
                      **oa.generating(EmbeddingResponse, EmbeddingRequest, stream=False))
    return [EmbeddingRequest]
