"""StructuredOutputsParams: what a request's output is held to (vLLM's `structured_outputs`); structured.py
compiles it. (Kept apart from sequence.py, which re-exports it.)"""

from __future__ import annotations

import json as json_lib
from dataclasses import dataclass
from typing import Any

MAX_GRAMMAR_BYTES = 64 * 1024  # a schema, regex, grammar or the choices, serialized


@dataclass
class StructuredOutputsParams:
    """Constrain the output (vLLM's `structured_outputs`): to a JSON schema (`json`, a dict or its JSON
    text), to any JSON object (`json_object`), to a regex, to one of `choice`'s strings, or to an EBNF
    grammar (xgrammar's / llama.cpp's GBNF dialect). Exactly one."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def key(self) -> tuple[str, str]:
        """(kind, text): what the grammar compiler reads and its cache is keyed by; ValueError naming
        the field if the constraint is malformed."""
        set_ = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        set_ += ["json_object"] if self.json_object else []
        if len(set_) != 1:
            raise ValueError(f"structured_outputs: give exactly one of json, json_object, regex, choice, grammar "
                             f"(got {', '.join(set_) or 'none'})")
        kind = set_[0]
        if kind == "json":
            if isinstance(self.json, str):
                try:
                    schema = json_lib.loads(self.json)
                except ValueError as e:
                    raise ValueError(f"structured_outputs.json: not valid JSON ({e})") from None
            else:
                schema = self.json
            if not isinstance(schema, (dict, bool)):
                raise ValueError("structured_outputs.json: a JSON schema must be an object")
            try:
                text = json_lib.dumps(schema, ensure_ascii=False)  # property order kept: it is the output order
            except (TypeError, ValueError) as e:  # a set, bytes, a non-string key, a cycle
                raise ValueError(f"structured_outputs.json: not a JSON document ({e})") from None
        elif kind == "json_object":
            text = ""
        elif kind == "choice":
            if not isinstance(self.choice, list) or not self.choice or \
                    any(not isinstance(c, str) or not c for c in self.choice):
                raise ValueError("structured_outputs.choice: must be a non-empty list of non-empty strings")
            text = json_lib.dumps(self.choice, ensure_ascii=False)
        else:
            text = getattr(self, kind)
            if not isinstance(text, str) or not text:
                raise ValueError(f"structured_outputs.{kind}: must be a non-empty string")
        if len(text.encode("utf-8", "surrogatepass")) > MAX_GRAMMAR_BYTES:
            raise ValueError(f"structured_outputs.{kind}: longer than {MAX_GRAMMAR_BYTES} bytes")
        return kind, text
