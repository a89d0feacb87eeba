"""The JSON field types of the request bodies, and their base model (protocol.py and the other APIs' bodies).

JSON numbers are taken as JSON Schema reads them (an integer field takes 2.0, no field takes a bool or a
string); a body ignores unknown fields, as OpenAI's API does; and a field OpenAI's API documents as
nullable (`"n": null`, `"stream": null`, ...) may be null where its default is not: null is then its default,
as vLLM reads it (`null_is_default`)."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, StrictInt, model_validator


def _integral(v: Any) -> Any:
    """A float with no fraction is the integer JSON Schema says it is (2.0 is an integer there)."""
    return int(v) if isinstance(v, float) and v.is_integer() and abs(v) < 2**63 else v


Int = Annotated[StrictInt, BeforeValidator(_integral)]  # an integer field: no bools, no strings, 2.0 = 2


def _number(v: Any) -> Any:
    """A JSON number as a float field takes it: no bools, no strings (pydantic's lax float takes both)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError("Input should be a number")
    try:
        return float(v)
    except OverflowError:  # an integer of hundreds of digits
        raise ValueError("Input should be a finite number") from None


Float = Annotated[float, BeforeValidator(_number)]  # a number field: an integer or a float, nothing else


class JsonBody(BaseModel):
    """A JSON body (or part of one)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    null_is_default: ClassVar[tuple[str, ...]] = ()  # fields (typed `X | None`) whose null means their default

    @model_validator(mode="after")
    def _defaults_for_nulls(self) -> "JsonBody":
        for name in self.null_is_default:
            if getattr(self, name) is None:
                setattr(self, name, type(self).model_fields[name].default)
        return self
