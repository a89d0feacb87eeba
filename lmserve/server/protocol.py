"""OpenAI request bodies (pydantic). Unknown fields are ignored, as OpenAI does; the extension fields
that vLLM accepts and benchmark clients send are accepted and honoured. Numbers must be finite (JSON
bodies parsed by Python may hold NaN / Infinity).

Each body also knows what needs no model: `check()` (rules across fields) and, for the generating
endpoints, `to_sampling_params()`; both raise ValueError naming the field, which the app turns into a 400."""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import Field, StrictBool, ValidationInfo, field_validator

from lmserve.chat_template import join_text
from lmserve.sequence import SamplingParams, StructuredOutputsParams
from lmserve.server.fields import Float, Int, JsonBody as _Body
from lmserve.server.tool_schema import check_tools, tools_json_schema

def _given(value: Any, defaults: dict[str, Any], name: str, fallback: Any) -> Any:
    """A body's sampling field, else the model's default for it, else the library's."""
    return value if value is not None else defaults.get(name, fallback)
# the bounds on how large a request may be (n, stop strings, messages, ...) are the server's limits,
# each a flag: server/limits.py


class BaseRequest(_Body):
    """A request body: it names the model, and may have rules across its fields."""

    model: str | None = None
    cache_salt: str | None = Field(None, min_length=1)  # vLLM's: only requests with the same salt share cached KV

    def check(self) -> None:
        """Rules across fields, checked once the body parsed; ValueError naming the field."""


class StreamOptions(_Body):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class JsonSchemaFormat(_Body):
    """OpenAI's response_format.json_schema: a named schema (`strict` is accepted; the schema is always
    enforced)."""

    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Body):
    """OpenAI's response_format: text (no constraint), json_object (any JSON object), json_schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(_Body):
    """vLLM's `structured_outputs` extension: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: StrictBool | None = None


class SamplingRequest(BaseRequest):
    """Fields shared by completions and chat completions."""

    null_is_default: ClassVar[tuple[str, ...]] = ("n", "presence_penalty", "frequency_penalty", "stream")
    temperature: Float | None = None
    top_p: Float | None = None
    n: Int | None = Field(1, ge=1)
    best_of: Int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: Int | None = Field(None, ge=-(2 ** 63))  # vLLM's: any signed 64-bit seed
    presence_penalty: Float | None = 0.0
    frequency_penalty: Float | None = 0.0
    logit_bias: dict[str, Float] | None = None
    user: str | None = None
    priority: Int = 0  # vLLM's: lower is admitted first (and preempted last)
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    # extensions (vLLM names)
    top_k: Int | None = None
    min_p: Float | None = None
    min_tokens: Int = Field(0, ge=0)
    repetition_penalty: Float | None = None
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True
    stop_token_ids: list[Int] | None = None
    include_stop_str_in_output: StrictBool = False
    use_beam_search: StrictBool = False
    length_penalty: Float = 1.0
    early_stopping: StrictBool = False
    continuous_usage_stats: StrictBool = False
    prompt_logprobs: Int | None = Field(None, ge=0)  # each prompt token's, as vLLM returns them
    return_token_ids: StrictBool = False  # vLLM's: the prompt's and each choice's token ids in the response
    allowed_token_ids: list[Int] | None = None  # vLLM's: only these tokens may be generated
    bad_words: list[str] | None = None  # vLLM's: words never generated
    truncate_prompt_tokens: Int | None = Field(None, ge=-1)  # vLLM's: the prompt's last k tokens (-1: the context)
    # constrained decoding: OpenAI's response_format; vLLM's structured_outputs and its older guided_* names
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def check(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        if self.use_beam_search and self.stream:
            raise ValueError("use_beam_search: beam search results cannot be streamed")
        if self.stream and self.best_of and self.best_of > self.n:
            raise ValueError("best_of: cannot stream when best_of > n")
        if self.stream and self.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs: not available when stream is true")

    def usage_flags(self) -> tuple[bool, bool]:
        """(a final usage chunk, usage in every chunk) as stream_options / the vLLM extension ask: usage in
        every chunk only with the final one too (vLLM's rule)."""
        opts = self.stream_options
        final = bool(opts and opts.include_usage)
        return final, final and (bool(opts and opts.continuous_usage_stats) or self.continuous_usage_stats)

    def to_sampling_params(self, room: int, defaults: dict[str, Any] | None = None) -> SamplingParams:
        """The engine's SamplingParams; room: the default max_tokens (what the context, and the KV pool,
        leave after the prompt: InputProcessor.room); defaults: the model's sampling defaults for the fields left unset
        (generation_config.py; their max_tokens caps the body's, as vLLM's does)."""
        raise NotImplementedError

    def structured(self) -> StructuredOutputsParams | None:
        """The one output constraint the body asks for (response_format, structured_outputs or a
        guided_* field), or None; ValueError naming the field when it is incomplete or several are given."""
        found = self._constraints()
        if len(found) > 1:
            raise ValueError(f"{found[1][0]}: only one output constraint is allowed (also given: {found[0][0]})")
        return found[0][1] if found else None

    def field_renames(self) -> tuple[tuple[str, str], ...]:
        """Errors about the output constraint (the library names it structured_outputs.<kind>) named by
        the field the client sent it in (chat: and its logprobs count, top_logprobs)."""
        try:
            found = self._constraints()
        except ValueError:  # (said by structured(), inside the checks)
            found = []
        origin = found[0][0] if found else "structured_outputs"
        return () if origin == "structured_outputs" else \
            (*((f"structured_outputs.{k}", origin) for k in ("json", "json_object", "regex", "choice", "grammar")),
             ("structured_outputs", origin))

    def _constraints(self) -> list[tuple[str, StructuredOutputsParams]]:
        """(the field it came in, the constraint) for each output constraint the body gives."""
        found: list[tuple[str, StructuredOutputsParams]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", StructuredOutputsParams(json_object=True)))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise ValueError("response_format.json_schema: a json_schema with a schema is required for "
                                 "type json_schema")
            found.append(("response_format.json_schema.schema", StructuredOutputsParams(json=rf.json_schema.schema_)))
        so = self.structured_outputs
        if so is not None:
            found.append(("structured_outputs", StructuredOutputsParams(
                json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar, json_object=bool(so.json_object))))
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                found.append((name, StructuredOutputsParams(**{kind: getattr(self, name)})))
        return found

    def _sampling_params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None,
                         defaults: dict[str, Any] | None) -> SamplingParams:
        try:
            bias = {int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None
        except ValueError:
            raise ValueError("logit_bias: keys must be token ids") from None
        d = defaults or {}
        if self.use_beam_search:  # (its ranking uses no sampling option: vLLM's beam search takes none either)
            d = {k: v for k, v in d.items() if k == "max_tokens"}
        max_tokens = min(max_tokens, d.get("max_tokens", max_tokens))
        if self.min_tokens > max_tokens:  # max_tokens: the body's, or the room left in the context
            raise ValueError(f"min_tokens: {self.min_tokens} is more than max_tokens ({max_tokens}, the body's, the "
                             "model's max_new_tokens or the room left in the context)")
        return SamplingParams(
            n=self.n, best_of=self.best_of, temperature=_given(self.temperature, d, "temperature", 1.0),
            top_p=_given(self.top_p, d, "top_p", 1.0), top_k=_given(self.top_k, d, "top_k", -1),
            min_p=_given(self.min_p, d, "min_p", 0.0),
            repetition_penalty=_given(self.repetition_penalty, d, "repetition_penalty", 1.0),
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty, logit_bias=bias,
            seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids, max_tokens=max_tokens,
            min_tokens=self.min_tokens, ignore_eos=self.ignore_eos, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output, use_beam_search=self.use_beam_search,
            length_penalty=self.length_penalty, early_stopping=self.early_stopping,
            structured_outputs=self.structured(), allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
            truncate_prompt_tokens=self.truncate_prompt_tokens)


class CompletionRequest(SamplingRequest):
    prompt: str | list[Int] | list[str] | list[list[Int]]
    max_tokens: Int | None = Field(16, ge=0)
    logprobs: Int | None = Field(None, ge=0)
    echo: StrictBool | None = False
    null_is_default = (*SamplingRequest.null_is_default, "echo")
    suffix: str | None = None
    add_special_tokens: StrictBool = True  # vLLM's: false leaves out the tokenizer's BOS

    @property
    def echo_only(self) -> bool:
        """Scoring: return the prompt (and its logprobs), generate nothing."""
        return self.max_tokens == 0

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each text or token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and all(isinstance(x, int) for x in p)):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]

    def check(self) -> None:
        if not self.prompts():
            raise ValueError("prompt: must not be empty")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: must be >= 1 (0 is allowed only with echo)")
        if self.suffix:
            raise ValueError("suffix: is not supported")
        super().check()

    def to_sampling_params(self, room: int, defaults: dict[str, Any] | None = None) -> SamplingParams:
        max_tokens = room if self.max_tokens is None else self.max_tokens
        # echo-only scoring (max_tokens 0) runs one step and drops its token; the prompt's logprobs for
        # echo and for prompt_logprobs are computed once, with the larger number of alternatives
        asked = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        return self._sampling_params(max(1, max_tokens), self.logprobs, max(asked) if asked else None, defaults)


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = Field(None, validate_default=True)
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant message's calls, as a response gave them
    tool_call_id: str | None = None  # a tool message: the call it answers

    @field_validator("content")
    @classmethod
    def _content_required(cls, v: str | list[ContentPart] | None, info: ValidationInfo
                          ) -> str | list[ContentPart] | None:
        """Only an assistant message (one that made tool calls) may come without content."""
        role = info.data.get("role")
        if v is None and role is not None and role != "assistant":
            raise ValueError(f"is required for a {role} message")
        return v

    def text(self) -> str:
        """The content as one string (text parts only; ValueError for others)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for p in self.content:
            if p.type != "text":
                raise ValueError(f"content part type {p.type!r} is not supported (text only)")
            parts.append(p.text or "")
        return join_text(parts)

    def for_template(self) -> dict[str, Any]:
        """The message as a chat template reads it (a call's JSON arguments as an object, which is what
        templates render with `tojson`)."""
        msg: dict[str, Any] = {"role": self.role, "content": self.text(), **({"name": self.name} if self.name else {})}
        if self.tool_calls:
            calls = []
            for call in self.tool_calls:
                fn = dict(call.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except ValueError:
                        pass  # not JSON: the template gets the text
                calls.append({**call, "function": fn})
            msg["tool_calls"] = calls
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        return msg


class TemplateArgs(BaseRequest):
    """What a conversation is rendered with besides its messages (the chat and tokenize routes)."""

    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False  # vLLM's: the last (assistant) message left open to go on
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None

    def check(self) -> None:  # (continue_final_message with add_generation_prompt: the template's renderer says no)
        if self.tools is not None:
            self.tools = check_tools(self.tools)  # ValueError naming tools[i]...
        super().check()

    def template_kwargs(self) -> dict[str, Any]:
        """What the chat template gets besides the messages: chat_template_kwargs, the tools, and whether
        the last message stays open."""
        return {**(self.chat_template_kwargs or {}), **({"tools": self.tools} if self.tools else {}),
                **({"continue_final_message": True} if self.continue_final_message else {})}


class ChatCompletionRequest(SamplingRequest, TemplateArgs):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = Field(None, ge=1)
    max_completion_tokens: Int | None = Field(None, ge=1)
    logprobs: StrictBool | None = False
    top_logprobs: Int | None = Field(None, ge=0)
    null_is_default = (*SamplingRequest.null_is_default, "logprobs", "parallel_tool_calls")
    echo: StrictBool = False  # vLLM's: an assistant's last message comes back before what was generated
    chat_template: str | None = None  # the request's own template: refused unless the server trusts them
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = True

    def field_renames(self) -> tuple[tuple[str, str], ...]:  # (the engine's logprobs are top_logprobs here)
        return (*super().field_renames(), ("logprobs", "top_logprobs"))

    def check(self) -> None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: only allowed when logprobs is true")
        TemplateArgs.check(self)  # (the tools checked before tool_choice reads them)
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise ValueError("tool_choice: needs tools")
        if self.tool_mode == "forced":
            tools_json_schema(self.tools, self.tool_choice, self.parallel_tool_calls)  # type: ignore[arg-type]
            if self.use_beam_search:
                raise ValueError("tool_choice: not supported with beam search")
        super().check()

    @property
    def tool_mode(self) -> Literal["none", "auto", "forced"]:
        """How the output is read for calls: not at all (no tools, or tool_choice none), by the model's
        tool-call parser (auto, the default with tools), or as the JSON array of calls that constrained
        decoding forces (tool_choice required, or a named function)."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        return "auto" if self.tool_choice in (None, "auto") else "forced"

    def _constraints(self) -> list[tuple[str, StructuredOutputsParams]]:
        found = super()._constraints()
        if self.tool_mode != "forced":
            return found
        if found:
            raise ValueError("tool_choice: cannot be combined with another output constraint")
        return [("tools", StructuredOutputsParams(json=tools_json_schema(
            self.tools, self.tool_choice, self.parallel_tool_calls)))]  # type: ignore[arg-type]

    def to_sampling_params(self, room: int, defaults: dict[str, Any] | None = None) -> SamplingParams:
        max_tokens = self.max_completion_tokens or self.max_tokens or room
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max(1, max_tokens), logprobs, self.prompt_logprobs, defaults)


class TokenizeRequest(TemplateArgs):
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool | None = None  # None: vLLM's defaults (a prompt's yes, messages' no)
    return_token_strs: StrictBool | None = False  # vLLM's: each token's vocabulary string beside its id
    chat_template: str | None = None  # the request's own template: refused unless the server trusts them

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: give exactly one of prompt or messages")
        super().check()


class DetokenizeRequest(BaseRequest):
    tokens: list[Int]
