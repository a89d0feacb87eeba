"""OpenAI request bodies (pydantic). Unknown fields are ignored, as OpenAI does; the extension fields
that vLLM accepts and benchmark clients send are accepted and honoured. Numbers must be finite (JSON
bodies parsed by Python may hold NaN / Infinity)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationInfo, field_validator

MAX_N = 16
MAX_LOGPROBS = 20
MAX_STOP = 16


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class _Sampling(_Body):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: StrictInt = Field(1, ge=1, le=MAX_N)
    best_of: StrictInt | None = Field(None, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: StrictInt | None = Field(None, ge=0)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    # extensions (vLLM names)
    top_k: StrictInt | None = None
    min_p: float | None = None
    min_tokens: StrictInt = Field(0, ge=0)
    repetition_penalty: float | None = None
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True
    stop_token_ids: list[StrictInt] | None = None
    include_stop_str_in_output: StrictBool = False
    use_beam_search: StrictBool = False
    length_penalty: float = 1.0
    early_stopping: StrictBool = False
    continuous_usage_stats: StrictBool = False

    @field_validator("stop")
    @classmethod
    def _stop_limits(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences are allowed, got {len(v)}")
        return v


class CompletionRequest(_Sampling):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    max_tokens: StrictInt | None = Field(16, ge=0)
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: StrictBool = False
    suffix: str | None = None


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = Field(None, validate_default=True)
    name: str | None = None

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
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for p in self.content:
            if p.type != "text":
                raise ValueError(f"content part type {p.type!r} is not supported (text only)")
            parts.append(p.text or "")
        return "".join(parts)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: StrictBool = True
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[StrictInt]
