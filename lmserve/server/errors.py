"""ApiError: an HTTP status with OpenAI's error body, and the conversion of our ValueErrors into 400s."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fastapi.responses import JSONResponse

from lmserve.structured import CompilerBusy


PARAM_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_$]+|\[[0-9]+\])*")  # a field: 'tools[0].function.name'


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
    def invalid(cls, e: ValueError) -> "ApiError":
        """A 400 for one of our ValueErrors, which start with the field they are about: 'max_tokens: ...'."""
        msg = str(e)
        head = msg.split(":", 1)[0]
        param = head if PARAM_RE.fullmatch(head) else None  # a.b, a[0].b: nested
        return cls(400, msg, param=param)

    @classmethod
    def engine_failure(cls, error: str | None, status: int = 500) -> "ApiError":
        """A request that finished with finish_reason 'error' inside the engine (status 503: it waited
        past max_waiting_time for its first step; retry later)."""
        if status == 503:
            return cls(503, f"request not served: {error}", type_="server_error", code="queue_timeout",
                       headers={"Retry-After": "1"})
        if status == 400:  # the request asked for what the model cannot do (a constraint its vocabulary cannot write)
            return cls(400, f"request cannot be served: {error}")
        return cls(status, f"request failed inside the engine: {error}", type_="server_error")

    def body(self) -> dict[str, Any]:
        """OpenAI's error body."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        """The error as a JSON response."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


Renames = tuple[tuple[str, str], ...]  # (a field's name in the chat body, its name in another API's body)


UNION_TAG = re.compile(r".*[\[\-].*|str|int|float|bool|bytes|dict|list|none|any|constrained-\w+")


def field_path(loc: tuple[Any, ...]) -> str | None:
    """A pydantic error's location as the body's field ('messages.content'), without list indices or the
    union member pydantic tried ('input.str', 'prompt.list[int]' name `input`, `prompt`)."""
    return ".".join(str(p) for p in loc if not isinstance(p, int) and not UNION_TAG.fullmatch(str(p))) or None


def renamed(message: str, renames: Renames) -> str:
    """A 'field: ...' message with the field named as renames say (whole names or path segments:
    ("max_tokens", "max_output_tokens"), (".function", "")); the text after the field is kept."""
    head, sep, rest = message.partition(":")
    if not sep or " " in head:  # no field named
        return message
    for old, new in renames:  # whole words: "stop" is not the start of "stop_token_ids"
        before, after = (r"(?<!\w)" if old[0].isidentifier() else ""), (r"(?!\w)" if old[-1].isidentifier() else "")
        head = re.sub(before + re.escape(old) + after, new, head)
    return head + sep + rest


@contextmanager
def invalid_request(renames: Renames = ()) -> Iterator[None]:
    """Turn a ValueError raised inside the block (a bad field) into a 400 naming that field. With
    renames (an API built on the chat body), the fields of those 400s and of 400s raised inside are
    named as that API names them."""
    try:
        yield
    except CompilerBusy as e:  # refused for now, not for what it asks: retry, do not fix
        raise ApiError(429, renamed(str(e), renames), type_="rate_limit_error", headers={"Retry-After": "1"}) from None
    except ValueError as e:
        raise ApiError.invalid(ValueError(renamed(str(e), renames))) from None
    except ApiError as e:
        if e.status not in (400, 429) or not renames:
            raise
        if e.status == 429:  # a busy compiler's: the field as this API names it, still a 429
            raise ApiError(429, renamed(e.message, renames), type_=e.type, headers=e.headers) from None
        raise ApiError.invalid(ValueError(renamed(e.message, renames))) from None
