"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens, a chat completion underneath.

`MessagesRequest.to_chat` turns the body into a ChatCompletionRequest: `system` a system message first;
a user message's text blocks a user message and its tool_result blocks tool messages (in their order);
an assistant message's text its content and its tool_use blocks its tool_calls; tools ({name,
description, input_schema}) and tool_choice (auto / any / tool / none) in the chat form. That request is
rendered by the chat template and run like any chat completion (OpenAIServer.respond); a ChatFormatter
reads the output, its tool calls included, and `MessagesFormatter` writes what it read as a message
(text and tool_use blocks, stop_reason), or as Anthropic's event stream. count_tokens renders the same
prompt and counts it. Errors on these routes have Anthropic's shape (`error_response`), and the API key
may come as `x-api-key` (app.py's auth)."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field, StrictBool, field_validator

from lmserve.chat_template import join_text
from lmserve.outputs import CompletionOutput, RequestOutput
from lmserve.server import openapi as oa
from lmserve.server.errors import ApiError, invalid_request
from lmserve.server.fields import Float, Int, JsonBody
from lmserve.server.formatting import ChatFormatter, Formatter, sse_json
from lmserve.server.protocol import BaseRequest, ChatCompletionRequest, ChatMessage
from lmserve.server.tool_parsers import ToolParser
from lmserve.server.tool_schema import check_tools
from lmserve.tokenizer import Tokenizer

ROUTE = "/v1/messages"
ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 408: "timeout_error",
               413: "request_too_large", 429: "rate_limit_error", 504: "timeout_error", 529: "overloaded_error"}
# how this API names the fields of the chat request it becomes (for errors)
RENAMES = (("response_format.json_schema.schema", "output_config.format.schema"), ("response_format", "output_config"),
           ("prompt", "messages"), ("stop", "stop_sequences"), (".function.parameters", ".input_schema"),
           (".function", ""), ("structured_outputs.json", "tools"), ("structured_outputs", "tools"))
CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # tool_choice type -> chat tool_choice


def is_route(path: str) -> bool:
    """Whether a request path is one of this API's."""
    return path == ROUTE or path.startswith(ROUTE + "/")


def error_response(e: ApiError) -> JSONResponse:
    """An error in Anthropic's shape: {"type": "error", "error": {"type", "message"}}, same status."""
    kind = ERROR_TYPES.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    return JSONResponse({"type": "error", "error": {"type": kind, "message": e.message}}, status_code=e.status,
                        headers=e.headers)


def block(b: Any, at: str, kinds: tuple[str, ...]) -> dict[str, Any]:
    """A content block of one of these kinds; ValueError naming it otherwise."""
    if not isinstance(b, dict):
        raise ValueError(f"{at}: must be an object")
    if b.get("type") not in kinds:
        raise ValueError(f"{at}.type: {b.get('type')!r} is not supported here (only {', '.join(kinds)})")
    return b


def field(b: dict[str, Any], key: str, kind: type, at: str) -> Any:
    """b[key], which must be a kind (str, dict); ValueError naming it otherwise."""
    if not isinstance(b.get(key), kind):
        raise ValueError(f"{at}.{key}: must be {'a string' if kind is str else 'an object'}")
    return b[key]


def text_of(content: Any, at: str) -> str:
    """A string, or text blocks joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{at}: must be a string or a list of text blocks")
    return join_text(field(block(b, f"{at}[{j}]", ("text",)), "text", str, f"{at}[{j}]") for j, b in enumerate(content))


class ToolChoice(JsonBody):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: StrictBool = False


class Message(JsonBody):
    role: Literal["user", "assistant"]
    content: Any  # a string or a list of content blocks

    @field_validator("content")
    @classmethod
    def _text_or_blocks(cls, v: Any) -> Any:
        if not isinstance(v, (str, list)) or not v:
            raise ValueError("must be a non-empty string or list of content blocks")
        return v


class CountTokensRequest(BaseRequest):
    """The conversation and its tools: what /v1/messages/count_tokens counts and /v1/messages renders."""

    model: str
    system: Any = None  # a string or a list of text blocks
    messages: list[Message] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None

    @field_validator("system")
    @classmethod
    def _system_kind(cls, v: Any) -> Any:
        if v is not None and not isinstance(v, (str, list)):
            raise ValueError("must be a string or a list of text blocks")
        return v

    def check(self) -> None:
        if self.messages[-1].role != "user":
            raise ValueError("messages: the last message must be a user message (assistant prefill is not "
                             "supported)")
        tc = self.tool_choice
        if tc is not None and tc.type == "tool" and not tc.name:
            raise ValueError("tool_choice.name: is required for type 'tool'")

    def chat_messages(self) -> list[ChatMessage]:
        """The conversation as chat messages; ValueError naming the block that is bad."""
        msgs: list[dict[str, Any]] = []
        if self.system:
            msgs.append({"role": "system", "content": text_of(self.system, "system")})
        uses: set[str] = set()  # tool_use ids so far
        for i, m in enumerate(self.messages):
            at = f"messages[{i}].content"
            blocks = [{"type": "text", "text": m.content}] if isinstance(m.content, str) else m.content
            if m.role == "assistant":
                texts, calls = [], []
                for j, b in enumerate(blocks):
                    b = block(b, f"{at}[{j}]", ("text", "tool_use"))
                    if b["type"] == "text":
                        texts.append(field(b, "text", str, f"{at}[{j}]"))
                        continue
                    uid = field(b, "id", str, f"{at}[{j}]")
                    uses.add(uid)
                    calls.append({"id": uid, "type": "function", "function": {
                        "name": field(b, "name", str, f"{at}[{j}]"),
                        "arguments": json.dumps(field(b, "input", dict, f"{at}[{j}]"), ensure_ascii=False)}})
                msgs.append({"role": "assistant", "content": join_text(texts), "tool_calls": calls or None})
                continue
            user: dict[str, Any] | None = None  # the user message this message's text blocks go to
            for j, b in enumerate(blocks):
                b = block(b, f"{at}[{j}]", ("text", "tool_result"))
                if b["type"] == "text":
                    if user is None:
                        user = {"role": "user", "content": []}  # its text blocks, joined below
                        msgs.append(user)
                    user["content"].append(field(b, "text", str, f"{at}[{j}]"))
                    continue
                uid = field(b, "tool_use_id", str, f"{at}[{j}]")
                if uid not in uses:
                    raise ValueError(f"{at}[{j}].tool_use_id: no tool_use block before it has id {uid!r}")
                result = text_of(b.get("content") or "", f"{at}[{j}].content")
                msgs.append({"role": "tool", "tool_call_id": uid,
                             "content": f"Error: {result}" if b.get("is_error") is True else result})
                user = None
        return [ChatMessage(**{**m, "content": join_text(m["content"]) if isinstance(m["content"], list) else m["content"]})
                for m in msgs]

    def chat_tools(self) -> list[dict[str, Any]] | None:
        """The tools in the chat form, checked (tool_parsers.check_tools); ValueError naming the (chat) field."""
        if self.tools is None:
            return None
        out = []
        for i, t in enumerate(self.tools):
            if t.get("type") not in (None, "custom"):
                raise ValueError(f"tools[{i}].type: {t['type']!r} is not supported (custom tools only: name, "
                                 "description, input_schema)")
            if t.get("input_schema") is None:
                raise ValueError(f"tools[{i}].input_schema: is required")
            fn = {"name": t.get("name"), "parameters": t["input_schema"]}
            out.append({"type": "function", "function": {**fn, **({"description": t["description"]}
                                                                   if "description" in t else {})}})
        return check_tools(out)


class OutputFormat(JsonBody):
    """Anthropic's structured outputs: the answer is JSON under this schema (constrained decoding, as chat's
    response_format json_schema)."""

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(JsonBody):
    format: OutputFormat | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: Int = Field(ge=1)
    stop_sequences: list[str] | None = None  # bounded as chat's stop (ServerLimits.max_stop)
    temperature: Float | None = None
    top_p: Float | None = None
    top_k: Int | None = None
    stream: StrictBool | None = False
    null_is_default = ("stream",)
    output_config: OutputConfig | None = None

    def to_chat(self) -> ChatCompletionRequest:
        """The chat completion this request is, checked; ValueError naming the (chat) field."""
        tc = self.tool_choice
        choice = None if tc is None else ({"type": "function", "function": {"name": tc.name}} if tc.type == "tool"
                                          else CHOICES[tc.type])
        chat = ChatCompletionRequest(
            model=self.model, cache_salt=self.cache_salt, messages=self.chat_messages(), max_tokens=self.max_tokens,
            stop=self.stop_sequences,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, tools=self.chat_tools(),
            tool_choice=choice, parallel_tool_calls=not (tc and tc.disable_parallel_tool_use), stream=self.stream,
            response_format=None if self.output_config is None or self.output_config.format is None else {
                "type": "json_schema", "json_schema": {"name": "output", "schema": self.output_config.format.schema_}})
        chat.check()
        return chat


def tool_use(call: dict[str, Any]) -> dict[str, Any]:
    """A chat tool call as a tool_use block ("toolu_" ids)."""
    return {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"), "name": call["function"]["name"],
            "input": json.loads(call["function"]["arguments"])}


class MessagesFormatter(Formatter):
    """A message, whole or as Anthropic's event stream, from what a ChatFormatter reads."""

    def __init__(self, rid: str, model: str, tokenizer: Tokenizer | None, chat: ChatCompletionRequest,
                 tool_parser: type[ToolParser], prompt_len: int) -> None:
        super().__init__(rid, model, tokenizer)
        self.chat = ChatFormatter(rid, model, tokenizer, chat, tool_parser)
        self.prompt_len = prompt_len

    @staticmethod
    def stop(c: CompletionOutput, called: bool) -> tuple[str | None, str | None]:
        """(stop_reason, stop_sequence) of a finished output."""
        if c.finish_reason == "length":
            return "max_tokens", None
        if called:
            return "tool_use", None
        if isinstance(c.stop_reason, str):  # a stop string (a stop token is an int)
            return "stop_sequence", c.stop_reason
        return "end_turn", None

    def message(self, content: list[dict[str, Any]], c: CompletionOutput | None) -> dict[str, Any]:
        """The message object (c: the finished output; None: a message just started)."""
        reason, seq = self.stop(c, any(b["type"] == "tool_use" for b in content)) if c else (None, None)
        return {"id": self.rid, "type": "message", "role": "assistant", "content": content, "model": self.model,
                "stop_reason": reason, "stop_sequence": seq,
                "usage": {"input_tokens": self.prompt_len, "output_tokens": len(c.token_ids) if c else 0}}

    def response(self, outs: list[RequestOutput]) -> dict[str, Any]:
        c = outs[0].outputs[0]
        return self.message([{"type": "text", "text": p} if isinstance(p, str) else tool_use(p.openai())
                             for p in self.chat.segments(c.text)], c)  # in the model's order, as streamed

    @staticmethod
    def event(type_: str, **fields: Any) -> str:
        """One SSE event: `event: <type>` and its JSON."""
        return f"event: {type_}\ndata: {sse_json({'type': type_, **fields})}\n\n"

    async def events(self, outputs: AsyncIterator[tuple[int, RequestOutput | BaseException]], include_usage: bool,
                     continuous: bool) -> AsyncIterator[str]:
        """message_start, ping; per content block start, deltas (text_delta / input_json_delta), stop; then
        message_delta (stop_reason, output_tokens) and message_stop; an error event on a failure."""
        yield self.event("message_start", message=self.message([], None))
        yield self.event("ping")
        index, kind, called = -1, None, False  # the open block's index and type
        async for _, out in outputs:
            c = out.outputs[0] if isinstance(out, RequestOutput) else None
            if c is None or c.finish_reason == "error":
                err = ApiError.engine_failure(c.error, c.error_status) if c is not None else ApiError.of(out)  # type: ignore[arg-type]
                yield self.event("error", error=json.loads(error_response(err).body)["error"])
                return
            for choice in self.chat.deltas(0, c):
                d = choice["delta"]
                if d.get("content"):
                    if kind != "text":
                        if kind is not None:
                            yield self.event("content_block_stop", index=index)
                        index, kind = index + 1, "text"
                        yield self.event("content_block_start", index=index, content_block={"type": "text", "text": ""})
                    yield self.event("content_block_delta", index=index,
                                     delta={"type": "text_delta", "text": d["content"]})
                for tc in d.get("tool_calls") or []:
                    if "id" in tc:  # a new call: its id and name
                        if kind is not None:
                            yield self.event("content_block_stop", index=index)
                        index, kind, called = index + 1, "tool_use", True
                        start = tool_use({**tc, "function": {**tc["function"], "arguments": "{}"}})  # input {}
                        yield self.event("content_block_start", index=index, content_block=start)
                    if tc["function"]["arguments"]:
                        yield self.event("content_block_delta", index=index, delta={
                            "type": "input_json_delta", "partial_json": tc["function"]["arguments"]})
            if c.finished:
                if kind is not None:
                    yield self.event("content_block_stop", index=index)
                reason, seq = self.stop(c, called)
                yield self.event("message_delta", delta={"stop_reason": reason, "stop_sequence": seq},
                                 usage={"output_tokens": len(c.token_ids)})
                yield self.event("message_stop")
                return


def register(app: FastAPI, srv: Any) -> list[type[BaseRequest]]:
    """Add POST /v1/messages and /v1/messages/count_tokens to the app, served by srv (the app's
    OpenAIServer); returns the request models they read (for the OpenAPI document)."""

    async def create(request: Request) -> Response:
        body = await srv.parse(request, MessagesRequest)
        with invalid_request(RENAMES):  # everything checked, and named as this API names it, first
            chat = body.to_chat()
            ids, req = await srv.prepare_chat(chat.messages, True, chat.template_kwargs(), chat)
            rid = f"msg_{uuid.uuid4().hex}"
            jobs = [(rid, req)]
        fmt = MessagesFormatter(rid, srv.response_model(body), srv.ae.tokenizer, chat, srv.tool_parser, len(ids))
        return await srv.respond(request, chat, jobs, fmt)

    async def count_tokens(request: Request) -> Response:
        body = await srv.parse(request, CountTokensRequest)
        with invalid_request(RENAMES):
            tools = body.chat_tools()
            ids = await srv.chat_ids_async(body.chat_messages(), True, {"tools": tools} if tools else None)
        return JSONResponse({"input_tokens": len(ids)})

    app.add_api_route(ROUTE, create, methods=["POST"],
                      **oa.generating(oa.MessageObject, MessagesRequest, oa.AnthropicErrorResponse))
    app.add_api_route(ROUTE + "/count_tokens", count_tokens, methods=["POST"],
                      **oa.generating(oa.CountTokensResponse, CountTokensRequest, oa.AnthropicErrorResponse,
                                      stream=False))
    return [MessagesRequest, CountTokensRequest]
