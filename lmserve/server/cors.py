"""CORS: which other origins' browser pages may use the API (Starlette's CORSMiddleware). Off unless
--allowed-origins names some: with no CORS headers a browser keeps other origins' pages from reading
any answer. With --data-parallel (or `lmserve router`) the front answers for CORS, not the replicas.

No web framework at import: the CLI reads these flags without the server extras."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

FLAGS = ("allowed_origins", "allowed_methods", "allowed_headers", "allow_credentials")


@dataclass(frozen=True)
class Cors:
    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False

    def install(self, app: Any) -> None:
        """The middleware, outermost when added last (a preflight never meets the API key's 401). It
        sets its headers over any a relayed reply brought (a router's replicas)."""
        if not self.allowed_origins:
            return
        from starlette.middleware.cors import CORSMiddleware
        app.add_middleware(CORSMiddleware, allow_origins=list(self.allowed_origins),
                           allow_methods=list(self.allowed_methods), allow_headers=list(self.allowed_headers),
                           allow_credentials=self.allow_credentials)


def add_cors_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--allowed-origins", action="append", default=None,
                   help="an origin whose browser pages may call the API (CORS), e.g. https://app.example, or '*'; "
                        "repeat, or give a JSON list as vLLM takes (default: none, no CORS headers)")
    p.add_argument("--allowed-methods", action="append", default=None, help="CORS: methods allowed (default '*')")
    p.add_argument("--allowed-headers", action="append", default=None,
                   help="CORS: request headers allowed (default '*')")
    p.add_argument("--allow-credentials", action="store_true", help="CORS: allow cookies and credentials")


def flag_list(name: str, values: list[str] | None, default: tuple[str, ...]) -> tuple[str, ...]:
    """A repeated flag's values, each a plain value or a JSON list of them (vLLM's form); ValueError
    naming the flag otherwise."""
    if not values:
        return default
    out: list[str] = []
    for v in values:
        if not v.lstrip().startswith("["):
            out.append(v)
            continue
        try:
            items = json.loads(v)
        except json.JSONDecodeError:
            items = None
        if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
            raise ValueError(f"{name}: {v!r} is not a JSON list of strings")
        out += items
    return tuple(out)


def cors_from_args(a: argparse.Namespace) -> Cors:
    return Cors(flag_list("allowed_origins", a.allowed_origins, ()),
                flag_list("allowed_methods", a.allowed_methods, ("*",)),
                flag_list("allowed_headers", a.allowed_headers, ("*",)), a.allow_credentials)
