"""Bounds on every input a request can make large, each a `lmserve serve` flag with the default below.

The body itself (--max-body-bytes, 413) and its headers (--max-header-bytes, uvicorn's h11 limit) are
bounded before any parsing; what parsing admits is bounded here, field by field, each violation a
ValueError naming the field (a 400). Prompt length is bounded by the model's context (the engine's
check), a chat template's rendering by Tokenizer.template_max_chars / template_max_seconds."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # (errors.py needs fastapi; the CLI reads the limits' flags without it)
    from lmserve.server.errors import ApiError

KIB = 1024


def _field(body: Any, name: str) -> Any:
    """A body's field value (its data, never a method of the same name), or None."""
    return vars(body).get(name)


@dataclass(frozen=True)
class ServerLimits:
    max_body_bytes: int = 4 * KIB * KIB  # a request body (413 past it)
    max_json_depth: int = 64  # arrays and objects nested in a body
    max_header_bytes: int = 16 * KIB  # a request's header block (uvicorn answers 431 / closes past it)
    max_n: int = 16  # n and best_of: sequences one request runs
    max_prompts: int = 256  # prompts in one /v1/completions request
    max_messages: int = 2048  # messages in one conversation
    max_stop: int = 16  # stop strings
    max_stop_token_ids: int = 64
    max_logit_bias: int = 1024  # logit_bias entries
    max_tools: int = 128  # tools offered in one request
    max_schema_bytes: int = 64 * KIB  # an output constraint (schema, regex, grammar, choices) or the tools, as JSON
    template_max_chars: int = 4 * KIB * KIB  # a rendered chat template
    template_max_seconds: float = 2.0  # rendering a chat template
    trust_request_chat_template: bool = False  # a request may bring its own chat_template
    enable_prompt_tokens_details: bool = False  # usage.prompt_tokens_details.cached_tokens (vLLM's flag)

    def __post_init__(self) -> None:
        for name, value in self.__dict__.items():
            if not isinstance(value, bool) and not value > 0:
                raise ValueError(f"{name}: must be > 0, got {value}")

    # what a body asks, checked after it parsed (body: a protocol SamplingRequest or TokenizeRequest)
    def check(self, body: Any) -> None:
        """ValueError naming the first field past its limit."""
        for name in ("n", "best_of"):
            v = _field(body, name)
            if v is not None and v > self.max_n:
                raise ValueError(f"{name}: at most {self.max_n} (--max-n), got {v}")
        stop = _field(body, "stop")
        if isinstance(stop, list) and len(stop) > self.max_stop:
            raise ValueError(f"stop: at most {self.max_stop} stop sequences (--max-stop), got {len(stop)}")
        bad_words = _field(body, "bad_words")
        if isinstance(bad_words, list) and len(bad_words) > self.max_stop:
            raise ValueError(f"bad_words: at most {self.max_stop} words (--max-stop), got {len(bad_words)}")
        for name, limit, flag in (("stop_token_ids", self.max_stop_token_ids, "--max-stop-token-ids"),
                                  ("logit_bias", self.max_logit_bias, "--max-logit-bias"),
                                  ("tools", self.max_tools, "--max-tools")):
            v = _field(body, name)
            if v is not None and len(v) > limit:
                raise ValueError(f"{name}: at most {limit} entries ({flag}), got {len(v)}")
        messages = _field(body, "messages")
        if messages is not None:
            self.check_messages(len(messages))
        tools = _field(body, "tools")
        if tools and len(json.dumps(tools, ensure_ascii=False, default=str).encode()) > self.max_schema_bytes:
            raise ValueError(f"tools: more than {self.max_schema_bytes} bytes as JSON (--max-schema-bytes)")
        if _field(body, "chat_template") is not None and not self.trust_request_chat_template:
            raise ValueError("chat_template: a request's own chat template is refused by this server "
                             "(start it with --trust-request-chat-template to allow it)")

    def decode_json(self, raw: bytes) -> dict[str, Any]:
        """A request body's JSON: an object, nested within max_json_depth; else an ApiError 400."""
        from lmserve.server.errors import ApiError
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise ApiError(400, "request body is not valid JSON") from None
        except RecursionError:  # the decoder's own bound (~1,000 levels)
            raise ApiError(400, f"request body is nested deeper than {self.max_json_depth} levels") from None
        if not isinstance(data, dict):
            raise ApiError(400, "request body must be a JSON object")
        try:
            self.check_depth(data)
        except ValueError as e:
            raise ApiError.invalid(e) from None
        return data

    def check_headers(self, headers: list[tuple[bytes, bytes]]) -> ApiError | None:
        """A 431 when a request's header block (as "name: value\\r\\n" lines) is over max_header_bytes."""
        from lmserve.server.errors import ApiError
        size = sum(len(k) + len(v) + 4 for k, v in headers)
        if size > self.max_header_bytes:
            return ApiError(431, f"request headers of {size} bytes exceed the limit of {self.max_header_bytes} "
                                 f"(--max-header-bytes)")
        return None

    def check_depth(self, data: Any) -> None:
        """A parsed body nested at most max_json_depth deep (deeper would reach recursive code later:
        validation, json.dumps of a schema, a template); ValueError naming the body."""
        level = [data]
        for _ in range(self.max_json_depth):
            level = [v for c in level for v in (c.values() if isinstance(c, dict) else c)
                     if isinstance(v, (dict, list))]
            if not level:
                return
        raise ValueError(f"body: nested deeper than {self.max_json_depth} levels (--max-json-depth)")

    def check_messages(self, n: int) -> None:
        if n > self.max_messages:
            raise ValueError(f"messages: at most {self.max_messages} messages (--max-messages), got {n}")

    def check_prompts(self, n: int) -> None:
        if n > self.max_prompts:
            raise ValueError(f"prompt: at most {self.max_prompts} prompts in one request (--max-prompts), got {n}")

    def check_constraint(self, key: tuple[str, str] | None) -> None:
        """An output constraint's (kind, text) (StructuredOutputsParams.key) within max_schema_bytes."""
        if key is not None and len(key[1].encode("utf-8", "surrogatepass")) > self.max_schema_bytes:
            raise ValueError(f"structured_outputs.{key[0]}: more than {self.max_schema_bytes} bytes "
                             f"(--max-schema-bytes)")

    # the OpenAPI document states the bounds in force
    def bounds(self, max_logprobs: int) -> dict[str, dict[str, dict[str, int]]]:
        """model name -> property -> the JSON schema keywords that state this server's limits (and the
        engine's max_logprobs)."""
        most = {"maximum": max_logprobs}
        sampling = {"n": {"maximum": self.max_n}, "best_of": {"maximum": self.max_n}, "prompt_logprobs": most,
                    "stop_token_ids": {"maxItems": self.max_stop_token_ids}, "bad_words": {"maxItems": self.max_stop},
                    "logit_bias": {"maxProperties": self.max_logit_bias}}
        chat = {**sampling, "messages": {"maxItems": self.max_messages}, "tools": {"maxItems": self.max_tools},
                "top_logprobs": most}
        return {"CompletionRequest": {**sampling, "logprobs": most}, "ChatCompletionRequest": chat,
                "TokenizeRequest": {"messages": {"maxItems": self.max_messages}}}

    @classmethod
    def flags(cls) -> list[tuple[str, str, type, Any, str]]:
        """(flag, field name, type, default, help) for the CLI, one per limit."""
        helps = {"max_body_bytes": "request bodies above this get 413",
                 "max_header_bytes": "a request's header block above this is refused",
                 "max_json_depth": "arrays and objects nested in a request body",
                 "max_n": "n and best_of: sequences one request may run",
                 "max_prompts": "prompts in one /v1/completions request",
                 "max_messages": "messages in one conversation", "max_stop": "stop strings (and bad_words) in a request",
                 "max_stop_token_ids": "stop_token_ids in a request", "max_logit_bias": "logit_bias entries",
                 "max_tools": "tools in a request",
                 "max_schema_bytes": "an output constraint (JSON schema, regex, grammar, choices) or the tools, as JSON",
                 "template_max_chars": "characters a rendered chat template may have",
                 "template_max_seconds": "seconds a chat template may take to render"}
        out = []
        for name, default in cls().__dict__.items():
            if isinstance(default, bool):  # switches with flags of their own
                continue
            flag = "--chat-" + name.replace("_", "-") if name.startswith("template") else "--" + name.replace("_", "-")
            out.append((flag, name, type(default), default, f"{helps[name]} (default {default})"))
        return out
