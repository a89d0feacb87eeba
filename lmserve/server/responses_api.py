"""OpenAI's Responses API, stateless: POST /v1/responses, a chat completion underneath.

`ResponsesRequest.to_chat` turns the body into a ChatCompletionRequest: `instructions` a system message
first, input items chat messages (a developer message a system one; function_call items an assistant
message's tool_calls, function_call_output items tool messages), function tools and tool_choice in the
chat form, `text.format` a response_format. That request is rendered by the chat template and run like
any chat completion (OpenAIServer.respond); a ChatFormatter reads the output, its tool calls included,
and `ResponsesFormatter` writes what it read as a response object, or as the Responses event stream
(`response.created` ... `response.completed`, each SSE event named by its type). Nothing is stored:
`store: true`, `previous_response_id` and `conversation` are refused."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import Field, StrictBool, ValidationError, field_validator

from lmserve.chat_template import join_text
from lmserve.outputs import RequestOutput
from lmserve.server import openapi as oa
from lmserve.server.errors import ApiError, invalid_request
from lmserve.server.fields import Float, Int, JsonBody
from lmserve.server.formatting import ChatFormatter, Formatter, sse_json
from lmserve.server.protocol import BaseRequest, ChatCompletionRequest, ChatMessage
from lmserve.server.tool_parsers import ToolParser
from lmserve.tokenizer import Tokenizer

ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text")
STATELESS = "this server is stateless (it stores no responses); send the whole conversation as input"
LOGPROBS = "message.output_text.logprobs"  # the `include` value that asks for the answer's logprobs


class InputItem(JsonBody):
    """An input item: a message (the default type), a function_call or a function_call_output."""

    type: Literal["message", "function_call", "function_call_output"] = "message"
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: Any = None  # a string or a list of parts (text_of reads them)
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: Any = None  # the same

    @field_validator("content", "output")
    @classmethod
    def _text_or_parts(cls, v: Any) -> Any:
        if v is not None and not isinstance(v, (str, list)):
            raise ValueError("must be a string or a list of content parts")
        return v


class TextFormat(JsonBody):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None  # (json_schema's: "response" when it has none; the other two have no name)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class TextConfig(JsonBody):
    format: TextFormat | None = None


def each(items: list[Any], model: type[JsonBody], at: str) -> list[Any]:
    """items validated as model, one by one, so that an error names the item: 'input[2].role: ...'."""
    out = []
    for i, item in enumerate(items):
        try:
            out.append(model.model_validate(item))
        except ValidationError as e:
            err = e.errors()[0]
            loc = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"])
            raise ValueError(f"{at}[{i}]{loc}: {err['msg']}") from None
    return out


def text_of(content: str | list[Any], at: str) -> str:
    """A message's (or a call output's) text: the string, or its text parts joined."""
    if isinstance(content, str):
        return content
    for j, p in enumerate(content):
        if not isinstance(p, dict) or p.get("type") not in TEXT_PARTS:
            kind = p.get("type") if isinstance(p, dict) else p
            raise ValueError(f"{at}[{j}].type: {kind!r} is not supported (input_text and output_text parts only)")
        if not isinstance(p.get("text"), str):
            raise ValueError(f"{at}[{j}].text: must be a string")
    return join_text(p["text"] for p in content)


class ResponsesRequest(BaseRequest):
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: Int | None = Field(None, ge=1)
    temperature: Float | None = None
    top_p: Float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = True
    text: TextConfig | None = None
    stream: StrictBool | None = False
    null_is_default = ("parallel_tool_calls", "stream")  # (OpenAI's "boolean or null")
    store: StrictBool | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    include: list[str] | None = None  # "message.output_text.logprobs": the answer's tokens' log-probabilities
    top_logprobs: Int | None = Field(None, ge=0)  # with them, the k most likely alternatives of each token

    @field_validator("input", mode="before")
    @classmethod
    def _input_kind(cls, v: Any) -> Any:
        if not isinstance(v, (str, list)):
            raise ValueError("must be a string or a list of input items")
        return v

    def check(self) -> None:
        for name in ("store", "previous_response_id", "conversation"):
            if getattr(self, name):
                raise ValueError(f"{name}: {STATELESS}")
        if not self.input:
            raise ValueError("input: must not be empty")
        tc = self.tool_choice
        if not (tc in (None, "none", "auto", "required") or (isinstance(tc, dict) and tc.get("type") == "function"
                                                              and isinstance(tc.get("name"), str))):
            raise ValueError("tool_choice: must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}")
        fmt = self.text.format if self.text else None
        if fmt is not None and fmt.type == "json_schema" and fmt.schema_ is None:
            raise ValueError("text.format.schema: is required for type json_schema")
        if self.logprobs and self.tools:  # (an answer's text is cut around its calls; its tokens are not)
            raise ValueError("include: message.output_text.logprobs is not supported with tools")

    @property
    def logprobs(self) -> bool:
        """Whether the answer's output_text carries its tokens' log-probabilities."""
        return LOGPROBS in (self.include or ())

    def renames(self) -> tuple[tuple[str, str], ...]:
        """How this API names the fields of the chat request it becomes (for errors)."""
        fmt = self.text.format if self.text else None
        constraint = "text.format.schema" if fmt is not None and fmt.type == "json_schema" else "tools"
        return (("messages", "input"), ("prompt", "input"), ("max_tokens", "max_output_tokens"), (".function", ""),
                ("top_logprobs: only allowed when logprobs is true", f"top_logprobs: only allowed with include {LOGPROBS}"),
                ("response_format.json_schema.schema", "text.format.schema"), ("response_format", "text.format"),
                ("structured_outputs.json", constraint), ("structured_outputs", constraint))

    def messages(self) -> list[ChatMessage]:
        """The conversation as chat messages; ValueError naming the input item that is bad."""
        msgs: list[dict[str, Any]] = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            return [ChatMessage(**m) for m in msgs + [{"role": "user", "content": self.input}]]
        calls: set[str] = set()
        for i, item in enumerate(each(self.input, InputItem, "input")):
            at = f"input[{i}]"
            need = {"message": ("role", "content"), "function_call": ("call_id", "name", "arguments"),
                    "function_call_output": ("call_id", "output")}[item.type]
            missing = next((f for f in need if getattr(item, f) is None), None)
            if missing is not None:
                raise ValueError(f"{at}.{missing}: is required for a {item.type} item")
            if item.type == "message":
                msgs.append({"role": ROLES[item.role], "content": text_of(item.content, f"{at}.content")})
            elif item.type == "function_call":
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                calls.add(item.call_id)  # type: ignore[arg-type]
                if msgs and msgs[-1]["role"] == "assistant":  # the calls of one assistant turn
                    msgs[-1].setdefault("tool_calls", []).append(call)
                else:
                    msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
            else:
                if item.call_id not in calls:
                    raise ValueError(f"{at}.call_id: no function_call item before it has call_id {item.call_id!r}")
                msgs.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": text_of(item.output, f"{at}.output")})  # type: ignore[arg-type]
        return [ChatMessage(**m) for m in msgs]

    def to_chat(self) -> ChatCompletionRequest:
        """The chat completion this request is, checked; ValueError naming the (chat) field."""
        tools = None if self.tools is None else [
            {"type": t.get("type"), "function": {k: t[k] for k in ("name", "description", "parameters", "strict")
                                                 if k in t}} for t in self.tools]
        tc = self.tool_choice
        fmt = self.text.format if self.text else None
        chat = ChatCompletionRequest(
            model=self.model, cache_salt=self.cache_salt, messages=self.messages(),
            max_completion_tokens=self.max_output_tokens, temperature=self.temperature,
            top_p=self.top_p, tools=tools, parallel_tool_calls=self.parallel_tool_calls, stream=self.stream,
            logprobs=self.logprobs, top_logprobs=self.top_logprobs if self.logprobs else None,
            tool_choice={"type": "function", "function": {"name": tc["name"]}} if isinstance(tc, dict) else tc,
            response_format=None if fmt is None or fmt.type == "text" else {
                "type": fmt.type, "json_schema": {"name": fmt.name or "response", "description": fmt.description,
                                                  "schema": fmt.schema_, "strict": fmt.strict}})
        chat.check()
        return chat


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesFormatter(Formatter):
    """A response object, whole or as the Responses event stream, from what a ChatFormatter reads."""

    object = "response"

    def __init__(self, rid: str, model: str, tokenizer: Tokenizer | None, body: ResponsesRequest,
                 chat: ChatCompletionRequest, tool_parser: type[ToolParser], sampling: tuple[float, float] = (1.0, 1.0)
                 ) -> None:
        super().__init__(rid, model, tokenizer)
        self.body = body
        self.sampling = sampling  # (temperature, top_p) the request ran with: the model's defaults where unset
        self.chat = ChatFormatter(rid, model, tokenizer, chat, tool_parser)
        self.seq = 0  # the next event's sequence_number

    def envelope(self, status: str, output: list[dict[str, Any]], out: RequestOutput | None) -> dict[str, Any]:
        """The response object: its status, output items and (out finished) usage."""
        b = self.body
        fmt = b.text.format.model_dump(by_alias=True, exclude_none=True) if b.text and b.text.format else None
        if fmt is not None and fmt["type"] == "json_schema":
            fmt.setdefault("name", "response")  # (the name it ran under)
        usage = None
        if out is not None:
            n_in, n_out = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
            usage = {"input_tokens": n_in, "input_tokens_details": {"cached_tokens": out.metrics.num_cached_tokens,
                                                                    "cache_write_tokens": 0},  # (the SDK requires it)
                     "output_tokens": n_out, "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": n_in + n_out}
        return {"id": self.rid, "object": "response", "created_at": self.created, "status": status, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "model": self.model,
                "output": output, "parallel_tool_calls": b.parallel_tool_calls, "previous_response_id": None,
                "store": False, "temperature": self.sampling[0], "top_p": self.sampling[1],
                "text": {"format": fmt or {"type": "text"}},
                "tool_choice": b.tool_choice or "auto", "tools": b.tools or [], "truncation": "disabled",
                "usage": usage}

    @staticmethod
    def status(finish_reason: str | None) -> str:
        return "incomplete" if finish_reason == "length" else "completed"

    @staticmethod
    def message_item(text: str | None, status: str, mid: str | None = None, logprobs: list | None = None
                     ) -> dict[str, Any]:
        """A message item with its output_text (none: a message just opened) and its tokens' logprobs."""
        return {"id": mid or new_id("msg"), "type": "message", "status": status, "role": "assistant",
                "content": [] if text is None else [{"type": "output_text", "text": text, "annotations": [],
                                                     "logprobs": logprobs or []}]}

    @staticmethod
    def call_item(call_id: str, name: str, arguments: str, status: str, fid: str | None = None) -> dict[str, Any]:
        return {"id": fid or new_id("fc"), "type": "function_call", "status": status, "call_id": call_id,
                "name": name, "arguments": arguments}

    def response(self, outs: list[RequestOutput]) -> dict[str, Any]:
        out = outs[0]
        status = self.status(out.outputs[0].finish_reason)
        c = out.outputs[0]
        lps = self.chat.logprobs(c.token_ids, c.logprobs or [])["content"] if self.body.logprobs else None
        parts = self.chat.segments(out.outputs[0].text)  # in the model's order, as the stream has them; each
        items = [self.message_item(p, st, logprobs=lps) if isinstance(p, str)  # done but the last, which takes
                 else self.call_item(p.id, p.name, p.arguments, st)  # the response's status (the stream's too)
                 for k, p in enumerate(parts) for st in [status if k == len(parts) - 1 else "completed"]]
        return self.envelope(status, items or [self.message_item("", status, logprobs=lps)], out)

    # ------------------------------------------------------------ streaming
    def event(self, type_: str, **fields: Any) -> str:
        """One SSE event: `event: <type>` and its JSON, numbered."""
        data = {"type": type_, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {type_}\ndata: {sse_json(data)}\n\n"

    def open_item(self, items: list[dict[str, Any]], item: dict[str, Any]) -> list[str]:
        """Events that add an output item (in progress) to the stream."""
        items.append(item)
        ev = [self.event("response.output_item.added", output_index=len(items) - 1, item=item)]
        if item["type"] == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            ev.append(self.event("response.content_part.added", item_id=item["id"], output_index=len(items) - 1,
                                 content_index=0, part=part))
        return ev

    def close_item(self, items: list[dict[str, Any]], text: str, status: str, logprobs: list | None = None
                   ) -> list[str]:
        """Events that finish the last output item (text: its text or arguments so far)."""
        i, item = len(items) - 1, items[-1]
        if item["type"] == "message":
            done = self.message_item(text, status, item["id"], logprobs)
            part = done["content"][0]
            ev = [self.event("response.output_text.done", item_id=item["id"], output_index=i, content_index=0,
                             text=text, logprobs=logprobs or []),
                  self.event("response.content_part.done", item_id=item["id"], output_index=i, content_index=0,
                             part=part)]
        else:
            done = self.call_item(item["call_id"], item["name"], text, status, item["id"])
            ev = [self.event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                             name=item["name"], arguments=text)]
        items[-1] = done
        return ev + [self.event("response.output_item.done", output_index=i, item=done)]

    async def events(self, outputs: AsyncIterator[tuple[int, RequestOutput | BaseException]], include_usage: bool,
                     continuous: bool) -> AsyncIterator[str]:
        """The Responses event stream: created, in_progress; per output item added, its deltas, done;
        then completed (incomplete when cut by max_output_tokens; failed on an error)."""
        yield self.event("response.created", response=self.envelope("in_progress", [], None))
        yield self.event("response.in_progress", response=self.envelope("in_progress", [], None))
        items: list[dict[str, Any]] = []
        text, is_open = "", False  # the open (last) item's text or arguments so far
        lps: list[dict[str, Any]] = []  # the answer's tokens' logprobs so far (include: without tools, one message)
        async for _, out in outputs:
            c = out.outputs[0] if isinstance(out, RequestOutput) else None
            if c is None or c.finish_reason == "error":
                err = ApiError.engine_failure(c.error, c.error_status) if c is not None else ApiError.of(out)  # type: ignore[arg-type]
                failed = {**self.envelope("failed", items, None),
                          "error": {"code": err.code or err.type, "message": err.message}}
                yield self.event("response.failed", response=failed)
                return
            for choice in self.chat.deltas(0, c):
                d = choice["delta"]
                new = ((choice.get("logprobs") or {}).get("content") or []) if self.body.logprobs else []
                lps += new  # (a last chunk without text may still bring some: the done events have them all)
                if d.get("content"):
                    if is_open and items[-1]["type"] != "message":
                        for e in self.close_item(items, text, "completed"):
                            yield e
                        is_open = False
                    if not is_open:
                        for e in self.open_item(items, self.message_item(None, "in_progress")):
                            yield e
                        text, is_open = "", True
                    text += d["content"]
                    yield self.event("response.output_text.delta", item_id=items[-1]["id"],
                                     output_index=len(items) - 1, content_index=0, delta=d["content"], logprobs=new)
                for tc in d.get("tool_calls") or []:
                    if "id" in tc:  # a new call: its id and name
                        if is_open:
                            for e in self.close_item(items, text, "completed"):
                                yield e
                        for e in self.open_item(items, self.call_item(tc["id"], tc["function"]["name"], "",
                                                                      "in_progress")):
                            yield e
                        text, is_open = "", True
                    if tc["function"]["arguments"]:
                        text += tc["function"]["arguments"]
                        yield self.event("response.function_call_arguments.delta", item_id=items[-1]["id"],
                                         output_index=len(items) - 1, delta=tc["function"]["arguments"])
            if c.finished:
                status = self.status(c.finish_reason)
                if not items:  # nothing was said: an empty message, as the whole response has
                    for e in self.open_item(items, self.message_item(None, "in_progress")):
                        yield e
                    text, is_open = "", True
                if is_open:
                    for e in self.close_item(items, text, status, lps):
                        yield e
                kind = "response.completed" if status == "completed" else "response.incomplete"
                yield self.event(kind, response=self.envelope(status, items, out))
                return


def register(app: FastAPI, srv: Any) -> list[type[BaseRequest]]:
    """Add POST /v1/responses to the app, served by srv (the app's OpenAIServer); returns the request
    models it reads (for the OpenAPI document)."""

    async def create(request: Request) -> Response:
        body = await srv.parse(request, ResponsesRequest)
        with invalid_request(body.renames()):  # everything checked, and named as this API names it, first
            chat = body.to_chat()
            _, req = await srv.prepare_chat(chat.messages, True, chat.template_kwargs(), chat)
            rid = new_id("resp")
            jobs = [(rid, req)]
        fmt = ResponsesFormatter(rid, srv.response_model(body), srv.ae.tokenizer, body, chat, srv.tool_parser,
                                 (req.params.temperature, req.params.top_p))
        return await srv.respond(request, chat, jobs, fmt)

    app.add_api_route("/v1/responses", create, methods=["POST"], **oa.generating(oa.ResponseObject, ResponsesRequest))
    return [ResponsesRequest]
