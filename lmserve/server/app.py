"""The FastAPI app: OpenAI routes over AsyncEngine. Every request is parsed and validated here, before
it reaches the engine; a bad one gets a 4xx with OpenAI's error body and touches nothing else."""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from lmserve.outputs import RequestOutput
from lmserve.sequence import Logprob, SamplingParams
from lmserve.server.async_engine import AsyncEngine, EngineDeadError, QueueFullError
from lmserve.server.metrics import ServerMetrics
from lmserve.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                     TokenizeRequest)


class ApiError(Exception):
    """An error with an HTTP status and OpenAI's error body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    @classmethod
    def of(cls, e: BaseException) -> "ApiError":
        """An ApiError as is; anything else as a 500."""
        return e if isinstance(e, ApiError) else cls(500, str(e), type_="server_error")

    @classmethod
    def engine_failure(cls, error: str | None) -> "ApiError":
        """A request that finished with finish_reason 'error' inside the engine."""
        return cls(500, f"request failed inside the engine: {error}", type_="server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _value_error(e: Exception) -> ApiError:
    """Our library's ValueErrors start with the field they are about: 'max_tokens: ...'."""
    msg = str(e)
    head = msg.split(":", 1)[0]
    param = head if head.replace("_", "").isalnum() and " " not in head else None
    return ApiError(400, msg, param=param)


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class OpenAIServer:
    """Route handlers; holds the engine handle, limits and metrics."""

    def __init__(self, ae: AsyncEngine, served_model: str, api_key: str | None = None,
                 max_body_bytes: int = 4 * 2**20, request_timeout: float | None = None) -> None:
        self.ae = ae
        self.engine = ae.engine
        self.tok = ae.engine.tokenizer
        self.served_model = served_model
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.request_timeout = request_timeout
        self.metrics = ServerMetrics(ae)

    # ------------------------------------------------------------ parsing and checks
    async def parse(self, request: Request, model: type[BaseModel]) -> Any:
        ctype = request.headers.get("content-type", "")
        if "application/json" not in ctype.lower():
            raise ApiError(415, f"Content-Type must be application/json, got {ctype or 'none'!r}")
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise ApiError(413, f"request body of {declared} bytes exceeds the limit of {self.max_body_bytes}",
                           code="request_too_large")
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > self.max_body_bytes:
                raise ApiError(413, f"request body exceeds the limit of {self.max_body_bytes} bytes",
                               code="request_too_large")
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise ApiError(400, "request body is not valid JSON") from None
        if not isinstance(data, dict):
            raise ApiError(400, "request body must be a JSON object")
        try:
            return model.model_validate(data)
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(p) for p in err["loc"] if not isinstance(p, int)) or None
            raise ApiError(400, f"{loc}: {err['msg']}" if loc else err["msg"], param=loc) from None

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.served_model:
            raise ApiError(404, f"the model {name!r} does not exist; this server serves {self.served_model!r}",
                           param="model", code="model_not_found")

    def sampling(self, body: Any, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None
                 ) -> SamplingParams:
        try:
            bias = {int(k): v for k, v in body.logit_bias.items()} if body.logit_bias else None
        except ValueError:
            raise ApiError(400, "logit_bias: keys must be token ids", param="logit_bias") from None
        if body.stream_options is not None and not body.stream:
            raise ApiError(400, "stream_options: only allowed when stream is true", param="stream_options")
        if body.use_beam_search and body.stream:
            raise ApiError(400, "use_beam_search: beam search results cannot be streamed", param="use_beam_search")
        if body.stream and body.best_of and body.best_of > body.n:
            raise ApiError(400, "best_of: cannot stream when best_of > n", param="best_of")
        try:
            return SamplingParams(
                n=body.n, best_of=body.best_of, temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k if body.top_k is not None else -1,
                min_p=body.min_p or 0.0, repetition_penalty=body.repetition_penalty or 1.0,
                presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty, logit_bias=bias,
                seed=body.seed, stop=body.stop, stop_token_ids=body.stop_token_ids, max_tokens=max_tokens,
                min_tokens=min(body.min_tokens, max_tokens), ignore_eos=body.ignore_eos,
                logprobs=None if body.use_beam_search else logprobs,
                prompt_logprobs=prompt_logprobs, skip_special_tokens=body.skip_special_tokens,
                include_stop_str_in_output=body.include_stop_str_in_output, use_beam_search=body.use_beam_search,
                length_penalty=body.length_penalty, early_stopping=body.early_stopping)
        except ValueError as e:
            raise _value_error(e) from None

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        try:
            return self.engine.tokenize_prompt(prompt)
        except ValueError as e:
            raise _value_error(e) from None

    def validate(self, ids: list[int], params: SamplingParams) -> None:
        try:
            self.engine.validate(ids, params)
        except ValueError as e:
            raise _value_error(e) from None

    # ------------------------------------------------------------ running requests
    async def run_all(self, request: Request, jobs: list[tuple[str, list[int], SamplingParams]]
                      ) -> list[RequestOutput]:
        """Run several engine requests to completion; abort them all if the client disconnects."""
        async def one(rid: str, ids: list[int], params: SamplingParams) -> RequestOutput:
            last = None
            async for out in self.ae.generate(rid, ids, params):
                last = out
            assert last is not None
            self.metrics.observe(last)
            return last

        task = asyncio.ensure_future(asyncio.gather(*(one(*j) for j in jobs)))
        deadline = time.monotonic() + self.request_timeout if self.request_timeout else None
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.2)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    task.cancel()
                    self.metrics.aborted(len(jobs))
                    raise ApiError(499, "client disconnected")
                if deadline is not None and time.monotonic() > deadline:
                    task.cancel()
                    self.metrics.aborted(len(jobs))
                    raise ApiError(408, f"request exceeded the {self.request_timeout} s timeout",
                                   code="request_timeout")
        except QueueFullError as e:
            raise ApiError(429, str(e), type_="rate_limit_error", headers={"Retry-After": "1"}) from None
        except EngineDeadError as e:
            raise ApiError(503, str(e), type_="server_error") from None
        finally:
            if not task.done():
                task.cancel()

    async def stream_all(self, jobs: list[tuple[str, list[int], SamplingParams]]
                         ) -> AsyncIterator[tuple[int, RequestOutput | BaseException]]:
        """Merge the output streams of several requests: (job index, output or error)."""
        q: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, rid: str, ids: list[int], params: SamplingParams) -> None:
            try:
                async for out in self.ae.generate(rid, ids, params):
                    if out.finished:
                        self.metrics.observe(out)
                    await q.put((i, out))
            except Exception as e:
                await q.put((i, e))
            finally:
                await q.put((i, None))

        tasks = [asyncio.ensure_future(pump(i, *j)) for i, j in enumerate(jobs)]
        deadline = time.monotonic() + self.request_timeout if self.request_timeout else None
        open_jobs = len(jobs)
        try:
            while open_jobs:
                timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    i, item = await asyncio.wait_for(q.get(), timeout)
                except asyncio.TimeoutError:
                    yield -1, ApiError(408, f"request exceeded the {self.request_timeout} s timeout",
                                       code="request_timeout")
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
                self.metrics.aborted(unfinished)

    async def first_check(self, jobs: list[tuple[str, list[int], SamplingParams]]) -> None:
        """Refuse at once (before streaming starts) when the engine is dead or the queue is full."""
        if not self.ae.alive:
            raise ApiError(503, "the engine loop is not running", type_="server_error")
        if not self.ae.has_room(len(jobs)):
            raise ApiError(429, f"too many requests waiting (limit {self.ae.max_queue})", type_="rate_limit_error",
                           headers={"Retry-After": "1"})

    # ------------------------------------------------------------ formatting
    def _piece(self, tid: int) -> str:
        return self.tok.decode([tid], skip_special_tokens=False) if self.tok else str(tid)

    def completion_logprobs(self, ids: list[int], lps: list[Logprob | None], start_offset: int) -> dict[str, Any]:
        tokens, token_lps, tops, offsets = [], [], [], []
        off = start_offset
        for tid, lp in zip(ids, lps):
            piece = self._piece(tid)
            tokens.append(piece)
            offsets.append(off)
            off += len(piece)
            token_lps.append(None if lp is None else lp.logprob)
            tops.append(None if lp is None else {self._piece(t): v for t, v in lp.top.items()})
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def chat_logprobs(self, ids: list[int], lps: list[Logprob]) -> dict[str, Any]:
        content = []
        for tid, lp in zip(ids, lps):
            piece = self._piece(tid)
            content.append({"token": piece, "logprob": lp.logprob, "bytes": list(piece.encode("utf-8")),
                            "top_logprobs": [{"token": self._piece(t), "logprob": v,
                                              "bytes": list(self._piece(t).encode("utf-8"))}
                                             for t, v in lp.top.items()]})
        return {"content": content}

    @staticmethod
    def usage(outs: list[RequestOutput], drop_generated: bool = False) -> dict[str, int]:
        prompt = sum(len(o.prompt_token_ids) for o in outs)
        completion = 0 if drop_generated else sum(len(c.token_ids) for o in outs for c in o.outputs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    @staticmethod
    def usage_flags(body: Any) -> tuple[bool, bool]:
        """(a final usage chunk, usage in every chunk) as stream_options / the vLLM extension ask."""
        opts = body.stream_options
        return bool(opts and opts.include_usage), bool(opts and opts.continuous_usage_stats) or body.continuous_usage_stats

    @staticmethod
    def raise_if_failed(outs: list[RequestOutput]) -> None:
        for o in outs:
            for c in o.outputs:
                if c.finish_reason == "error":
                    raise ApiError.engine_failure(c.error)

    # ------------------------------------------------------------ routes
    async def completions(self, request: Request) -> Response:
        body: CompletionRequest = await self.parse(request, CompletionRequest)
        self.check_model(body.model)
        p = body.prompt
        prompts: list[str | list[int]]
        if isinstance(p, str):
            prompts = [p]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [p]  # type: ignore[list-item]
        else:
            prompts = list(p)  # type: ignore[arg-type]
        if not prompts:
            raise ApiError(400, "prompt: must not be empty", param="prompt")
        if body.max_tokens == 0 and not body.echo:
            raise ApiError(400, "max_tokens: must be >= 1 (0 is allowed only with echo)", param="max_tokens")
        if body.suffix:
            raise ApiError(400, "suffix: is not supported", param="suffix")
        echo_only = body.max_tokens == 0  # scoring: return the prompt and its logprobs, generate nothing
        jobs = []
        rid = f"cmpl-{uuid.uuid4().hex}"
        for i, prompt in enumerate(prompts):
            ids = self.prompt_ids(prompt)
            if body.max_tokens is None:
                max_tokens = self.engine.max_model_len - len(ids)
            else:
                max_tokens = max(1, body.max_tokens)  # echo-only scoring runs one step and drops its token
            params = self.sampling(body, max(1, max_tokens), body.logprobs,
                                   body.logprobs if body.echo and body.logprobs is not None else None)
            self.validate(ids, params)
            jobs.append((f"{rid}-{i}", ids, params))
        await self.first_check(jobs)
        created = int(time.time())
        n = body.n

        def prompt_text(i: int) -> str:
            pr = prompts[i]
            return pr if isinstance(pr, str) else (self.tok.decode(pr, skip_special_tokens=False) if self.tok else "")

        if not body.stream:
            outs = await self.run_all(request, jobs)
            self.raise_if_failed(outs)
            choices = []
            for i, o in enumerate(outs):
                for c in o.outputs:
                    text, ids, lps = c.text, c.token_ids, c.logprobs or []
                    if echo_only:
                        text, ids, lps = "", [], []
                    lp_obj = None
                    if body.echo:
                        ptext = prompt_text(i)
                        if body.logprobs is not None:
                            lp_obj = self.completion_logprobs(o.prompt_token_ids + ids,
                                                              list(o.prompt_logprobs or []) + list(lps), 0)
                        text = ptext + text
                    elif body.logprobs is not None:
                        lp_obj = self.completion_logprobs(ids, list(lps), 0)
                    choices.append({"index": i * n + c.index, "text": text, "logprobs": lp_obj,
                                    "finish_reason": "length" if echo_only else c.finish_reason,
                                    "stop_reason": c.stop_reason})
            return JSONResponse({"id": rid, "object": "text_completion", "created": created,
                                 "model": self.served_model, "choices": choices,
                                 "usage": self.usage(outs, drop_generated=echo_only)})

        include_usage, continuous = self.usage_flags(body)

        async def events() -> AsyncIterator[str]:
            last: dict[int, RequestOutput] = {}
            sent_echo: set[tuple[int, int]] = set()
            async for i, item in self.stream_all(jobs):
                if isinstance(item, BaseException):
                    yield _sse(ApiError.of(item).body())
                    break
                last[i] = item
                for c in item.outputs:
                    delta = c.delta_text
                    lp_obj = None
                    if body.logprobs is not None and c.delta_token_ids:
                        k = len(c.delta_token_ids)
                        lp_obj = self.completion_logprobs(c.delta_token_ids, list((c.logprobs or [])[-k:]), 0)
                    if body.echo and (i, c.index) not in sent_echo:
                        sent_echo.add((i, c.index))
                        delta = prompt_text(i) + delta
                    if c.finish_reason == "error":
                        yield _sse(ApiError.engine_failure(c.error).body())
                        continue
                    if not delta and not c.finished and lp_obj is None:
                        continue
                    chunk = {"id": rid, "object": "text_completion", "created": created, "model": self.served_model,
                             "choices": [{"index": i * n + c.index, "text": delta, "logprobs": lp_obj,
                                          "finish_reason": c.finish_reason if c.finished else None,
                                          "stop_reason": c.stop_reason if c.finished else None}]}
                    if continuous:
                        chunk["usage"] = self.usage([item])
                    yield _sse(chunk)
            if include_usage:
                yield _sse({"id": rid, "object": "text_completion", "created": created, "model": self.served_model,
                            "choices": [], "usage": self.usage(list(last.values()))})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def chat(self, request: Request) -> Response:
        body: ChatCompletionRequest = await self.parse(request, ChatCompletionRequest)
        self.check_model(body.model)
        if self.tok is None or not self.tok.has_chat_template:
            raise ApiError(400, "messages: this model has no chat template", param="messages")
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs: only allowed when logprobs is true", param="top_logprobs")
        try:
            msgs = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                    for m in body.messages]
            text = self.tok.apply_chat_template(msgs, add_generation_prompt=body.add_generation_prompt,
                                                **(body.chat_template_kwargs or {}))
        except Exception as e:  # a template that rejects the conversation (e.g. roles out of order)
            raise ApiError(400, f"messages: {e}", param="messages") from None
        ids = self.prompt_ids(self.tok.encode(text, add_special_tokens=False))
        max_tokens = body.max_completion_tokens or body.max_tokens or (self.engine.max_model_len - len(ids))
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = self.sampling(body, max(1, max_tokens), logprobs, None)
        self.validate(ids, params)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        jobs = [(rid, ids, params)]
        await self.first_check(jobs)
        created = int(time.time())

        if not body.stream:
            outs = await self.run_all(request, jobs)
            self.raise_if_failed(outs)
            o = outs[0]
            choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                        "logprobs": self.chat_logprobs(c.token_ids, c.logprobs or []) if body.logprobs else None,
                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for c in o.outputs]
            return JSONResponse({"id": rid, "object": "chat.completion", "created": created,
                                 "model": self.served_model, "choices": choices, "usage": self.usage(outs)})

        include_usage, continuous = self.usage_flags(body)

        def chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> str:
            c: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created,
                                 "model": self.served_model, "choices": choices}
            if usage is not None:
                c["usage"] = usage
            return _sse(c)

        async def events() -> AsyncIterator[str]:
            last = None
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for i in range(params.n)])
            async for _, item in self.stream_all(jobs):
                if isinstance(item, BaseException):
                    yield _sse(ApiError.of(item).body())
                    break
                last = item
                for c in item.outputs:
                    if c.finish_reason == "error":
                        yield _sse(ApiError.engine_failure(c.error).body())
                        continue
                    if not c.delta_text and not c.finished:
                        continue
                    lp = None
                    if body.logprobs and c.delta_token_ids:
                        k = len(c.delta_token_ids)
                        lp = self.chat_logprobs(c.delta_token_ids, list((c.logprobs or [])[-k:]))
                    yield chunk([{"index": c.index, "delta": {"content": c.delta_text} if c.delta_text else {},
                                  "logprobs": lp, "finish_reason": c.finish_reason if c.finished else None,
                                  "stop_reason": c.stop_reason if c.finished else None}],
                                self.usage([item]) if continuous else None)
            if include_usage and last is not None:
                yield chunk([], self.usage([last]))
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def tokenize(self, request: Request) -> Response:
        body: TokenizeRequest = await self.parse(request, TokenizeRequest)
        self.check_model(body.model)
        if self.tok is None:
            raise ApiError(400, "this model has no tokenizer")
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give exactly one of prompt or messages", param="prompt")
        if body.messages is not None:
            text = self.tok.apply_chat_template([{"role": m.role, "content": m.text()} for m in body.messages],
                                                add_generation_prompt=body.add_generation_prompt)
            ids = self.tok.encode(text, add_special_tokens=False)
        else:
            ids = self.tok.encode(body.prompt or "", add_special_tokens=body.add_special_tokens)
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": self.engine.max_model_len})

    async def detokenize(self, request: Request) -> Response:
        body: DetokenizeRequest = await self.parse(request, DetokenizeRequest)
        self.check_model(body.model)
        if self.tok is None:
            raise ApiError(400, "this model has no tokenizer")
        bad = next((t for t in body.tokens if not 0 <= t < self.engine.vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"tokens: token id {bad} is outside the vocabulary [0, {self.engine.vocab_size})",
                           param="tokens")
        return JSONResponse({"prompt": self.tok.decode(body.tokens, skip_special_tokens=False)})

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": self.served_model, "object": "model", "created": int(time.time()), "owned_by": "lmserve",
            "root": self.engine.config.model, "max_model_len": self.engine.max_model_len}]})


def build_app(ae: AsyncEngine, served_model: str, api_key: str | None = None, max_body_bytes: int = 4 * 2**20,
              request_timeout: float | None = None, manage_engine: bool = True) -> FastAPI:
    """The ASGI app. With manage_engine, the app starts the engine loop on startup and stops it on shutdown."""
    from contextlib import asynccontextmanager

    srv = OpenAIServer(ae, served_model, api_key, max_body_bytes, request_timeout)

    @asynccontextmanager
    async def lifespan(app: FastAPI):  # type: ignore[no-untyped-def]
        if manage_engine:
            ae.start()
        yield
        if manage_engine:
            ae.shutdown()

    app = FastAPI(title="lmserve", lifespan=lifespan)
    app.state.server = srv

    @app.middleware("http")
    async def auth(request: Request, call_next):  # type: ignore[no-untyped-def]
        if srv.api_key and request.url.path.startswith("/v1"):
            header = request.headers.get("authorization", "")
            token = header[7:] if header.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(token.encode(), srv.api_key.encode()):
                return ApiError(401, "invalid or missing API key", type_="authentication_error",
                                code="invalid_api_key").response()
        try:
            return await call_next(request)
        except ApiError as e:
            return e.response()

    @app.exception_handler(ApiError)
    async def api_error(_: Request, e: ApiError) -> Response:
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> Response:
        return ApiError(e.status_code, str(e.detail), type_="invalid_request_error").response()

    @app.exception_handler(Exception)
    async def internal(_: Request, e: Exception) -> Response:
        return ApiError(500, f"internal error: {type(e).__name__}: {e}", type_="server_error").response()

    app.add_api_route("/v1/completions", srv.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", srv.chat, methods=["POST"])
    app.add_api_route("/v1/models", srv.models, methods=["GET"])
    app.add_api_route("/tokenize", srv.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", srv.detokenize, methods=["POST"])

    @app.get("/health")
    async def health() -> Response:
        if ae.alive:
            return PlainTextResponse("ok")
        return ApiError(503, "the engine loop is not running", type_="server_error").response()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(srv.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
