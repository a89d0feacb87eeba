"""Tool-call parsing (lmserve/server/tool_parsers.py): hermes and llama3_json outputs, whole and streamed
in any chunking, call ids, and the schema that forces calls (tool_choice "required" / a named function)."""

from __future__ import annotations

import json
import random
import re
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmserve.server.tool_parsers import (
    CLOSE, OPEN, PYTHON_TAG, TOOL_PARSERS, ContentDelta, ExtractedToolCalls, HermesToolParser, Llama3JsonToolParser,
    ToolCall, ToolCallDelta, call_id, parse_forced_calls, parser_for_model)
from lmserve.server.limits import ServerLimits
from lmserve.server.tool_schema import check_tools, tools_json_schema

PROPERTY = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ID_RE = re.compile(r"call_[A-Za-z0-9]{24}")


def hermes(seed: int = 0) -> HermesToolParser:
    return HermesToolParser(random.Random(seed))


def llama3(seed: int = 0) -> Llama3JsonToolParser:
    return Llama3JsonToolParser(random.Random(seed))


def calls_of(r: ExtractedToolCalls) -> list[tuple[str, Any]]:
    return [(c.name, json.loads(c.arguments)) for c in r.calls]


def collect(deltas: list[Any]) -> tuple[str, list[dict[str, Any]]]:
    """Content and calls (id, name, arguments text) as a client rebuilds them from the stream, checking
    each delta is shaped as OpenAI streams it."""
    content, calls = "", []
    for d in deltas:
        if isinstance(d, ContentDelta):
            assert d.text, "an empty content delta"
            assert d.openai() == {"content": d.text}
            content += d.text
            continue
        assert isinstance(d, ToolCallDelta)
        o = d.openai()["tool_calls"]
        assert len(o) == 1 and o[0]["index"] == d.index
        if d.id is not None:  # a call's first delta: id, type, name, no arguments yet
            assert d.index == len(calls) and ID_RE.fullmatch(d.id) and d.name and d.arguments == ""
            assert o[0] == {"index": d.index, "id": d.id, "type": "function",
                            "function": {"name": d.name, "arguments": ""}}
            calls.append({"id": d.id, "name": d.name, "arguments": ""})
        else:  # arguments only, for the call being sent
            assert d.name is None and calls and d.index == len(calls) - 1
            assert o[0] == {"index": d.index, "function": {"arguments": d.arguments}}
            calls[-1]["arguments"] += d.arguments
    return content, calls


def stream(parser: Any, pieces: list[str]) -> tuple[str, list[dict[str, Any]]]:
    s = parser.streaming()
    deltas = [d for p in pieces for d in s.feed(p)] + s.finish()
    content, calls = collect(deltas)
    assert [c["id"] for c in calls] == [c.id for c in s.calls]
    return content, calls


def split(text: str, cuts: list[int]) -> list[str]:
    cuts = sorted({min(c, len(text)) for c in cuts})
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def assert_stream_matches(parser_cls: type, text: str, pieces: list[str]) -> None:
    """Streaming the pieces gives the content and calls extract() finds in the whole text (same ids
    too, from the same seed)."""
    assert "".join(pieces) == text
    whole = parser_cls(random.Random(1)).extract(text)
    content, calls = stream(parser_cls(random.Random(1)), pieces)
    assert content == (whole.content or "")
    assert [c["name"] for c in calls] == [c.name for c in whole.calls]
    assert [json.loads(c["arguments"]) for c in calls] == [json.loads(c.arguments) for c in whole.calls]
    assert [c["arguments"] for c in calls] == [c.arguments for c in whole.calls]
    assert [c["id"] for c in calls] == [c.id for c in whole.calls]


# ---------------------------------------------------------------- hand-written outputs: hermes

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
TIME = '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}'


def test_hermes_single_call() -> None:
    r = hermes().extract(f"<tool_call>\n{WEATHER}\n</tool_call>")
    assert r.content is None
    assert calls_of(r) == [("get_weather", {"city": "Paris", "unit": "celsius"})]
    assert r.calls[0].arguments == '{"city": "Paris", "unit": "celsius"}'
    assert r.calls[0].openai() == {"id": r.calls[0].id, "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}


def test_hermes_parallel_calls_with_leading_content() -> None:
    text = f"Let me look both up.\n\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>\n"
    r = hermes().extract(text)
    assert r.content == "Let me look both up.\n\n"
    assert calls_of(r) == [("get_weather", {"city": "Paris", "unit": "celsius"}),
                           ("get_time", {"tz": "Europe/Paris"})]
    assert len({c.id for c in r.calls}) == 2


def test_hermes_content_between_and_after_calls() -> None:
    text = f"A<tool_call>{WEATHER}</tool_call> then B <tool_call>{TIME}</tool_call>\nDone."
    r = hermes().extract(text)
    assert r.content == "A then B \nDone."
    assert [c.name for c in r.calls] == ["get_weather", "get_time"]


def test_hermes_no_calls_is_all_content() -> None:
    text = "Plain answer with <b>tags</b>, a <tool_call mention and </tool_call> too."
    assert hermes().extract(text) == ExtractedToolCalls(text, [])
    assert hermes().extract("  \n ").content == "  \n "  # (no call: the text as it is, vLLM's; it was None)


@pytest.mark.parametrize("body", [
    '{"name": "get_weather", "arguments": {"city": }}',  # not JSON
    '{"name": "get_weather", "arguments": {"city": "Paris"}',  # cut short
    '{"name": "get_weather"}',  # no arguments
    '{"name": 3, "arguments": {}}',  # name not a string
    '{"name": "f", "arguments": [1, 2]}',  # arguments not an object
    '{"name": "f", "arguments": {}, "parameters": {}}',  # both
    '{"name": "f", "arguments": {}} trailing',  # more than the object
    '{"name": "f", "arguments": {"x": NaN}}',  # not JSON
    'get_weather(city="Paris")', '', "[" * 100_000])
def test_hermes_malformed_body_is_content(body: str) -> None:
    text = f"Checking. <tool_call>\n{body}\n</tool_call> <tool_call>\n{TIME}\n</tool_call>"
    r = hermes().extract(text)
    assert r.content == f"Checking. <tool_call>\n{body}\n</tool_call> "
    assert [c.name for c in r.calls] == ["get_time"]
    content, calls = stream(hermes(), split(text, list(range(1, len(text), 1 if len(text) < 1000 else 5))))
    assert content == r.content and [c["name"] for c in calls] == ["get_time"]


def test_hermes_unclosed_call_is_content() -> None:
    text = f"Sure. <tool_call>\n{WEATHER[:-9]}"  # cut off by max_tokens inside the call
    assert hermes().extract(text) == ExtractedToolCalls(text, [])
    s = hermes().streaming()
    assert collect(s.feed(text))[0] == "Sure. "  # held until decided...
    assert collect(s.finish())[0] == f"<tool_call>\n{WEATHER[:-9]}"  # ...then released as content
    assert s.calls == []


def test_hermes_whole_call_without_its_closing_tag_at_the_end_is_a_call() -> None:
    """A model that stops after the call's JSON without writing </tool_call> (Qwen / Hermes models do):
    the call was lost, its markup returned as content; vLLM's parser reads it as a call, streamed too."""
    for tail in ("", "\n", " \n"):
        text = f"Sure. <tool_call>\n{WEATHER}{tail}"
        r = hermes().extract(text)
        assert r.content == "Sure. " and calls_of(r) == [("get_weather", {"city": "Paris", "unit": "celsius"})], tail
        for a in range(len(text) + 1):
            assert_stream_matches(HermesToolParser, text, [text[:a], text[a:]])
    text = f"<tool_call>\n{WEATHER}\n</tool_call><tool_call>\n{WEATHER}"  # a closed call, then an unclosed one
    assert calls_of(hermes().extract(text)) == [("get_weather", {"city": "Paris", "unit": "celsius"})] * 2
    assert hermes().extract(f"<tool_call>\n{WEATHER} and more").calls == []  # text after it: no call


def test_hermes_repeated_opening_tag() -> None:
    r = hermes().extract(f"<tool_call>\n<tool_call>\n{WEATHER}\n</tool_call>")
    assert r.content == "<tool_call>\n" and [c.name for c in r.calls] == ["get_weather"]


def test_hermes_opening_tag_inside_the_arguments() -> None:
    """A call whose arguments' text holds '<tool_call>' (a tool writing about tool calls): the first
    opening tag whose body is a call opens it, as vLLM's regex reads it (the last tag was taken, its body
    did not parse, and the whole call came back as content)."""
    text = ('Writing.<tool_call>\n{"name": "write_file", "arguments": {"text": "see <tool_call> tag"}}\n'
            '</tool_call>')
    r = hermes().extract(text)
    assert r.content == "Writing." and calls_of(r) == [("write_file", {"text": "see <tool_call> tag"})]
    for a in range(len(text) + 1):
        assert_stream_matches(HermesToolParser, text, [text[:a], text[a:]])


def test_extract_parts_keep_the_order() -> None:
    """parts: content stretches and calls in the order written (what the Responses / Messages APIs'
    whole responses list), whitespace-only stretches dropped as the stream drops them."""
    r = hermes().extract(f"<tool_call>{WEATHER}</tool_call>\n Done. <tool_call>{TIME}</tool_call>\n")
    assert [p if isinstance(p, str) else p.name for p in r.parts] == ["get_weather", "\n Done. ", "get_time"]
    assert [p for p in r.parts if not isinstance(p, str)] == r.calls


def test_hermes_lenient_json() -> None:
    body = '{"arguments": {"code": "line1\nline2", "s": "\\u00e9\\"q\\""}, "name": "run", "id": 1}'
    r = hermes().extract(f"<tool_call>{body}</tool_call>")  # raw newline in a string, keys reordered, extra key
    assert calls_of(r) == [("run", {"code": "line1\nline2", "s": 'é"q"'})]
    assert r.calls[0].arguments == '{"code": "line1\\nline2", "s": "é\\"q\\""}'


def test_hermes_holds_what_may_be_a_tag() -> None:
    s = hermes().streaming()
    assert s.feed("Hi <to") == [ContentDelta("Hi ")]
    assert s.feed("ol_") == []
    assert s.feed("box>!") == [ContentDelta("<tool_box>!")]
    assert s.feed(" <tool_call") == [ContentDelta(" ")]
    assert s.feed(">\n{\"name\": \"f\", ") == []
    d = s.feed('"arguments": {"a": "</x>"}}\n</tool_call>')
    assert d == [ToolCallDelta(0, s.calls[0].id, "f", ""), ToolCallDelta(0, arguments='{"a": "</x>"}')]
    assert s.feed("<") == []
    assert s.finish() == [ContentDelta("<")]
    with pytest.raises(RuntimeError):
        s.feed("x")


def test_whitespace_only_stretches_are_dropped_streaming() -> None:
    s = hermes().streaming()
    assert s.feed("\n\n") == []  # may be followed by a call
    assert s.feed(f"<tool_call>{TIME}</tool_call>")[0].name == "get_time"
    assert s.feed("\n  ") == []
    assert s.feed("ok\n") == [ContentDelta("\n  ok\n")]  # a stretch with text is sent whole
    assert s.finish() == []


@pytest.mark.parametrize("parser", [hermes, llama3])
def test_a_blank_output_without_calls_is_its_content(parser) -> None:  # type: ignore[no-untyped-def]
    """No call at all: the output is the content as it is, blank too, streamed as whole (vLLM's rule; the
    stream dropped it while the whole answer kept it)."""
    s = parser().streaming()
    assert s.feed("\n") == [] and s.feed("\n ") == []
    assert s.finish() == [ContentDelta("\n\n ")] and parser().extract("\n\n ").content == "\n\n "


# ---------------------------------------------------------------- hand-written outputs: llama3_json

def test_llama3_single_call() -> None:
    r = llama3().extract('{"name": "get_weather", "parameters": {"city": "Paris"}}')
    assert r.content is None and calls_of(r) == [("get_weather", {"city": "Paris"})]
    r = llama3().extract(f'  {PYTHON_TAG}{{"name": "f", "parameters": {{}}}}\n')
    assert r.content is None and calls_of(r) == [("f", {})]


def test_llama3_parallel_calls() -> None:
    text = ('{"name": "get_weather", "parameters": {"city": "Paris; France"}}; '
            '{"name": "get_time", "arguments": {"tz": "CET"}};{"name": "noop", "parameters": {}}')
    r = llama3().extract(text)
    assert r.content is None
    assert calls_of(r) == [("get_weather", {"city": "Paris; France"}), ("get_time", {"tz": "CET"}), ("noop", {})]


def test_llama3_text_after_calls_is_content() -> None:
    r = llama3().extract('{"name": "f", "parameters": {"a": 1}}\nI called f.')
    assert r.content == "\nI called f." and calls_of(r) == [("f", {"a": 1})]
    r = llama3().extract('{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"a": }}')
    assert r.content == '; {"name": "g", "parameters": {"a": }}' and calls_of(r) == [("f", {})]


@pytest.mark.parametrize("text", [
    "The weather in Paris is mild.",
    'I would call {"name": "get_weather", "parameters": {"city": "Paris"}}',  # not at the start
    '{"answer": 42}',  # JSON, but no call
    '{"name": "get_weather", "parameters": {"city": }}',  # malformed
    '{"name": "get_weather", "parameters": {"city": "Par',  # cut short
    '{"name": "get_weather", "parameters": "city=Paris"}',
    f"{PYTHON_TAG}print('hello')",  # a built-in (code) call: not JSON
    "<|python", "; {\"name\": \"f\", \"parameters\": {}}"])
def test_llama3_not_a_call_is_content(text: str) -> None:
    assert llama3().extract(text) == ExtractedToolCalls(text, [])
    assert stream(llama3(), list(text)) == (text, [])


def test_llama3_holds_what_may_be_a_tag_or_call() -> None:
    s = llama3().streaming()
    assert s.feed(" <|python") == []
    assert s.feed("_tag|>") == []
    assert s.feed('{"name": "f", "parameters": {"x": "}"') == []
    d = s.feed("}}")
    assert [x.name for x in d] == ["f", None] and d[1].arguments == '{"x": "}"}'
    assert s.feed(" ;") == []
    assert s.feed(" x") == [ContentDelta(" ; x")]
    assert s.feed(' {"name": "g", "parameters": {}}') == [ContentDelta(' {"name": "g", "parameters": {}}')]
    s = llama3().streaming()
    assert s.feed("<|python") == [] and s.feed(" is a snake") == [ContentDelta("<|python is a snake")]


def test_llama3_stream_decodes_a_held_call_once_its_braces_close(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A call of many nested objects streamed a token at a time: the held call is decoded once its
    outer braces close, not again at every "}" (each decode read the whole call so far: quadratic in
    its length; 400 objects took 400 decodes of up to 12 KB). Strings holding braces and escaped
    quotes do not close it early."""
    from lmserve.server import tool_parsers as tp
    decodes = [0]
    real = tp._DECODER

    class Counting:
        def raw_decode(self, text: str, idx: int = 0):  # type: ignore[no-untyped-def]
            decodes[0] += 1
            return real.raw_decode(text, idx)

        def decode(self, text: str):  # type: ignore[no-untyped-def]
            return real.decode(text)

    monkeypatch.setattr(tp, "_DECODER", Counting())
    args = {"items": [{"id": i, "note": 'a "}" and a \\"{'} for i in range(400)]}
    text = json.dumps({"name": "f", "parameters": args})
    s = llama3().streaming()
    deltas = []
    for k in range(0, len(text), 3):
        deltas += s.feed(text[k:k + 3])
    deltas += s.finish()
    assert decodes[0] <= 2, decodes[0]
    assert [json.loads(d.arguments) for d in deltas if getattr(d, "arguments", "")] == [args]


# ---------------------------------------------------------------- any chunking: hypothesis

TRICKY = 'ab Z"\\/{}[]:,;<>\n\té€😀\u2028'  # no tag can be spelled from these (no t, o, l, _, c)
names = st.from_regex(r"[a-zA-Z0-9_-]{1,12}", fullmatch=True)
keys = st.text(alphabet=TRICKY, max_size=6)
scalars = (st.none() | st.booleans() | st.integers(-10**9, 10**9)
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(alphabet=TRICKY, max_size=12))
values = st.recursive(scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(keys, c, max_size=3),
                      max_leaves=8)
arguments = st.dictionaries(keys, values, max_size=4)


@st.composite
def call_json(draw: Any, args_key: str) -> tuple[str, dict[str, Any], str]:
    """(name, arguments, the call as JSON text in one of the spellings a model may use)."""
    name, args = draw(names), draw(arguments)
    obj = {"name": name, args_key: args}
    if draw(st.booleans()):
        obj = dict(reversed(obj.items()))
    text = json.dumps(obj, ensure_ascii=draw(st.booleans()), indent=draw(st.sampled_from([None, 2])),
                      separators=draw(st.sampled_from([None, (",", ":")])))
    return name, args, text


# content around hermes calls; `>` only in "<b>", so no tag can form in it
HERMES_TEXT = st.lists(st.text(alphabet="ab <\n/é😀\"{", max_size=6)
                       | st.sampled_from(["<tool", "<tool_call", "</tool_call", "<tool_cal", "<b>", "<", "\n\n", " "]),
                       max_size=5).map("".join)
# and with whole tags too (for the stream-vs-extract property: anything goes)
HERMES_RICH = st.lists(HERMES_TEXT | st.sampled_from([OPEN, CLOSE, ">", "tool_call>", f"{OPEN}\n{{", "}\n"]),
                       max_size=4).map("".join)
MALFORMED = ['{"name": "f", "arguments": {"a": }}', '{"name": "f"}', "not json", "", '{"name": "f", "arguments": 1}']


@st.composite
def hermes_output(draw: Any, rich: bool = False) -> tuple[str, str | None, list[tuple[str, Any]], list[int]]:
    """(output, its expected content, its expected calls, where each call ends in the output)."""
    text, content, calls, gap, ends = "", "", [], "", []
    for _ in range(draw(st.integers(0, 4))):
        kind = draw(st.sampled_from(["text", "call", "malformed"]))
        if kind == "text":
            piece = draw(HERMES_RICH if rich else HERMES_TEXT)
        elif kind == "malformed":
            body = draw(st.sampled_from(MALFORMED) | call_json("arguments").map(lambda c: c[2][:-1]))
            piece = f"{OPEN}\n{body}\n{CLOSE}"
        else:
            name, args, body = draw(call_json("arguments"))
            pre, post = draw(st.sampled_from(["\n", "", " \n"])), draw(st.sampled_from(["\n", "", "\n "]))
            piece = f"{OPEN}{pre}{body}{post}{CLOSE}"
            content += gap if gap.strip() else ""
            calls.append((name, args))
            gap = ""
            text += piece
            ends.append(len(text))
            continue
        gap += piece
        text += piece
    content += gap if gap.strip() else ""
    return text, (content if calls else text) or None, calls, ends  # (no call: the text as it is, blank too)


@st.composite
def llama3_output(draw: Any, rich: bool = False) -> tuple[str, str | None, list[tuple[str, Any]], list[int]]:
    ws = st.sampled_from(["", " ", "\n", "\n\n ", "\t"])
    words = st.text(alphabet='ab {}";<|>_\né😀', max_size=12)
    kind = draw(st.sampled_from(["calls", "text", "bad_first"]))
    lead = draw(ws) + (PYTHON_TAG + draw(ws) if draw(st.booleans()) else "")
    if kind == "text":  # opens with neither the tag nor a call
        text = draw(ws) + draw(st.sampled_from(["Sure", "<|python", "x", "; "])) + draw(words)
        return text, text or None, [], []
    if kind == "bad_first":
        bad = draw(st.sampled_from(MALFORMED + ['{"answer": 42}', "{"])
                   | call_json("parameters").map(lambda c: c[2][:-1]))
        text = lead + bad + draw(words.map(lambda w: w.replace("}", "")))  # nothing that completes bad
        return text, text or None, [], []
    calls, text, ends = [], lead, []
    for k in range(draw(st.integers(1, 3))):
        name, args, body = draw(call_json(draw(st.sampled_from(["parameters", "arguments"]))))
        text += (draw(st.sampled_from([";", "; ", " ; ", "\n;\n", " ", "\n"])) if k else "") + body
        calls.append((name, args))
        ends.append(len(text))
    rest = draw(st.sampled_from(["", " ", "\n"]))
    if draw(st.booleans()):
        rest += draw(st.sampled_from(["Done", "x {", PYTHON_TAG, '; {"a": 1}', ";{", '; {"name": "f"']))
        rest += draw(words)
    if rich:
        rest += draw(HERMES_RICH)
    text += rest
    return text, rest if rest.strip() else None, calls, ends


def cuts_for(text: str) -> st.SearchStrategy[list[int]]:
    """Where to cut text into the pieces a stream delivers: anywhere, at every character, or few cuts."""
    n = len(text)
    return st.one_of(st.just(list(range(1, n))), st.lists(st.integers(0, n), max_size=max(1, n)),
                     st.lists(st.integers(0, n), max_size=4))


def assert_calls_sent_when_complete(parser: Any, pieces: list[str], ends: list[int]) -> None:
    """A stream sends each call as soon as the text that completes it has come (not later)."""
    s, fed, sent = parser.streaming(), 0, 0
    for p in pieces:
        sent += sum(isinstance(d, ToolCallDelta) and d.id is not None for d in s.feed(p))
        fed += len(p)
        assert sent == sum(e <= fed for e in ends), (fed, ends)


@PROPERTY
@given(st.data(), hermes_output())
def test_hermes_extract_finds_what_was_written(data: Any, case: tuple[str, str | None, list[Any], list[int]]) -> None:
    text, content, calls, ends = case
    r = hermes().extract(text)
    assert r.content == content
    assert calls_of(r) == calls
    assert_calls_sent_when_complete(hermes(), split(text, data.draw(cuts_for(text))), ends)


@PROPERTY
@given(st.data(), llama3_output())
def test_llama3_extract_finds_what_was_written(data: Any, case: tuple[str, str | None, list[Any], list[int]]) -> None:
    text, content, calls, ends = case
    r = llama3().extract(text)
    assert r.content == content
    assert calls_of(r) == calls
    assert_calls_sent_when_complete(llama3(), split(text, data.draw(cuts_for(text))), ends)


@PROPERTY
@given(st.data(), hermes_output(rich=True))
def test_hermes_stream_matches_extract_in_any_chunking(data: Any, case: tuple[str, Any, Any]) -> None:
    text = case[0]
    assert_stream_matches(HermesToolParser, text, split(text, data.draw(cuts_for(text))))


@PROPERTY
@given(st.data(), llama3_output(rich=True))
def test_llama3_stream_matches_extract_in_any_chunking(data: Any, case: tuple[str, Any, Any]) -> None:
    text = case[0]
    assert_stream_matches(Llama3JsonToolParser, text, split(text, data.draw(cuts_for(text))))


SAMPLES = {
    HermesToolParser: (f"Hé 😀 <tool_cal <tool_call>\n{{\"name\": \"f\", \"arguments\": {{\"q\": \"a\\\"b\\\\\", "
                       f"\"u\": \"\\u00e9😀 </x>\"}}}}\n</tool_call>\n<tool_call>\n{{bad}}\n</tool_call>"
                       f"<tool_call>{TIME}</tool_call> end <"),
    Llama3JsonToolParser: (f" {PYTHON_TAG} {{\"name\": \"f\", \"parameters\": {{\"q\": \"a\\\"b}}\\\\\", "
                           f"\"u\": \"\\u00e9😀;\"}}}} ; {{\"name\": \"g\", \"parameters\": {{}}}}\n tail ;"),
}


@pytest.mark.parametrize("cls", list(SAMPLES))
def test_every_two_and_three_piece_split(cls: type) -> None:
    """Every cut point, and every pair of them, of an output with calls, escapes and near-tags."""
    text = SAMPLES[cls]
    r = cls(random.Random(0)).extract(text)
    assert len(r.calls) == 2 and r.content  # the sample exercises calls and content
    for a in range(len(text) + 1):
        assert_stream_matches(cls, text, [text[:a], text[a:]])
        for b in range(a, len(text) + 1, 7):
            assert_stream_matches(cls, text, [text[:a], text[a:b], text[b:]])


# ---------------------------------------------------------------- ids, registry, default format

def test_ids_are_openai_style_and_deterministic() -> None:
    text = f"<tool_call>{WEATHER}</tool_call><tool_call>{TIME}</tool_call>"
    a, b = hermes(seed=7).extract(text), hermes(seed=7).extract(text)
    assert [c.id for c in a.calls] == [c.id for c in b.calls]
    assert all(ID_RE.fullmatch(c.id) for c in a.calls) and a.calls[0].id != a.calls[1].id
    assert [c.id for c in hermes(seed=8).extract(text).calls] != [c.id for c in a.calls]
    assert call_id(random.Random(3)) == call_id(random.Random(3))
    assert ID_RE.fullmatch(call_id(random.Random(3)))
    p = HermesToolParser()  # unseeded: still unique
    assert len({c.id for _ in range(20) for c in p.extract(text).calls}) == 40


def test_registry_and_parser_for_model() -> None:
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json"}
    assert all(cls.name == key for key, cls in TOOL_PARSERS.items())
    llama31 = ('{{- "Given the following functions, please respond with a JSON for a function call" }}'
               '{{- \'{"name": function name, "parameters": dictionary of argument name and its value}\' }}'
               "{%- if builtin_tools is defined %}<|python_tag|>{% endif %}")
    qwen = "{%- for tool in tools %}...<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}"
    assert parser_for_model("Qwen2ForCausalLM", None) == "hermes"
    assert parser_for_model("Qwen3ForCausalLM", "plain template") == "hermes"
    assert parser_for_model("LlamaForCausalLM", llama31) == "llama3_json"
    assert parser_for_model("LlamaForCausalLM", "{{ '<|python_tag|>' }}") == "llama3_json"
    assert parser_for_model("LlamaForCausalLM", qwen) == "hermes"  # a template with <tool_call> wins
    assert parser_for_model("LlamaForCausalLM", None) == "hermes"
    assert parser_for_model("MistralForCausalLM", "{{ messages }}") == "hermes"


# ---------------------------------------------------------------- forced calls: schema, validation

def _type_ok(v: Any, t: str) -> bool:
    return {"object": isinstance(v, dict), "array": isinstance(v, list), "string": isinstance(v, str),
            "boolean": isinstance(v, bool), "null": v is None,
            "integer": isinstance(v, int) and not isinstance(v, bool),
            "number": isinstance(v, (int, float)) and not isinstance(v, bool)}[t]


def valid(v: Any, s: dict[str, Any], root: dict[str, Any] | None = None) -> bool:
    """A small JSON schema validator (jsonschema is not installed): the keywords these schemas use."""
    root = s if root is None else root
    known = {"type", "properties", "required", "additionalProperties", "items", "anyOf", "enum", "const",
             "minItems", "maxItems", "description", "title", "$ref", "$defs", "definitions"}
    assert set(s) <= known, f"the test validator does not know {set(s) - known}"
    if "$ref" in s:  # "#/a/b": a JSON pointer into the root ("#": the root; "~1" is "/", "~0" is "~")
        target = root
        for part in [p for p in s["$ref"].removeprefix("#").split("/") if p]:
            target = target[part.replace("~1", "/").replace("~0", "~")]
        if not valid(v, target, root):
            return False
    if "type" in s and not _type_ok(v, s["type"]):
        return False
    if "enum" in s and v not in s["enum"] or "const" in s and v != s["const"]:
        return False
    if "anyOf" in s and not any(valid(v, x, root) for x in s["anyOf"]):
        return False
    if isinstance(v, dict):
        props = s.get("properties", {})
        if any(k not in v for k in s.get("required", [])):
            return False
        if s.get("additionalProperties") is False and set(v) - set(props):
            return False
        if not all(valid(v[k], props[k], root) for k in v if k in props):
            return False
    if isinstance(v, list):
        if len(v) < s.get("minItems", 0) or len(v) > s.get("maxItems", len(v)):
            return False
        if "items" in s and not all(valid(x, s["items"], root) for x in v):
            return False
    return True


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": {"type": "object", "required": ["city"], "properties": {
                                          "city": {"type": "string"},
                                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}},
    {"type": "function", "function": {"name": "get_time"}},  # no parameters
]
W = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
T = {"name": "get_time", "arguments": {}}


def test_validator_rejects() -> None:  # the checks below rely on it
    assert valid([1], {"type": "array", "items": {"type": "integer"}})
    assert not valid(["1"], {"items": {"type": "integer"}})
    assert not valid({"a": 1}, {"type": "object", "properties": {}, "additionalProperties": False})
    assert not valid({}, {"type": "object", "required": ["a"]}) and not valid(True, {"type": "integer"})


def test_schema_required() -> None:
    s = tools_json_schema(TOOLS, "required", parallel=True)
    assert s["minItems"] == 1 and "maxItems" not in s
    for ok in ([W], [T], [W, T, W]):
        assert valid(ok, s), ok
    for bad in ([], W, [{"name": "other", "arguments": {}}], [{"name": "get_weather", "arguments": {}}],
                [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "kelvin"}}],
                [{"name": "get_time"}], [{**T, "extra": 1}], [{"name": "get_weather", "arguments": {"city": 3}}],
                [{"name": "get_time", "arguments": []}]):
        assert not valid(bad, s), bad


def test_schema_not_parallel() -> None:
    s = tools_json_schema(TOOLS, "required", parallel=False)
    assert s["maxItems"] == 1
    assert valid([W], s) and valid([T], s) and not valid([W, T], s) and not valid([], s)


def test_schema_named() -> None:
    for mode in ("get_weather", {"type": "function", "function": {"name": "get_weather"}}):
        s = tools_json_schema(TOOLS, mode, parallel=False)
        assert valid([W], s) and not valid([T], s) and not valid([W, W], s)
        assert not valid([W, W], tools_json_schema(TOOLS, mode, parallel=True))  # named: exactly one call
    s = tools_json_schema(TOOLS, "get_time", parallel=False)
    assert valid([T], s) and not valid([W], s) and not valid([{"name": "get_weather", "arguments": {}}], s)


# parameters as pydantic writes them: definitions referred to by "#/$defs/..."
PLACE = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TRIP = {"type": "function", "function": {"name": "plan_trip", "parameters": {
    "type": "object", "$defs": {"Place": PLACE},
    "properties": {"stops": {"type": "array", "items": {"$ref": "#/$defs/Place"}, "minItems": 1}},
    "required": ["stops"]}}}
MOVE = {"type": "function", "function": {"name": "move", "parameters": {
    "type": "object", "definitions": {"Place": PLACE}, "properties": {"to": {"$ref": "#/definitions/Place"}},
    "required": ["to"]}}}


def test_schema_moves_definitions_to_the_root() -> None:
    s = tools_json_schema([TRIP, MOVE, *TOOLS], "required", parallel=True)
    assert s["$defs"]["tool0_def0"] == s["$defs"]["tool1_def0"] == PLACE
    trip = {"name": "plan_trip", "arguments": {"stops": [{"city": "Paris"}, {"city": "Rome"}]}}
    move = {"name": "move", "arguments": {"to": {"city": "Oslo"}}}
    assert valid([trip, move, W], s)
    for bad in ({"name": "plan_trip", "arguments": {"stops": [{"city": 1}]}},
                {"name": "plan_trip", "arguments": {"stops": []}}, {"name": "move", "arguments": {"to": {}}}):
        assert not valid([bad], s), bad
    assert list(tools_json_schema([TRIP, *TOOLS], "get_time", parallel=True)["$defs"]) == ["tool2"]  # the chosen one's
    # two tools may define one name differently (pydantic's Address in two models): each keeps its own
    other = {"type": "function", "function": {"name": "visit", "parameters": {
        "type": "object", "$defs": {"Place": {"type": "string"}}, "properties": {"p": {"$ref": "#/$defs/Place"}}}}}
    s = tools_json_schema([TRIP, other], "required", parallel=True)
    trip = {"name": "plan_trip", "arguments": {"stops": [{"city": "Paris"}]}}
    assert valid([trip, {"name": "visit", "arguments": {"p": "Rome"}}], s)
    assert not valid([{"name": "visit", "arguments": {"p": {"city": "Rome"}}}], s)


# OpenAI's recursive form: "#" is the parameters themselves; "#/properties/..." a part of them
TREE = {"type": "function", "function": {"name": "make_ui", "parameters": {
    "type": "object", "properties": {"label": {"type": "string"}, "children": {"type": "array", "items": {"$ref": "#"}}},
    "required": ["label", "children"], "additionalProperties": False}}}
PAIR = {"type": "function", "function": {"name": "pair", "parameters": {
    "type": "object", "properties": {"a": {"type": "string"}, "b": {"$ref": "#/properties/a"}},
    "required": ["a", "b"]}}}
SLASHED = {"type": "function", "function": {"name": "slashed", "parameters": {
    "type": "object", "$defs": {"a/b": {"type": "integer"}}, "properties": {"n": {"$ref": "#/$defs/a~1b"}},
    "required": ["n"]}}}


@pytest.mark.parametrize("mode", ["required", "make_ui"])
def test_schema_keeps_root_relative_references(mode) -> None:  # type: ignore[no-untyped-def]
    """A "$ref" to "#" (or "#/properties/...") means the function's parameters: before, the parameters sat
    inside the calls' array, where "#" is the array (a child came out as a list of calls) and
    "#/properties/a" points nowhere (a 400)."""
    s = tools_json_schema([TREE, PAIR, SLASHED], mode, parallel=True)
    leaf = {"label": "b", "children": []}
    ui = {"name": "make_ui", "arguments": {"label": "a", "children": [leaf, {"label": "c", "children": [leaf]}]}}
    assert valid([ui], s)
    assert not valid([{"name": "make_ui", "arguments": {"label": "a", "children": [[ui]]}}], s)
    if mode == "required":
        assert valid([{"name": "pair", "arguments": {"a": "x", "b": "y"}}, {"name": "slashed", "arguments": {"n": 3}}], s)
        assert not valid([{"name": "pair", "arguments": {"a": "x", "b": 2}}], s)
        assert not valid([{"name": "slashed", "arguments": {"n": "3"}}], s)
    xgr = pytest.importorskip("xgrammar")  # the grammar engine follows every rebased reference (it cannot
    xgr.Grammar.from_json_schema(json.dumps(s))  # unescape "~1" in a name: the new names need no escapes)


def test_schema_rebases_schemas_not_values() -> None:
    """A "$ref" inside const / enum / default is data the output must equal: left as written; a property
    named "enum" is a schema, its reference rebased."""
    odd = {"type": "function", "function": {"name": "odd", "parameters": {
        "type": "object", "$defs": {"N": {"type": "integer"}},
        "properties": {"c": {"const": {"$ref": "#"}}, "enum": {"$ref": "#/$defs/N"}}, "required": ["c", "enum"]}}}
    s = tools_json_schema([odd], "odd")
    params = s["$defs"]["tool0"]
    assert params["properties"]["c"] == {"const": {"$ref": "#"}}
    assert params["properties"]["enum"] == {"$ref": "#/$defs/tool0_def0"} and s["$defs"]["tool0_def0"] == {"type": "integer"}
    assert valid([{"name": "odd", "arguments": {"c": {"$ref": "#"}, "enum": 3}}], s)


def test_forced_output_round_trip() -> None:
    out = json.dumps([W, T])
    assert valid(json.loads(out), tools_json_schema(TOOLS, "required", parallel=True))
    calls = parse_forced_calls(out, random.Random(5))
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [(W["name"], W["arguments"]), ("get_time", {})]
    assert [c.id for c in calls] == [c.id for c in parse_forced_calls(out, random.Random(5))]
    assert all(isinstance(c, ToolCall) and ID_RE.fullmatch(c.id) for c in calls)
    for bad in ("", "[]", json.dumps(W), json.dumps([W])[:-3], json.dumps([{"name": "f"}]), "[" * 100_000):
        with pytest.raises(ValueError, match="^tool calls: "):
            parse_forced_calls(bad)


def test_check_tools_fills_in_parameters() -> None:
    tools = check_tools(TOOLS)
    assert tools[0] == TOOLS[0]
    assert tools[1]["function"] == {"name": "get_time", "parameters": {"type": "object", "properties": {}}}
    assert check_tools([{"type": "function", "function": {"name": "f", "parameters": {"properties": {}}}}]
                       )[0]["function"]["parameters"] == {"type": "object", "properties": {}}
    many = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(200)]
    assert len(check_tools(many)) == 200  # how many: the server's limit (below)


def test_the_servers_limits_bound_the_tools() -> None:
    """--max-tools and --max-schema-bytes (ServerLimits) bound the tools: the count and the JSON size,
    each a ValueError naming the field and the flag; within them, nothing is said."""
    class Body:
        def __init__(self, tools: list) -> None:
            self.tools = tools
    lim = ServerLimits()
    lim.check(Body([fn(name=f"f{i}") for i in range(lim.max_tools)]))
    with pytest.raises(ValueError, match=r"^tools: at most 128 entries \(--max-tools\)"):
        lim.check(Body([fn(name=f"f{i}") for i in range(lim.max_tools + 1)]))
    with pytest.raises(ValueError, match=r"^tools: more than 65536 bytes as JSON \(--max-schema-bytes\)"):
        lim.check(Body([fn(description="x" * lim.max_schema_bytes)]))
    ServerLimits(max_tools=300, max_schema_bytes=2**20).check(Body([fn(name=f"f{i}") for i in range(300)]))


def fn(**kw: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "ok", **kw}}


@pytest.mark.parametrize("tools, field", [
    ("get_weather", "tools: must be a list"),
    ([fn(), "x"], "tools[1]: "),
    ([fn(), fn(name="b"), {"type": "retrieval", "function": {"name": "c"}}], "tools[2].type: "),
    ([{"type": "function"}], "tools[0].function: "),
    ([fn(), fn(name="b"), fn(name="has space")], "tools[2].function.name: "),
    ([fn(name="")], "tools[0].function.name: "),
    ([fn(name="a" * 65)], "tools[0].function.name: "),
    ([fn(name="é")], "tools[0].function.name: "),
    ([fn(name="f\n")], "tools[0].function.name: "),
    ([{"type": "function", "function": {"description": "no name"}}], "tools[0].function.name: "),
    ([fn(), fn()], "tools[1].function.name: "),  # twice
    ([fn(parameters={"type": "string"})], "tools[0].function.parameters: "),
    ([fn(parameters=[1])], "tools[0].function.parameters: "),
    ([fn(description=3)], "tools[0].function.description: "),
    ([fn(parameters={"type": "object", "$defs": [1]})], "tools[0].function.parameters.$defs: "),
    ([fn(parameters={"type": "object", "default": float("nan")})], "tools: must be JSON"),
])
def test_bad_tools_name_the_field(tools: Any, field: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(field)):
        tools_json_schema(tools, "required", parallel=True)


@pytest.mark.parametrize("tools, mode, field", [
    (TOOLS, "get_date", "tool_choice.function.name: "),
    (TOOLS, {"type": "function", "function": {"name": "get_date"}}, "tool_choice.function.name: "),
    (TOOLS, {"type": "function"}, "tool_choice: "),
    (TOOLS, {"type": "tool", "function": {"name": "get_time"}}, "tool_choice: "),
    ([], "required", "tools: must not be empty"),
])
def test_bad_tool_choice_names_the_field(tools: Any, mode: Any, field: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(field)):
        tools_json_schema(tools, mode, parallel=True)


def test_schema_compiles_and_constrains_in_xgrammar() -> None:
    """The schemas as the structured-output engine (xgrammar) reads them."""
    xgr = pytest.importorskip("xgrammar")
    accepts = getattr(pytest.importorskip("xgrammar.testing"), "_is_grammar_accept_string", None)
    if accepts is None:
        pytest.skip("this xgrammar has no string-acceptance helper")
    trip = {"name": "plan_trip", "arguments": {"stops": [{"city": "Paris"}]}}
    cases = [("required", True, [[W], [W, T]], [[], [{"name": "nope", "arguments": {}}]]),
             ("plan_trip", False, [[trip]], [[{"name": "plan_trip", "arguments": {"stops": [{"town": "x"}]}}]]),
             ("required", False, [[W], [T]], [[W, T]]),
             ("get_weather", True, [[W]], [[W, W], [T], [{"name": "get_weather", "arguments": {}}]])]
    for mode, parallel, good, bad in cases:
        g = xgr.Grammar.from_json_schema(json.dumps(tools_json_schema([*TOOLS, TRIP], mode, parallel)))
        assert all(accepts(g, json.dumps(v)) for v in good), (mode, parallel)
        assert not any(accepts(g, json.dumps(v)) for v in bad), (mode, parallel)


@pytest.mark.parametrize("args", ['{"s": "\\ud800"}', '{"a": 1e999}'])
def test_arguments_no_client_can_read_are_content(args):  # type: ignore[no-untyped-def]
    """Arguments the model wrote as JSON text that no strict UTF-8 JSON can carry (a lone surrogate,
    a number past a float's range, read as inf): the call is content (before, the surrogate made a 500
    on encoding and cut the stream; inf went out as `Infinity`, which is not JSON)."""
    text = f'{OPEN}{{"name": "f", "arguments": {args}}}{CLOSE}'
    r = hermes().extract(text)
    assert not r.calls and r.content == text
    good = hermes().extract(f'{OPEN}{{"name": "f", "arguments": {{"a": 1e300, "s": "\\u00e9"}}}}{CLOSE}')
    assert calls_of(good) == [("f", {"a": 1e300, "s": "é"})]


def test_llama3_stream_scans_a_run_of_whitespace_once(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A stream of whitespace deltas (a client can force one with logit_bias) before or after a call: each
    character is scanned once (the held text was rescanned from its start on every delta: 20,000 deltas
    took 23 s of the event loop, found by review). Counted in characters _skip_ws passes over."""
    from lmserve.server import tool_parsers as tp
    from lmserve.server.tool_parsers import ContentDelta, Llama3JsonToolParser
    scanned = [0]
    real = tp._skip_ws

    def counting(buf: str, i: int) -> int:
        j = real(buf, i)
        scanned[0] += j - i
        return j

    monkeypatch.setattr(tp, "_skip_ws", counting)
    n = 2000
    for opening in ("", '{"name": "f", "parameters": {}}'):
        s = Llama3JsonToolParser().streaming()
        if opening:
            s.feed(opening)
        scanned[0] = 0
        for _ in range(n):
            s.feed("\n")
        assert scanned[0] <= 2 * n, (opening, scanned[0])  # linear (quadratic: ~n * n / 2 = 2,000,000)
        deltas = s.feed('Then some text.') + s.finish()
        assert "".join(d.text for d in deltas if isinstance(d, ContentDelta)).strip() == "Then some text."
