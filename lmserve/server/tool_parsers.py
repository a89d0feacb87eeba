"""Tool calls in chat completions: finding them in a model's output, whole or as it streams, and reading the
JSON array of calls that a forced tool_choice produces (the schema that forces it, and the checks of a
request's tools: server/tool_schema.py).

A format's parser splits an output into content and calls. `ToolParser.extract` reads a finished output;
`ToolParser.streaming()` reads one as it grows and says what can be sent, as OpenAI stream deltas. Both run
one scanner (extract feeds it the whole text at once), and a scanner never takes back what it decided, so a
stream's content and calls are the finished output's whatever the chunking. Text is held until it is decided:
the start of what may be a tag, and a call until it is complete, since a call whose body turns out malformed
is content. So a call's arguments are sent whole, in one delta after the call's first (id and name) delta.

Content: the text outside the calls, verbatim, except that a stretch of it holding only whitespace (before the
first call, between two, after the last, or the whole output) is dropped.

Formats (`TOOL_PARSERS`):
  hermes       Hermes, Qwen 2 / 2.5 / 3: `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`,
               any number, anywhere; the last may lack its closing tag at the output's end (as vLLM reads
               it). A body that is no such object is content, tags included.
  llama3_json  Llama 3.1 / 3.2 / 3.3 JSON tool calling: the output is `{"name": "f", "parameters": {...}}`,
               optionally after `<|python_tag|>`, several separated by `;`. An output that does not
               open with such a call is all content; text after the last call is content.
A call's arguments may be under "arguments" or "parameters" in either format (one of them, an object);
other keys are ignored. Arguments are sent as `json.dumps(arguments, ensure_ascii=False)`.
"""

from __future__ import annotations

import json
import random
import string
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"  # hermes
PYTHON_TAG = "<|python_tag|>"  # llama 3 (a special token: only in text decoded with skip_special_tokens=False)
ARGUMENT_KEYS = ("arguments", "parameters")


def call_id(rng: random.Random) -> str:
    """An OpenAI-style tool-call id: "call_" and 24 letters or digits."""
    return "call_" + "".join(rng.choices(string.ascii_letters + string.digits, k=24))


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # the arguments object as JSON text

    def openai(self) -> dict[str, Any]:
        """The call as a chat message's tool_calls lists it."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ExtractedToolCalls:
    content: str | None  # None when there is none (or only whitespace)
    calls: list[ToolCall]
    parts: list[str | ToolCall] = field(default_factory=list, compare=False)  # content stretches and calls, in order, as streamed


@dataclass(frozen=True)
class ContentDelta:
    text: str

    def openai(self) -> dict[str, Any]:
        return {"content": self.text}


@dataclass(frozen=True)
class ToolCallDelta:
    """A call's first delta has its id and name (and arguments ""); later ones add argument text."""

    index: int  # the call's place among the choice's calls
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def openai(self) -> dict[str, Any]:
        call: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            call.update(id=self.id, type="function", function={"name": self.name, "arguments": self.arguments})
        else:
            call["function"] = {"arguments": self.arguments}
        return {"tool_calls": [call]}


Delta = ContentDelta | ToolCallDelta  # (.openai(): the delta of a stream chunk)


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


# strict=False: raw control characters (a newline in a string) are taken, and escaped again on output
_DECODER = json.JSONDecoder(strict=False, parse_constant=_reject_constant)


def _as_call(obj: Any) -> tuple[str, str] | None:
    """(name, arguments JSON) when obj is {"name": str, "arguments" or "parameters": object}."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = [obj[k] for k in ARGUMENT_KEYS if k in obj]
    if len(args) != 1 or not isinstance(args[0], dict):
        return None
    try:  # strict JSON a client can read back, in UTF-8: else the call is content
        text = json.dumps(args[0], ensure_ascii=False, allow_nan=False)
        text.encode("utf-8")
    except ValueError:  # a number past a float's range (1e999 reads as inf), a lone surrogate ("\ud800")
        return None
    return obj["name"], text


def _tag_prefix_len(buf: str, tag: str, start: int) -> int:
    """The length of the longest end of buf[start:] that is a proper start of tag (it may become tag)."""
    for n in range(min(len(tag) - 1, len(buf) - start), 0, -1):
        if buf.endswith(tag[:n]):
            return n
    return 0


def _starts(buf: str, tag: str, i: int, end: int) -> list[int]:
    """Where tag starts in buf[i:end], in order."""
    out = []
    while (i := buf.find(tag, i, end)) >= 0:
        out.append(i)
        i += 1
    return out


def _skip_ws(buf: str, i: int) -> int:
    while i < len(buf) and buf[i].isspace():
        i += 1
    return i


Found = str | tuple[str, str]  # what a scanner decided: content text, or a call's (name, arguments JSON)


class _Scanner:
    """Splits a growing output into content and calls. `step(buf, final)` returns what the start of buf
    decides, in order, and how many characters that took; the rest is held and comes back, with more
    text, in the next step. With final (the output is complete) all of buf is taken. A step never
    decides what more text could change."""

    def step(self, buf: str, final: bool) -> tuple[list[Found], int]:
        raise NotImplementedError


class _HermesScanner(_Scanner):
    def __init__(self) -> None:
        self.seen = 0  # of a held call (buf opens with its tag), how much was searched for the close before

    def step(self, buf: str, final: bool) -> tuple[list[Found], int]:
        out: list[Found] = []
        i, seen, self.seen = 0, self.seen, 0
        while True:
            j = buf.find(OPEN, i)
            if j < 0:  # content, but for an end that may be the start of a tag
                end = len(buf) if final else len(buf) - _tag_prefix_len(buf, OPEN, i)
                out.append(buf[i:end])
                return out, end
            k = buf.find(CLOSE, max(j + len(OPEN), seen - len(CLOSE) + 1 if j == 0 else 0))
            if k < 0:  # a call not closed yet; or never: at the output's end a whole call after a tag is one (as
                found = [(o, c) for o in (_starts(buf, OPEN, j, len(buf)) if final else ())  # vLLM's parser reads
                         if (c := self._call(buf[o + len(OPEN):])) is not None]  # it), anything else content
                if found:
                    return [*out, buf[i:found[0][0]], found[0][1]], len(buf)
                end = len(buf) if final else j
                out.append(buf[i:end])
                self.seen = len(buf) - j
                return out, end
            call = None  # of several opening tags before the close, the first whose body is a call opens it
            for o in _starts(buf, OPEN, j, k):  # (a later one may sit in the arguments' text, or an earlier be
                call = self._call(buf[o + len(OPEN):k])  # a stray tag before the real one)
                if call is not None:
                    j = o
                    break
            if call is None:
                out.append(buf[i:k + len(CLOSE)])
            else:
                out += [buf[i:j], call]
            i = k + len(CLOSE)

    @staticmethod
    def _call(body: str) -> tuple[str, str] | None:
        try:
            obj, end = _DECODER.raw_decode(body, _skip_ws(body, 0))
        except (ValueError, RecursionError):  # RecursionError: nested too deep for the decoder
            return None
        return _as_call(obj) if not body[end:].strip() else None


class _ObjectEnd:
    """Where the JSON object opening at `start` of a growing text closes: its braces counted outside
    strings, each character once across the deltas (decoding the held call again at each "}" was
    quadratic in a call of many nested objects)."""

    def __init__(self, start: int) -> None:
        self.start, self.pos, self.depth, self.in_str, self.esc = start, start, 0, False, False
        self.end: int | None = None  # just past the closing brace, once seen

    def scan(self, text: str) -> int | None:
        while self.end is None and self.pos < len(text):
            ch = text[self.pos]
            self.pos += 1
            if self.in_str:
                self.esc, self.in_str = (False, True) if self.esc else (ch == "\\", ch != '"')
            elif ch == '"':
                self.in_str = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    self.end = self.pos
        return self.end


class _Llama3Scanner(_Scanner):
    def __init__(self) -> None:
        self.mode = "start"  # "start": nothing decided; "calls": after a call; "text": the rest is content
        self.held: _ObjectEnd | None = None  # the call held at the text's start: where it closes
        self.bad = False  # the held call closed but is no call: content, known once the output is
        self.skip = 0  # how much of the held text is known to be skippable (whitespace, the tag, ";")

    def step(self, buf: str, final: bool) -> tuple[list[Found], int]:
        out: list[Found] = []
        i = 0  # buf[:i] decided
        held, self.held, bad, self.bad = self.held, None, self.bad, False
        skip, self.skip = self.skip, 0  # (rescanning it from 0 each delta was quadratic in a run of whitespace)
        while self.mode != "text":
            p = _skip_ws(buf, max(i, skip))
            if self.mode == "start" and buf.startswith(PYTHON_TAG, p):
                p = _skip_ws(buf, p + len(PYTHON_TAG))
            elif self.mode == "start" and PYTHON_TAG.startswith(buf[p:]) and p < len(buf) and not final:
                return out, i  # may become the tag
            elif self.mode == "calls" and buf.startswith(";", p):
                p = _skip_ws(buf, p + 1)
            if p == len(buf) and not final:
                self.skip = p - i  # (the caller keeps buf[i:] and appends to it)
                return out, i
            if not buf.startswith("{", p):
                break
            if not final and i == 0:  # decoded once its braces close (or, malformed, once the output ends)
                self.held = held if held is not None and held.start == p else _ObjectEnd(p)
                self.bad = bad and self.held is held
                if self.held.scan(buf) is None or self.bad:
                    return out, i
            try:
                obj, end = _DECODER.raw_decode(buf, p)
            except (ValueError, RecursionError):  # not complete yet, or malformed (known only once the output is)
                if not final:
                    self.bad = i == 0
                    return out, i
                break
            call = _as_call(obj)
            if call is None:
                break
            out.append(call)
            self.mode, i, self.held = "calls", end, None  # (the text is cut at i: a tracker is for the next call)
        self.mode = "text"
        out.append(buf[i:])
        return out, len(buf)


class ToolCallStream:
    """One output's tool calls as it streams: `feed(delta_text)` after each step, `finish()` at the end;
    each returns the deltas that can be sent. `calls` holds the calls found so far."""

    def __init__(self, scanner: _Scanner, rng: random.Random) -> None:
        self._scanner, self._rng = scanner, rng
        self._buf = ""  # text not decided yet
        self._ws = ""  # whitespace that opens a stretch of content: dropped if a call (or, after one, the end) comes first
        self._in_text = False  # the current stretch of content has more than whitespace (all of it is sent)
        self._done = False
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> list[Delta]:
        if self._done:
            raise RuntimeError("feed after finish")
        self._buf += text
        found, n = self._scanner.step(self._buf, False)
        self._buf = self._buf[n:]
        return self._deltas(found)

    def finish(self) -> list[Delta]:
        """The deltas of the held text, once the output is complete."""
        if self._done:
            return []
        found, _ = self._scanner.step(self._buf, True)
        self._buf, self._done = "", True
        out = self._deltas(found)
        if not self.calls and self._ws:  # no call at all: the output is content as it is, blank too (vLLM's)
            out.append(ContentDelta(self._ws))  # (finished: nothing follows)
        return out

    def _deltas(self, found: list[Found]) -> list[Delta]:
        out: list[Delta] = []
        text = ""  # content to send, in one delta per run
        for f in found:
            if isinstance(f, str):
                if not self._in_text:
                    if f.isspace() or not f:
                        self._ws += f
                        continue
                    f, self._ws, self._in_text = self._ws + f, "", True
                text += f
                continue
            if text:
                out.append(ContentDelta(text))
                text = ""
            call = ToolCall(call_id(self._rng), *f)
            index = len(self.calls)
            self.calls.append(call)
            self._ws, self._in_text = "", False
            out += [ToolCallDelta(index, call.id, call.name), ToolCallDelta(index, arguments=call.arguments)]
        if text:
            out.append(ContentDelta(text))
        return out


class ToolParser:
    """A tool-call format. Call ids come from rng (a fresh, OS-seeded one if none)."""

    name = ""

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng if rng is not None else random.Random()

    def _scanner(self) -> _Scanner:
        raise NotImplementedError

    def streaming(self) -> ToolCallStream:
        """A parser for one output that arrives in pieces."""
        return ToolCallStream(self._scanner(), self.rng)

    def extract(self, text: str) -> ExtractedToolCalls:
        """The content and calls of a finished output."""
        s = self.streaming()
        deltas = s.feed(text) + s.finish()
        content = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
        parts: list[str | ToolCall] = []
        for d in deltas:
            if isinstance(d, ContentDelta):
                if parts and isinstance(parts[-1], str):
                    parts[-1] += d.text
                else:
                    parts.append(d.text)
            elif d.name is not None:  # a call's first delta
                parts.append(s.calls[d.index])
        return ExtractedToolCalls(content or None, s.calls, parts)


class HermesToolParser(ToolParser):
    name = "hermes"

    def _scanner(self) -> _Scanner:
        return _HermesScanner()


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def _scanner(self) -> _Scanner:
        return _Llama3Scanner()


TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}


def parser_for_model(architecture: str, chat_template: str | None) -> str:
    """The default tool-call format for a model: hermes for Qwen 2 / 3 and templates that write
    `<tool_call>`, llama3_json for Llama 3 templates (`<|python_tag|>`, calls as "parameters"),
    hermes otherwise."""
    t = chat_template or ""
    if architecture.startswith(("Qwen2", "Qwen3")) or OPEN in t:
        return "hermes"
    if PYTHON_TAG in t or '"parameters"' in t:
        return "llama3_json"
    return "hermes"


def parse_forced_calls(text: str, rng: random.Random | None = None) -> list[ToolCall]:
    """The calls of an output constrained by `tools_json_schema`: [{"name", "arguments"}, ...].
    ValueError when it is no such array (an output cut short by max_tokens)."""
    rng = rng if rng is not None else random.Random()
    try:
        obj = _DECODER.decode(text)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"tool calls: the output is not JSON ({e})") from None
    if not isinstance(obj, list) or not obj:
        raise ValueError("tool calls: the output is not a non-empty JSON array")
    calls = []
    for i, item in enumerate(obj):
        call = _as_call(item)
        if call is None:
            raise ValueError(f"tool calls: item {i} is not {{\"name\": ..., \"arguments\": {{...}}}}")
        calls.append(ToolCall(call_id(rng), *call))
    return calls
