"""The FastAPI app: OpenAI routes over AsyncEngine. Every request is parsed and validated here, before
it reaches the engine; a bad one gets a 4xx with OpenAI's error body and touches nothing else.

A generating route parses its body, turns it into engine Requests (`engine_request`: tokenized and
validated once) and a Formatter, and hands both to `respond`, the one path that answers with a JSON
body or streams server-sent events. The Responses and Anthropic Messages APIs (responses_api.py,
anthropic_api.py) are chat completions underneath and take the same path."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from lmserve.generation_config import sampling_defaults
from lmserve.inputs import with_salt
from lmserve.outputs import RequestOutput
from lmserve.sequence import Request as EngineRequest
from lmserve.server import anthropic_api, disagg, embeddings_api, lora_api, ops, responses_api, sagemaker, openapi as oa
from lmserve.server.async_engine import AsyncEngine, EngineDeadError, QueueFullError
from lmserve.server.cors import Cors
from lmserve.server.errors import ApiError, field_path, invalid_request
from lmserve.server.gate import Gate
from lmserve.server.limits import ServerLimits
from lmserve.server.lora_api import LoRAModules, model_card
from lmserve.server.formatting import ChatFormatter, CompletionFormatter, Formatter
from lmserve.server.metrics import ServerMetrics
from lmserve.server.protocol import (BaseRequest, ChatCompletionRequest, ChatMessage, CompletionRequest,
                                     DetokenizeRequest, SamplingRequest, TokenizeRequest)
from lmserve.server.streaming import ClosingStream, merge_streams, submit_all
from lmserve.server.tool_parsers import TOOL_PARSERS, parser_for_model
from lmserve.tokenizer import Tokenizer

Job = tuple[str, EngineRequest]  # (request id, the processed request)
Body = TypeVar("Body", bound=BaseRequest)
log = logging.getLogger("lmserve")


class OpenAIServer:
    """Route handlers; holds the engine handle, limits and metrics."""

    def __init__(self, ae: AsyncEngine, served_model: str | Sequence[str], api_key: str | None = None,
                 limits: ServerLimits | None = None, request_timeout: float | None = None,
                 tool_call_parser: str | None = None, auto_tool_choice: bool = True,
                 lora_modules: list[tuple] = ()) -> None:
        self.ae = ae
        self.auto_tool_choice = auto_tool_choice  # off: tool_choice auto is a 400 (vLLM without --enable-auto-tool-choice)
        tok = ae.tokenizer
        name = tool_call_parser or parser_for_model(ae.info()["architecture"], tok.chat_template if tok else None)
        if name not in TOOL_PARSERS:
            raise ValueError(f"tool_call_parser: {name!r} is not one of {', '.join(TOOL_PARSERS)}")
        self.tool_parser = TOOL_PARSERS[name]
        # the names a request may give (vLLM's --served-model-name a b: any of them); responses carry the first
        self.served_models = (served_model,) if isinstance(served_model, str) else tuple(served_model)
        self.served_model = self.served_models[0]
        # LoRA adapters a request may name instead (--lora-modules; loaded now: a bad one fails start-up)
        self.loras = LoRAModules(ae, list(lora_modules), self.served_models)
        self.api_key = api_key
        self.sampling_defaults = sampling_defaults(ae.config)  # the model's, for fields a body leaves unset
        if self.sampling_defaults:
            log.info("sampling defaults from the model's generation config (--generation-config vllm: none): %s",
                     self.sampling_defaults)
        self.limits = limits or ServerLimits()
        self.max_body_bytes, self.request_timeout = self.limits.max_body_bytes, request_timeout
        self.metrics = ServerMetrics(ae, self.served_model)

    # ------------------------------------------------------------ parsing and checks
    async def parse(self, request: Request, model: type[Body]) -> Body:
        """The JSON body as `model`, for the served model, its cross-field rules checked; else a 4xx."""
        data = await self.read_json(request)
        try:
            body = model.model_validate(data)
        except ValidationError as e:
            err = e.errors()[0]
            loc = field_path(err["loc"])
            raise ApiError(400, f"{loc}: {err['msg']}" if loc else err["msg"], param=loc) from None
        if body.model is not None and body.model not in self.model_names():
            raise ApiError(404, f"the model {body.model!r} does not exist; this server serves "
                                f"{', '.join(map(repr, self.model_names()))}",
                           param="model", code="model_not_found")
        with invalid_request():
            self.limits.check(body)  # before anything reads the fields at length
            body.check()
        return body

    def model_names(self) -> tuple[str, ...]:
        """What a request's `model` may be: the served model's names, then the LoRA adapters'."""
        return self.served_models + tuple(self.loras.requests)

    def adapter(self, model: str | None) -> Any:
        """The LoRARequest `model` names (None: the served model); a 404 for an adapter unloaded since then."""
        lora = self.loras.get(model)
        if lora is None and model is not None and model not in self.served_models:
            raise ApiError(404, f"the model {model!r} does not exist (its adapter was unloaded)", param="model",
                           code="model_not_found")
        return lora

    def response_model(self, body: Any) -> str:
        """The `model` a response carries: the adapter the request named, else the served model's first name."""
        return body.model if self.loras.get(body.model) is not None else self.served_model

    async def read_json(self, request: Request) -> dict[str, Any]:
        """A JSON object body within the size limit; else a 4xx."""
        ctype = request.headers.get("content-type", "")
        if ctype.split(";", 1)[0].strip().lower() != "application/json":  # the type itself, as vLLM (CSRF)
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
        # decoding a body of megabytes takes tens of ms: off the event loop, as everything long is
        return await asyncio.to_thread(self.limits.decode_json, bytes(raw))

    def require_tokenizer(self) -> Tokenizer:
        """The model's tokenizer; a 400 if it has none."""
        if self.ae.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer")
        return self.ae.tokenizer

    def chat_ids(self, messages: list[ChatMessage], add_generation_prompt: bool, template_kwargs: dict[str, Any]
                 | None = None, template: str | None = None, add_special_tokens: bool = False) -> list[int]:
        """A conversation rendered by the model's chat template (or a trusted request's own `template`),
        as token ids, within the limits on messages and rendering; a 400 if it cannot be."""
        tok = self.ae.tokenizer
        if tok is None or (template is None and not tok.has_chat_template):
            raise ApiError(400, "messages: this model has no chat template", param="messages")
        with invalid_request():
            self.limits.check_messages(len(messages))
        lim = self.limits
        try:
            text = tok.apply_chat_template([m.for_template() for m in messages],
                                           add_generation_prompt=add_generation_prompt, template=template,
                                           max_chars=lim.template_max_chars, max_seconds=lim.template_max_seconds,
                                           **(template_kwargs or {}))
        except Exception as e:  # a template that rejects the conversation (e.g. roles out of order)
            if isinstance(e, ValueError) and str(e).startswith(("messages:", "chat_template:", "continue_final_message:")):
                raise ApiError.invalid(e) from None  # names its field already
            raise ApiError(400, f"messages: {e}", param="messages") from None
        try:
            return tok.encode(text, add_special_tokens=add_special_tokens)  # (the template wrote its own: off but asked)
        except ValueError as e:  # text the tokenizer cannot take (a lone surrogate in a message)
            raise ApiError(400, f"messages: {str(e).partition(': ')[2]}", param="messages") from None

    def engine_request(self, prompt: str | list[int], body: SamplingRequest) -> EngineRequest:
        """The prompt and the body's sampling options as an engine Request: tokenized and validated once
        (the default max_tokens needs the prompt's length); a 400 naming the field if it is bad."""
        with invalid_request(body.field_renames()):
            structured = body.structured()
            self.limits.check_constraint(structured.key() if structured is not None else None)
            whole = self.ae.tokenize(prompt, getattr(body, "add_special_tokens", True))  # (completions: vLLM's)
            ids = self.ae.truncate(prompt, whole, body.truncate_prompt_tokens)  # (before the default max_tokens)
            family = max(body.n, body.best_of or 0) if body.use_beam_search else 1  # (beams run all at once)
            room = self.ae.room(len(ids), family)  # the default max_tokens: what the context and the pool leave
            params = body.to_sampling_params(room, self.sampling_defaults)
            req = self.ae.process_request(with_salt(ids, body.cache_salt), params, self.adapter(body.model))
            # the text given, when it is what runs (echo): a cut prompt echoes its tokens
            text = prompt if isinstance(prompt, str) and ids is whole else None
            return dataclasses.replace(req, priority=body.priority, prompt=text)

    async def prepare(self, prompt: str | list[int], body: SamplingRequest) -> EngineRequest:
        """engine_request on a worker thread: compiling an output constraint's grammar (the first time a
        schema is seen) may take up to grammar_compile_timeout, which must not hold up the event loop
        and every stream on it."""
        return await asyncio.to_thread(self.engine_request, prompt, body)

    async def prepare_chat(self, messages: list[ChatMessage], add_generation_prompt: bool,
                           template_kwargs: dict[str, Any] | None, body: SamplingRequest
                           ) -> tuple[list[int], EngineRequest]:
        """chat_ids then engine_request, together on a worker thread: a template render (up to its 2 s
        limit), the encoding of a long conversation and a grammar compile must not hold up the event loop."""
        if getattr(body, "tool_mode", "none") == "auto" and not self.auto_tool_choice:
            raise ApiError(400, 'tool_choice: "auto" needs a server started with --enable-auto-tool-choice (it runs '
                           'with --no-enable-auto-tool-choice); name a function or use "required"', param="tool_choice")

        def work() -> tuple[list[int], EngineRequest]:
            with invalid_request():
                self.limits.check(body)  # a converted body (Responses, Messages); before rendering
            ids = self.chat_ids(messages, add_generation_prompt, template_kwargs, getattr(body, "chat_template", None))
            return ids, self.engine_request(ids, body)
        return await asyncio.to_thread(work)

    async def chat_ids_async(self, *args: Any) -> list[int]:
        """chat_ids(*args) on a worker thread (for the routes that only count or return the tokens)."""
        return await asyncio.to_thread(self.chat_ids, *args)

    def first_check(self, jobs: list[Job]) -> None:
        """Refuse at once (before streaming starts) when the engine is dead or the queue is full."""
        if not self.ae.alive:
            raise ApiError(503, "the engine loop is not running", type_="server_error", headers={"Retry-After": "1"})
        if not self.ae.has_room(len(jobs)):
            raise ApiError(429, f"too many requests waiting (limit {self.ae.max_queue})", type_="rate_limit_error",
                           headers={"Retry-After": "1"})

    # ------------------------------------------------------------ running requests
    async def respond(self, request: Request, body: SamplingRequest, jobs: list[Job], fmt: Formatter) -> Response:
        """Run the jobs: one JSON response when they have all finished, or (body.stream) SSE chunks as they go."""
        self.first_check(jobs)
        fmt.details = self.limits.enable_prompt_tokens_details
        if disagg.PUSH_HEADER in request.headers:  # a prefill instance: the prompt only, its KV to a decode one
            return await disagg.prefill_and_push(self, request, jobs, request.headers[disagg.PUSH_HEADER])
        if body.stream:  # queued now: a full queue is a 429 (and a dead engine a 503) before the headers
            streams = submit_all(self.ae, jobs)
            merged = self.stream_all(jobs, streams)
            return ClosingStream(fmt.events(merged, *body.usage_flags()), merged, media_type="text/event-stream",
                                 on_close=lambda: [self.ae.abort(rid) for (rid, _), s in zip(jobs, streams)
                                                   if not s.finished])
        outs = await self.run_all(request, jobs)  # (an output with an error raised its ApiError there)
        return JSONResponse(fmt.response(outs))

    def deadline(self) -> float | None:
        """When a request starting now times out (monotonic clock), if requests do."""
        return time.monotonic() + self.request_timeout if self.request_timeout else None

    def timed_out(self) -> ApiError:
        """The 408 of a request past request_timeout."""
        return ApiError(408, f"request exceeded the {self.request_timeout} s timeout", code="request_timeout")

    async def run_all(self, request: Request, jobs: list[Job]) -> list[RequestOutput]:
        """Run several engine requests to completion; abort them all if the client disconnects, the
        deadline passes or one of them fails (its error answers; the others would run for nobody)."""
        async def one(rid: str, req: EngineRequest) -> RequestOutput:
            last = None
            async for out in self.ae.generate(rid, req):
                failed = next((c for c in out.outputs if c.finish_reason == "error"), None)
                if failed is not None:  # the response is this error: none of the rest need run (closing
                    self.metrics.observe(out, req.params)  # this stream aborts the request's other outputs)
                    raise ApiError.engine_failure(failed.error, failed.error_status)
                last = out
            assert last is not None
            self.metrics.observe(last, req.params)
            return last

        tasks = [asyncio.ensure_future(one(*j)) for j in jobs]
        deadline = self.deadline()
        try:
            while True:
                done, running = await asyncio.wait(tasks, timeout=0.2, return_when=asyncio.FIRST_EXCEPTION)
                errs = [t.exception() for t in done if t.exception() is not None]  # (an ApiError: observed in one())
                if errs:
                    exc = errs[0]
                    self.metrics.failed(sum(not isinstance(e, (ApiError, QueueFullError)) for e in errs))  # each prompt's
                    self.metrics.aborted(len(running))  # the rest end with it; anything else as an ApiError
                    # (the generic handler's re-raise closed the client's keep-alive connection)
                    raise exc if isinstance(exc, (ApiError, QueueFullError, EngineDeadError)) else ApiError(
                        500, f"internal error: {type(exc).__name__}: {exc}", type_="server_error")
                if not running:
                    return [t.result() for t in tasks]
                stop = (ApiError(499, "client disconnected") if await request.is_disconnected() else
                        self.timed_out() if deadline is not None and time.monotonic() > deadline else
                        EngineDeadError("the engine loop is not running") if not self.ae.alive else None)
                if stop is not None:  # (a dead loop that told this request nothing: answered now, not never)
                    self.metrics.aborted(len(running))
                    raise stop
        except QueueFullError as e:
            raise ApiError(429, str(e), type_="rate_limit_error", headers={"Retry-After": "1"}) from None
        except EngineDeadError as e:
            raise ApiError(503, str(e), type_="server_error") from None
        finally:
            for t in tasks:  # cancelled in its generator: AsyncEngine.generate aborts the engine request
                t.cancel()
                if t.done() and not t.cancelled():
                    t.exception()  # retrieved (a second failure beside the one answered is no log noise)

    def stream_all(self, jobs: list[Job], streams: list[Any] | None = None
                   ) -> AsyncIterator[tuple[int, RequestOutput | BaseException]]:
        """The jobs' output streams merged (streaming.merge_streams), within the request timeout."""
        return merge_streams(self.ae, self.metrics, jobs, streams, self.deadline(), self.timed_out)

    # ------------------------------------------------------------ routes
    async def completions(self, request: Request) -> Response:
        """POST /v1/completions: one engine request per prompt."""
        body = await self.parse(request, CompletionRequest)
        rid, prompts = f"cmpl-{uuid.uuid4().hex}", body.prompts()
        with invalid_request():
            self.limits.check_prompts(len(prompts))
        jobs = [(f"{rid}-{i}", await self.prepare(p, body)) for i, p in enumerate(prompts)]
        ran = [req.prompt if req.prompt is not None else req.prompt_token_ids for _, req in jobs]  # (echo's)
        return await self.respond(request, body, jobs,
                                  CompletionFormatter(rid, self.response_model(body), self.ae.tokenizer, body, ran))

    async def chat(self, request: Request) -> Response:
        """POST /v1/chat/completions: the conversation through the chat template, one engine request."""
        body = await self.parse(request, ChatCompletionRequest)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        _, req = await self.prepare_chat(body.messages, body.add_generation_prompt, body.template_kwargs(), body)
        return await self.respond(request, body, [(rid, req)], ChatFormatter(
            rid, self.response_model(body), self.ae.tokenizer, body, self.tool_parser, req.prompt_token_ids))

    async def tokenize(self, request: Request) -> Response:
        """POST /tokenize: a prompt, or messages through the chat template, as token ids."""
        body, tok = await self.parse(request, TokenizeRequest), self.require_tokenizer()
        with invalid_request():
            special = body.add_special_tokens  # (vLLM's default: True for a prompt, False for messages)
            ids = (await self.chat_ids_async(body.messages, body.add_generation_prompt, body.template_kwargs(),
                                             body.chat_template, bool(special)) if body.messages is not None
                   else await asyncio.to_thread(tok.encode, body.prompt or "", add_special_tokens=special is not False))
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": self.ae.max_model_len,
                             "token_strs": tok.convert_ids_to_tokens(ids) if body.return_token_strs else None})

    async def detokenize(self, request: Request) -> Response:
        """POST /detokenize: token ids as text."""
        body = await self.parse(request, DetokenizeRequest)
        tok = self.require_tokenizer()
        bad = next((t for t in body.tokens if not 0 <= t < self.ae.vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"tokens: token id {bad} is outside the vocabulary [0, {self.ae.vocab_size})",
                           param="tokens")
        text = await asyncio.to_thread(tok.decode, body.tokens, skip_special_tokens=False)
        return JSONResponse({"prompt": text})

    async def models(self, request: Request) -> Response:
        """GET /v1/models: a card for each of the served model's names, then the LoRA adapters' (as vLLM)."""
        return JSONResponse({"object": "list", "data": [model_card(name, self.ae.info()["model"], None, self.ae.max_model_len)
                                                        for name in self.served_models]
                             + self.loras.cards(self.served_model, self.ae.max_model_len)})


def build_app(ae: AsyncEngine, served_model: str | Sequence[str], api_key: str | None = None,
              max_body_bytes: int | None = None, request_timeout: float | None = None, manage_engine: bool = True,
              tool_call_parser: str | None = None, limits: ServerLimits | None = None,
              cors: Cors | None = None, auto_tool_choice: bool = True, lora_modules: list[tuple] = (),
              allow_runtime_lora: bool = False) -> FastAPI:
    """The ASGI app. With manage_engine, the app starts the engine loop on startup and stops it on
    shutdown. limits: the bounds on requests (max_body_bytes, when given, replaces theirs); cors: which
    other origins' pages may use it (none by default); lora_modules: [(name, adapter folder)], with
    allow_runtime_lora the routes that load and unload adapters while it runs."""
    limits = limits or ServerLimits()
    if max_body_bytes is not None:
        limits = dataclasses.replace(limits, max_body_bytes=max_body_bytes)
    srv = OpenAIServer(ae, served_model, api_key, limits, request_timeout, tool_call_parser, auto_tool_choice,
                       lora_modules)

    @asynccontextmanager
    async def lifespan(app: FastAPI):  # type: ignore[no-untyped-def]
        if manage_engine:
            ae.start()
        yield
        if manage_engine:
            ae.shutdown()

    app = FastAPI(title="lmserve", lifespan=lifespan)
    app.state.server = srv

    def error(request: Request, e: ApiError) -> Response:
        """e in the error shape of the API the request is for (Anthropic's on its routes)."""
        return anthropic_api.error_response(e) if anthropic_api.is_route(request.url.path) else e.response()

    app.add_middleware(Gate, limits=limits, api_key=srv.api_key, error=error)  # header limits, the API key
    (cors or Cors()).install(app)  # outside the gate: a CORS preflight carries no key

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> Response:
        return error(request, e)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> Response:
        return error(request, ApiError(e.status_code, str(e.detail), type_="invalid_request_error",
                                       headers=getattr(e, "headers", None)))  # a 405's Allow

    @app.exception_handler(Exception)
    async def internal(request: Request, e: Exception) -> Response:
        return error(request, ApiError(500, f"internal error: {type(e).__name__}: {e}", type_="server_error"))

    app.add_api_route("/v1/completions", srv.completions, methods=["POST"],
                      **oa.generating(oa.CompletionResponse, CompletionRequest))
    app.add_api_route("/v1/chat/completions", srv.chat, methods=["POST"],
                      **oa.generating(oa.ChatCompletionResponse, ChatCompletionRequest))
    app.add_api_route("/v1/models", srv.models, methods=["GET"],
                      responses={200: {"model": oa.ModelList}, **oa.errors(statuses=(401,))})
    app.add_api_route("/tokenize", srv.tokenize, methods=["POST"],
                      **oa.generating(oa.TokenizeResponse, TokenizeRequest, stream=False))
    app.add_api_route("/detokenize", srv.detokenize, methods=["POST"],
                      **oa.generating(oa.DetokenizeResponse, DetokenizeRequest, stream=False))
    bodies = [CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest]
    bodies += responses_api.register(app, srv)  # POST /v1/responses
    bodies += anthropic_api.register(app, srv)  # POST /v1/messages, /v1/messages/count_tokens
    bodies += embeddings_api.register(app, srv)  # POST /v1/embeddings
    ops.register(app, ae, srv.metrics)  # /health, /ping, /version, /metrics
    bodies[:0] = sagemaker.register(app, srv)  # POST /invocations (first in the document: it refers to the others)
    if allow_runtime_lora:
        lora_api.register(app, srv)  # POST /v1/load_lora_adapter, /v1/unload_lora_adapter
    oa.document(app, bodies, limits.bounds(ae.max_logprobs), srv.model_names)
    return app
