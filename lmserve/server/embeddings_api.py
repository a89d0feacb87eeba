"""POST /v1/embeddings (OpenAI's Embeddings API, as vLLM serves a decoder model's embeddings): each input
runs as an embedding request (pooling.py: the final hidden state of its last token by default, L2-
normalised), batched with whatever else the engine runs. Inputs are texts or token ids, one or a list,
or (vLLM's extension) `messages`: one conversation through the chat template (no generation prompt and no
added special tokens unless asked, as vLLM's defaults);
`dimensions` keeps the first k (Matryoshka models); `encoding_format` "base64" gives little-endian
float32 bytes, as OpenAI's. vLLM's extras: `truncate_prompt_tokens`, `add_special_tokens`, `normalize`,
`pooling_type` ("last" / "mean"), `priority`.

On the same embeddings, vLLM's scoring routes for embedding models: POST /score (and /v1/score): the
cosine similarity of text_1 with each text_2 (or pair by pair), and POST /rerank (/v1/rerank, /v2/rerank,
Jina's and Cohere's shape): the documents ordered by their similarity to the query."""

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

from lmserve.inputs import with_salt
from lmserve.pooling import PoolingParams
from lmserve.server import openapi as oa
from lmserve.server.errors import invalid_request
from lmserve.server.protocol import BaseRequest, ChatMessage, Int, TemplateArgs


class EmbeddingRequest(TemplateArgs):
    input: str | list[Int] | list[str] | list[list[Int]] | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)  # vLLM's: a conversation, through the template
    add_generation_prompt: StrictBool = False  # (vLLM's defaults for an embedded conversation)
    chat_template: str | None = None  # the request's own template: refused unless the server trusts them
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int | None = Field(None, ge=1)
    user: str | None = None
    truncate_prompt_tokens: Int | None = None
    add_special_tokens: StrictBool | None = None  # None: true for input, false for messages (the template's own)
    normalize: StrictBool | None = True  # (null: the default, as vLLM reads it)
    pooling_type: Literal["last", "mean"] = "last"
    priority: Int = 0

    def prompts(self) -> list[str | list[int]]:
        """The inputs, each text or token ids (none for messages)."""
        p = self.input
        if p is None:
            return []
        if isinstance(p, str) or (p and all(isinstance(x, int) for x in p)):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]

    def check(self) -> None:
        if (self.input is None) == (self.messages is None):
            raise ValueError("input: give exactly one of input or messages")
        if self.input is not None and (not self.prompts() or any(len(p) == 0 for p in self.prompts())):
            raise ValueError("input: must not be empty (nor any of its items)")
        super().check()


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class Score(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[Score]
    usage: EmbeddingUsage


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[Embedding]
    usage: EmbeddingUsage


class ScoreRequest(BaseRequest):
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: Int | None = None
    priority: Int = 0

    def pairs(self) -> list[tuple[str, str]]:
        """(text_1, text_2) per score: one text_1 against each text_2, or the lists pair by pair."""
        a = [self.text_1] if isinstance(self.text_1, str) else self.text_1
        b = [self.text_2] if isinstance(self.text_2, str) else self.text_2
        if len(a) == 1:
            return [(a[0], t) for t in b]
        if len(a) != len(b):
            raise ValueError(f"text_2: {len(b)} texts for {len(a)} in text_1 (give one text_1, or as many as text_2)")
        return list(zip(a, b))

    def check(self) -> None:
        for name in ("text_1", "text_2"):
            texts = getattr(self, name)
            if not texts or any(not t for t in ([texts] if isinstance(texts, str) else texts)):
                raise ValueError(f"{name}: must not be empty (nor any text)")
        self.pairs()
        super().check()


class RerankRequest(BaseRequest):
    query: str = Field(min_length=1)
    documents: list[str] = Field(min_length=1)
    top_n: Int = Field(0, ge=0)  # 0: all of them
    return_documents: StrictBool = True
    truncate_prompt_tokens: Int | None = None
    priority: Int = 0

    def check(self) -> None:
        if any(not d for d in self.documents):
            raise ValueError("documents: must not hold an empty text")
        super().check()


async def embed_all(srv: Any, request: Request, prompts: list[Any], body: Any, rid: str,
                    pooling: PoolingParams | None = None, fields: str | list[str] = "input",
                    count: tuple[int, str] | None = None) -> tuple[list[list[float]], list[int]]:
    """The prompts' embeddings (run together as engine requests) and each one's prompt tokens; 4xx on bad
    input, a bad prompt's named as its field (`fields`: the body's name for each, or for all). `count`:
    the texts the request sent as its batch (--max-prompts), and their field; all the prompts unless given."""
    names = [fields] * len(prompts) if isinstance(fields, str) else fields
    n, name = count or (len(prompts), names[0])
    with invalid_request((("prompt", name),)):
        srv.limits.check_prompts(n)

    def prepare(prompt: str | list[int], field: str) -> Any:
        with invalid_request((("prompt_token_ids", field), ("prompt", field))):
            ids = srv.ae.tokenize(prompt, getattr(body, "add_special_tokens", None) is not False)
            ids = srv.ae.truncate(prompt, ids, body.truncate_prompt_tokens, fill=True)
            req = srv.ae.process_request(with_salt(ids, body.cache_salt), pooling or PoolingParams(),
                                         srv.adapter(body.model))
            return dataclasses.replace(req, priority=body.priority)
    jobs = [(f"{rid}-{i}", await asyncio.to_thread(prepare, p, f)) for i, (p, f) in enumerate(zip(prompts, names))]
    srv.first_check(jobs)
    outs = await srv.run_all(request, jobs)
    return [o.embedding for o in outs], [len(o.prompt_token_ids) for o in outs]


def register(app: FastAPI, srv: Any) -> list[type[BaseRequest]]:
    """Add POST /v1/embeddings, /score and /rerank (and their aliases), served by srv (the app's
    OpenAIServer); returns their request models."""

    async def create(request: Request) -> Response:
        body = await srv.parse(request, EmbeddingRequest)
        rid = f"embd-{uuid.uuid4().hex}"
        pooling = PoolingParams(pooling_type=body.pooling_type, normalize=body.normalize is not False,
                                dimensions=body.dimensions)
        prompts = body.prompts() or [await asyncio.to_thread(  # a conversation: the rendered template's token ids
            srv.chat_ids, body.messages, body.add_generation_prompt, body.template_kwargs(), body.chat_template,
            bool(body.add_special_tokens))]
        model = srv.response_model(body)  # (now: an adapter unloaded while the request runs made the vectors)
        vectors, counts = await embed_all(srv, request, prompts, body, rid, pooling,
                                          "input" if body.input else "messages")
        used = sum(counts)

        def encode(v: list[float]) -> list[float] | str:
            return v if body.encoding_format == "float" else base64.b64encode(np.asarray(v, "<f4").tobytes()).decode()
        return JSONResponse({"id": rid, "object": "list", "created": int(time.time()), "model": model,
                             "data": [{"object": "embedding", "index": i, "embedding": encode(v)}
                                      for i, v in enumerate(vectors)],
                             "usage": {"prompt_tokens": used, "total_tokens": used}})

    async def score(request: Request) -> Response:
        body = await srv.parse(request, ScoreRequest)
        pairs = body.pairs()
        field: dict[str, str] = {}  # each distinct text, embedded once, and the field it first came in
        for a, b in pairs:
            field.setdefault(a, "text_1"), field.setdefault(b, "text_2")
        texts = list(field)
        rid, model = f"score-{uuid.uuid4().hex}", srv.response_model(body)
        vectors, counts = await embed_all(srv, request, texts, body, rid, fields=[field[t] for t in texts],
                                          count=(len(pairs), "text_2"))
        at = {t: np.asarray(v, dtype=np.float64) for t, v in zip(texts, vectors)}
        tokens = dict(zip(texts, counts))
        used = sum(tokens[a] + tokens[b] for a, b in pairs)  # each pair's, as vLLM counts (a text per pair)
        return JSONResponse({"id": rid, "object": "list", "created": int(time.time()), "model": model,
                             "data": [{"index": i, "object": "score", "score": float(at[a] @ at[b])}
                                      for i, (a, b) in enumerate(pairs)],
                             "usage": {"prompt_tokens": used, "total_tokens": used}})

    async def rerank(request: Request) -> Response:
        body = await srv.parse(request, RerankRequest)
        rid, model = f"rerank-{uuid.uuid4().hex}", srv.response_model(body)
        vectors, counts = await embed_all(srv, request, [body.query, *body.documents], body, rid,
                                          fields=["query"] + ["documents"] * len(body.documents),
                                          count=(len(body.documents), "documents"))
        used = sum(counts[0] + n for n in counts[1:])  # each (query, document) pair's, as vLLM counts
        q = np.asarray(vectors[0], dtype=np.float64)
        scores = [float(q @ np.asarray(v, dtype=np.float64)) for v in vectors[1:]]
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[:body.top_n or len(scores)]
        return JSONResponse({"id": rid, "model": model, "usage": {"total_tokens": used},
                             "results": [{"index": i, "relevance_score": scores[i],
                                          **({"document": {"text": body.documents[i]}} if body.return_documents else {})}
                                         for i in order]})

    app.add_api_route("/v1/embeddings", create, methods=["POST"],
                      **oa.generating(EmbeddingResponse, EmbeddingRequest, stream=False))
    for path in ("/score", "/v1/score"):
        app.add_api_route(path, score, methods=["POST"], name=f"score_{path.count('/')}",
                          **oa.generating(ScoreResponse, ScoreRequest, stream=False))
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.add_api_route(path, rerank, methods=["POST"], name=f"rerank_{path.strip('/').replace('/', '_')}",
                          **oa.generating(RerankResponse, RerankRequest, stream=False))
    return [EmbeddingRequest, ScoreRequest, RerankRequest]
