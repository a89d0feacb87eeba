"""The API's OpenAPI document: every route's request body (the pydantic protocol models, bounds
included), its responses (what the handlers build, as models that allow more fields than they name)
and its errors (OpenAI's error body; Anthropic's on /v1/messages).

The handlers read raw JSON themselves (415 / 413 / 400 in our error shape, before pydantic sees the
body), so the request models are declared here through `openapi_extra` rather than as handler
parameters; `document` adds their schemas to the document's components."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict


class _Out(BaseModel):
    model_config = ConfigDict(extra="allow")


# ---------------------------------------------------------------- errors
class ErrorDetail(_Out):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Out):
    """OpenAI's error body."""

    error: ErrorDetail


class AnthropicErrorDetail(_Out):
    type: str
    message: str


class AnthropicErrorResponse(_Out):
    """Anthropic's error body (the /v1/messages routes)."""

    type: Literal["error"]
    error: AnthropicErrorDetail


ERROR_STATUSES = {400: "a bad field (named in `param`)", 401: "a missing or wrong API key",
                  404: "a model this server does not serve", 408: "the request ran past --request-timeout",
                  413: "the body is over the size limit",
                  415: "the body is not application/json", 429: "the queue is full (Retry-After)",
                  431: "the request's headers are over --max-header-bytes",
                  500: "the request failed inside the engine", 503: "the engine is not running"}


def errors(model: type[BaseModel] = ErrorResponse, statuses: tuple[int, ...] = tuple(ERROR_STATUSES)
           ) -> dict[int | str, dict[str, Any]]:
    return {s: {"model": model, "description": ERROR_STATUSES[s]} for s in statuses}


# ---------------------------------------------------------------- responses
class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(_Out):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None  # with prompt_logprobs
    token_ids: list[int] | None = None  # with return_token_ids
    prompt_token_ids: list[int] | None = None  # with return_token_ids


class CompletionResponse(_Out):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class AssistantMessage(_Out):
    role: Literal["assistant"]
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(_Out):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids


class ChatCompletionResponse(_Out):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None  # with prompt_logprobs
    prompt_token_ids: list[int] | None = None  # with return_token_ids


class ModelPermission(_Out):
    id: str
    object: Literal["model_permission"]
    created: int
    allow_create_engine: bool
    allow_sampling: bool
    allow_logprobs: bool
    allow_search_indices: bool
    allow_view: bool
    allow_fine_tuning: bool
    organization: str
    group: str | None
    is_blocking: bool


class ModelCard(_Out):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str  # the base model's path, or an adapter's
    parent: str | None  # an adapter's base model
    max_model_len: int
    permission: list[ModelPermission]


class ModelList(_Out):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(_Out):
    tokens: list[int]
    count: int
    max_model_len: int
    token_strs: list[str] | None  # with return_token_strs


class DetokenizeResponse(_Out):
    prompt: str


class Version(_Out):
    version: str


class ResponseObject(_Out):
    """The Responses API's response object."""

    id: str
    object: Literal["response"]
    created_at: int
    status: str
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None = None


class MessageObject(_Out):
    """Anthropic's message object."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    content: list[dict[str, Any]]
    model: str
    stop_reason: str | None = None
    usage: dict[str, Any]


class CountTokensResponse(_Out):
    input_tokens: int


# with "stream": true: server-sent events, each with a `data` line (a JSON chunk, or [DONE]) and, on the
# Responses and Messages routes, an `event` name
SSE = {"text/event-stream": {"schema": {"type": "object", "required": ["data"], "properties": {
    "data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"}}}}}


def generating(ok: type[BaseModel], body: type[BaseModel], error_model: type[BaseModel] = ErrorResponse,
               stream: bool = True) -> dict[str, Any]:
    """add_api_route's keywords for a POST route that reads `body` and answers `ok` (or a stream)."""
    ok_doc: dict[str, Any] = {"model": ok, "description": "the result" + (", or its SSE stream" if stream else "")}
    if stream:
        ok_doc["content"] = SSE
    return {"responses": {200: ok_doc, **errors(error_model)}, "openapi_extra": request_body(body)}


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def document(app: FastAPI, bodies: list[type[BaseModel]], bounds: dict[str, dict[str, dict[str, int]]],
             served_models: Callable[[], tuple[str, ...]]) -> None:
    """Make app.openapi() put the request models in the document's components (their nested models
    too), with the server's limits (`bounds`: model -> property -> JSON schema keywords, from
    ServerLimits.bounds) on their properties and `model` one of `served_models()` (the served names and LoRA
    adapters, read when the document is built; another is a 404); FastAPI
    builds the rest from the routes' `responses`."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes,
                              description="lmserve's OpenAI-compatible (and Anthropic Messages) API")
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for model in bodies:
                schema = model.model_json_schema(ref_template="#/components/schemas/{model}", by_alias=True)
                schemas.update(schema.pop("$defs", {}))
                prop = schema.get("properties", {}).get("model")
                if prop is not None:  # the one served, optional where the body has it optional
                    served = {"type": "string", "enum": list(served_models())}
                    nullable = any(alt.get("type") == "null" for alt in prop.get("anyOf", []))
                    schema["properties"]["model"] = {"anyOf": [served, {"type": "null"}]} if nullable else served
                schemas[model.__name__] = schema
            for schema in schemas.values():
                _json_schema_bounds(schema)
            for name, props in bounds.items():
                for prop, keywords in props.items():
                    _bound(schemas[name]["properties"][prop], keywords)
            app.openapi_schema = doc
        return app.openapi_schema
    app.openapi = openapi  # type: ignore[method-assign]


def _bound(prop: dict[str, Any], keywords: dict[str, int]) -> None:
    """Put the keywords on a property's schema: on its non-null alternative when it is nullable
    (pydantic writes `X | None` as anyOf [X, null]); `maximum` on numbers, `maxItems` on arrays,
    `maxProperties` on objects only."""
    kinds = {"maximum": ("integer", "number"), "maxItems": ("array",), "maxProperties": ("object",)}
    for alt in prop.get("anyOf", [prop]):
        for key, value in keywords.items():
            if alt.get("type") in kinds[key]:
                alt[key] = value


def _json_schema_bounds(node: Any) -> None:
    """pydantic writes a bound on a nullable field (`Field(1, ge=1)` on `int | None`) into the non-null
    alternative under its own name (`ge`), which JSON Schema does not know: renamed to JSON Schema's."""
    if isinstance(node, dict):
        for ours, theirs in (("ge", "minimum"), ("le", "maximum"), ("gt", "exclusiveMinimum"), ("lt", "exclusiveMaximum")):
            if ours in node and "type" in node:
                node[theirs] = node.pop(ours)
        for value in node.values():
            _json_schema_bounds(value)
    elif isinstance(node, list):
        for value in node:
            _json_schema_bounds(value)
