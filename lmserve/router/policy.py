"""Which replica takes a request (pure logic: no I/O; app.py feeds it health and load).

`prefix` routes by the longest prompt prefix a replica has already been sent, as SGLang's cache-aware
router does: the router cannot see token ids (it forwards the request's bytes untouched), so it keeps an
approximate map over the request's routing text (the prompt, or the messages / input serialized in
order) cut into CHUNK-character blocks, each block keyed by a hash chained over the blocks before it,
exactly as an engine keys KV blocks by token blocks. A block's hash maps to the replica that last got
it (bounded, least recently used first out). The replica with the longest match wins unless it is
busier than the least-loaded healthy replica by more than `balance` requests; then load wins.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

CHUNK = 64  # characters per prefix block
MAX_BLOCKS = 1 << 18  # prefix map entries kept (LRU)
POLICIES = ("prefix", "least-load", "round-robin")


@dataclass
class Replica:
    """One upstream server: its URL, health, and load (requests in flight through this router, and what its
    /metrics reported: running + waiting)."""

    url: str
    healthy: bool = False  # until a health check says otherwise
    in_flight: int = 0
    reported: int = 0
    requests: int = 0  # routed here (for /metrics)
    failures: int = 0

    @property
    def load(self) -> int:
        return max(self.in_flight, self.reported)

    def mark_down(self) -> None:
        """A request failed on it: out of rotation until a health check that starts afterwards says it is up
        (one already in flight sees the failure count move and keeps it down: health.check)."""
        self.failures += 1
        self.healthy = False


def routing_text(path: str, body: Any) -> str:
    """The text whose prefix decides a prefix route: the completion prompt, or the conversation so far
    (system, messages or input, tools) serialized in order, so a shared system prompt is a shared prefix."""
    if not isinstance(body, dict):
        return ""
    if "messages" not in body and (path.endswith("/completions") or path == "/invocations" and "prompt" in body):
        prompt = body.get("prompt", "")
        try:
            return prompt if isinstance(prompt, str) else json.dumps(prompt)
        except (RecursionError, ValueError):
            return ""
    parts = [body.get(k) for k in ("system", "instructions", "tools", "messages", "input") if body.get(k) is not None]
    try:
        return "".join(p if isinstance(p, str) else json.dumps(p, sort_keys=True) for p in parts)
    except (RecursionError, ValueError):  # nested past json's depth: the replica refuses it (a 400), any route
        return ""


def chain(text: str) -> list[bytes]:
    """Hashes of the text's whole CHUNK-character blocks, each over its parent's hash and its characters."""
    out: list[bytes] = []
    for i in range(len(text) // CHUNK):
        out.append(hashlib.sha256((out[-1] if out else b"") + text[i * CHUNK:(i + 1) * CHUNK].encode(
            "utf-8", "surrogatepass")).digest())  # (a lone surrogate: the replica's 400, not a router 500)
    return out


@dataclass
class Router:
    """The routing state: replicas, the policy, the prefix map, and the counters /metrics reports."""

    replicas: list[Replica]
    policy: str = "prefix"
    balance: int = 4  # prefix: a match may cost at most this many more requests than the least-loaded replica
    prefix_map: OrderedDict[bytes, str] = field(default_factory=OrderedDict)  # block hash -> replica url
    matched_chars: int = 0  # prefix routing, as routed: characters matched / looked up
    looked_up_chars: int = 0
    _rr: Any = None

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if not self.replicas:
            raise ValueError("replica: give at least one replica URL")
        self._rr = itertools.count()

    def healthy(self, exclude: set[str] = frozenset()) -> list[Replica]:  # type: ignore[assignment]
        return [r for r in self.replicas if r.healthy and r.url not in exclude]

    def pick(self, text: str, exclude: set[str] = frozenset()) -> Replica | None:  # type: ignore[assignment]
        """The replica for a request with this routing text (None: no healthy one left), its prefix
        blocks recorded under it."""
        live = self.healthy(exclude)
        if not live:
            return None
        if self.policy == "round-robin":
            return live[next(self._rr) % len(live)]
        least = min(live, key=lambda r: (r.load, r.requests))
        if self.policy == "least-load":
            return least
        hashes = chain(text)
        urls = {r.url: r for r in live}
        best, depth = None, 0
        for i, h in enumerate(hashes):  # the deepest block some live replica holds; the chain is a path
            url = self.prefix_map.get(h)
            if url not in urls:
                break
            best, depth = urls[url], i + 1
        choice = best if best is not None and best.load <= least.load + self.balance else least
        self.looked_up_chars += len(hashes) * CHUNK
        self.matched_chars += depth * CHUNK if choice is best else 0
        for h in hashes:
            self.prefix_map[h] = choice.url
            self.prefix_map.move_to_end(h)
        while len(self.prefix_map) > MAX_BLOCKS:
            self.prefix_map.popitem(last=False)
        return choice

    @property
    def prefix_hit_rate(self) -> float:
        return self.matched_chars / self.looked_up_chars if self.looked_up_chars else 0.0
