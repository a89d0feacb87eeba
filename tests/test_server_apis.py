"""OpenAI's Responses API and Anthropic's Messages API on the server, driven by the official `openai`
and `anthropic` clients and raw HTTP: both are chat completions underneath (same template, same
sampling, same tool-call reading), so their prompts are counted against /tokenize of the chat messages
they stand for."""

from __future__ import annotations

import json

import httpx
import pytest

import tests.test_server as base
from tests.test_server import KEY, assert_idle, good_request_works, post

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
jsonschema = pytest.importorskip("jsonschema")

server, client = base.server, base.client  # the server (module scope, the default model) and an openai client

MODEL = "smollm2-135m"
QUESTION = "What is 2+2? Answer with one number."
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                   "unit": {"enum": ["c", "f"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
WEATHER_FN = {"type": "function", "name": "get_weather", "description": "Weather for a city",
              "parameters": WEATHER_SCHEMA}  # Responses form
GREEDY = {"temperature": 0}  # this anthropic SDK no longer has sampling arguments; the API still takes them
WEATHER_TOOL = {"name": "get_weather", "description": "Weather for a city", "input_schema": WEATHER_SCHEMA}  # Anthropic


@pytest.fixture
def claude(server):  # type: ignore[no-untyped-def]
    return anthropic.Anthropic(base_url=server["url"], api_key=KEY, max_retries=0, timeout=120)


def prompt_tokens(server, messages: list[dict]) -> int:  # type: ignore[no-untyped-def]
    """The token count of chat messages through the chat template, per /tokenize."""
    r = post(server, "/tokenize", {"messages": messages})
    assert r.status_code == 200, r.text
    return r.json()["count"]


def sse_events(server, path: str, body: dict) -> list[tuple[str, dict]]:  # type: ignore[no-untyped-def]
    """(event name, data) of a streamed response, read raw."""
    out, name = [], None
    with httpx.stream("POST", server["url"] + path, json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == name, (name, data)  # every event is named by its type
                out.append((name, data))
    return out


# ---------------------------------------------------------------- Responses API (openai client)

def test_responses_plain_and_streamed(client, server):  # type: ignore[no-untyped-def]
    kw = dict(model=MODEL, input=QUESTION, instructions="Be brief.", max_output_tokens=24, temperature=0)
    r = client.responses.create(**kw)
    assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed", r
    assert [o.type for o in r.output] == ["message"] and r.output[0].role == "assistant"
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
    plain = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=24, temperature=0)
    assert r.output_text == plain.choices[0].message.content and r.output[0].content[0].type == "output_text"
    n = prompt_tokens(server, chat)
    assert r.usage.input_tokens == n and r.usage.total_tokens == n + r.usage.output_tokens > n

    events = list(client.responses.create(stream=True, **kw))
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    final = events[-1].response
    assert final.output_text == r.output_text and final.usage.output_tokens == r.usage.output_tokens
    assert final.id == events[0].response.id and events[0].response.status == "in_progress"

    with client.responses.stream(**kw) as s:  # the SDK's helper accumulates the events
        deltas = [e.delta for e in s if e.type == "response.output_text.delta"]
        assert "".join(deltas) == s.get_final_response().output_text == r.output_text

    cut = client.responses.create(**{**kw, "max_output_tokens": 2})
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 2 and cut.output[0].status == "incomplete"
    events = list(client.responses.create(stream=True, **{**kw, "max_output_tokens": 2}))
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == cut.output_text
    assert_idle(server)


def test_responses_input_items_are_the_chat_messages(client, server):  # type: ignore[no-untyped-def]
    """A list of items (text parts, a developer message, an earlier assistant turn) is rendered as the
    chat messages it stands for: same prompt length as /tokenize of them."""
    items = [{"role": "developer", "content": "Answer in French."},
             {"role": "user", "content": [{"type": "input_text", "text": "Hello"}, {"type": "input_text", "text": "!"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Bonjour !"}]},
             {"role": "user", "content": "How are you?"}]
    chat = [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hello\n!"},  # parts: lines
            {"role": "assistant", "content": "Bonjour !"}, {"role": "user", "content": "How are you?"}]
    # the prompt's blocks cached first, so that both requests below take the same engine path (a prefix
    # hit, the rest as kernel rows): a cold prefill's logits differ from a hit's by up to ~0.1 on this
    # quantized model, and its first token is a near-tie (0.07 apart)
    client.chat.completions.create(model=MODEL, messages=chat, max_tokens=1, temperature=0)
    r = client.responses.create(model=MODEL, input=items, max_output_tokens=3, temperature=0)
    assert r.usage.input_tokens == prompt_tokens(server, chat)
    plain = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=3, temperature=0)
    assert r.output_text == plain.choices[0].message.content  # the same engine path, greedy


def test_responses_json_schema_format(client, server):  # type: ignore[no-untyped-def]
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "capital": {"type": "boolean"}},
              "required": ["city", "capital"], "additionalProperties": False}
    kw = dict(model=MODEL, input="Paris as JSON.", max_output_tokens=40, temperature=0,
              text={"format": {"type": "json_schema", "name": "city", "schema": schema}})
    r = client.responses.create(**kw)
    assert r.status == "completed", r
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"
    streamed = list(client.responses.create(stream=True, **kw))
    assert streamed[-1].response.output_text == r.output_text
    r = client.responses.create(model=MODEL, input="Any JSON object.", max_output_tokens=8, temperature=0,
                                text={"format": {"type": "json_object"}})
    assert r.output_text.startswith("{")
    assert_idle(server)


def test_responses_forced_function_call_round_trip(client, server):  # type: ignore[no-untyped-def]
    """tool_choice required / a named function: the output is one function_call item whose arguments obey
    the parameters, streamed as the same item; then the call and its output go back in as items."""
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    for choice in ("required", {"type": "function", "name": "get_weather"}):
        kw = dict(model=MODEL, input=question, tools=[WEATHER_FN], tool_choice=choice, parallel_tool_calls=False,
                  max_output_tokens=60, temperature=0)
        r = client.responses.create(**kw)
        assert r.status == "completed" and [o.type for o in r.output] == ["function_call"] and r.output_text == ""
        call = r.output[0]
        assert call.call_id.startswith("call_") and call.id.startswith("fc_") and call.name == "get_weather"
        args = json.loads(call.arguments)
        jsonschema.validate(args, WEATHER_SCHEMA)
        events = list(client.responses.create(stream=True, **kw))
        added = [e.item for e in events if e.type == "response.output_item.added"]
        assert [i.type for i in added] == ["function_call"] and added[0].name == "get_weather"
        streamed = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        done = next(e for e in events if e.type == "response.function_call_arguments.done")
        assert json.loads(streamed) == json.loads(done.arguments) == args
        assert events[-1].type == "response.completed" and events[-1].response.output[0].arguments == done.arguments

    follow = question + [o.model_dump(exclude_none=True) for o in r.output] + [
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"}]
    again = client.responses.create(model=MODEL, input=follow, tools=[WEATHER_FN], max_output_tokens=8,
                                    temperature=0)
    assert again.status in ("completed", "incomplete") and again.output[0].type == "message"
    chat = question + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": "get_weather", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "18 C, sunny"}]
    assert again.usage.input_tokens == prompt_tokens(server, chat)
    assert_idle(server)


# ---------------------------------------------------------------- Messages API (anthropic client)

def test_messages_plain_and_streamed(claude, server):  # type: ignore[no-untyped-def]
    kw = dict(model=MODEL, max_tokens=24, extra_body=GREEDY, messages=[{"role": "user", "content": QUESTION}])
    m = claude.messages.create(**kw)
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert [b.type for b in m.content] == ["text"] and "4" in m.content[0].text
    assert m.stop_reason == "end_turn" and m.stop_sequence is None
    assert m.usage.input_tokens == prompt_tokens(server, kw["messages"]) and m.usage.output_tokens > 0

    with claude.messages.stream(**kw) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == m.content[0].text and final.content[0].text == m.content[0].text
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == m.usage.output_tokens
    events = list(claude.messages.create(stream=True, **kw))
    types = [e.type for e in events]
    assert types[:2] == ["message_start", "content_block_start"] and types[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == m.content[0].text
    assert events[0].message.usage.input_tokens == m.usage.input_tokens
    raw = [name for name, _ in sse_events(server, "/v1/messages", {**kw, "stream": True})]
    assert raw[:2] == ["message_start", "ping"] and raw[-1] == "message_stop"  # the ping the SDK skips

    top1 = claude.messages.create(**{**kw, "extra_body": {"temperature": 1.0, "top_k": 1}})
    assert top1.content[0].text == m.content[0].text  # top_k 1 is greedy
    cut = claude.messages.create(**{**kw, "max_tokens": 2})
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 2
    assert_idle(server)


def test_messages_system_prompt_and_count_tokens(claude, server):  # type: ignore[no-untyped-def]
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Name a "}, {"type": "text", "text": "colour."}]}]
    system = [{"type": "text", "text": "You answer in one word."}]
    m = claude.messages.create(model=MODEL, max_tokens=4, extra_body=GREEDY, system=system, messages=msgs)
    # text blocks join with newlines, as the chat route joins text parts (vLLM's rule; they joined with nothing)
    chat = [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Name a \ncolour."}]
    n = prompt_tokens(server, chat)
    assert m.usage.input_tokens == n
    plain = post(server, "/v1/chat/completions", {"messages": chat, "max_tokens": 4, "temperature": 0}).json()
    assert m.content[0].text == plain["choices"][0]["message"]["content"]  # the same engine path, greedy
    assert claude.messages.count_tokens(model=MODEL, system=system, messages=msgs).input_tokens == n
    without = claude.messages.count_tokens(model=MODEL, messages=msgs).input_tokens
    assert without == prompt_tokens(server, chat[1:]) != n  # the template's default system prompt instead
    # x-api-key, as Anthropic's API takes the key
    r = httpx.post(server["url"] + "/v1/messages/count_tokens", json={"model": MODEL, "messages": msgs},
                   headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"})
    assert r.status_code == 200 and r.json() == {"input_tokens": without}


def test_messages_stop_sequences(claude, server):  # type: ignore[no-untyped-def]
    kw = dict(model=MODEL, max_tokens=16, extra_body=GREEDY, messages=[{"role": "user", "content": "Count from 1 to 9."}])
    free = claude.messages.create(**kw).content[0].text
    stop = next(w for w in ("3", "4", "5") if free.find(w) > 0)
    m = claude.messages.create(stop_sequences=[stop, "zzz"], **kw)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == free[:free.index(stop)]  # the same greedy text, cut before the stop
    with claude.messages.stream(stop_sequences=[stop, "zzz"], **kw) as s:
        final = s.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop
    assert final.content[0].text == m.content[0].text


def test_messages_forced_tool_round_trip(claude, server):  # type: ignore[no-untyped-def]
    """tool_choice {type: tool} / any: one tool_use block whose input matches the input_schema, streamed the
    same; then the tool_use and a tool_result go back in, rendered as the chat messages they stand for."""
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    for choice in ({"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
                   {"type": "any", "disable_parallel_tool_use": True}):
        kw = dict(model=MODEL, max_tokens=60, extra_body=GREEDY, messages=question, tools=[WEATHER_TOOL],
                  tool_choice=choice)
        m = claude.messages.create(**kw)
        assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["tool_use"], m
        use = m.content[0]
        assert use.id.startswith("toolu_") and use.name == "get_weather"
        jsonschema.validate(use.input, WEATHER_SCHEMA)
        with claude.messages.stream(**kw) as s:
            final = s.get_final_message()
        assert final.stop_reason == "tool_use" and final.content[0].input == use.input
        assert final.content[0].name == "get_weather" and final.content[0].id.startswith("toolu_")
    follow = question + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                       "content": [{"type": "text", "text": "18 C, sunny"}]}]}]
    again = claude.messages.create(model=MODEL, max_tokens=6, extra_body=GREEDY, messages=follow, tools=[WEATHER_TOOL])
    assert again.stop_reason in ("end_turn", "max_tokens", "tool_use")
    chat = question + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": use.id, "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "18 C, sunny"}]
    assert again.usage.input_tokens == prompt_tokens(server, chat)
    counted = claude.messages.count_tokens(model=MODEL, messages=follow, tools=[WEATHER_TOOL])
    assert counted.input_tokens == again.usage.input_tokens
    assert_idle(server)


# ---------------------------------------------------------------- auto tool choice (the model's parser)
STEERED = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
           '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')
TIME_SCHEMA = {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}


@pytest.fixture
def steered(monkeypatch):  # type: ignore[no-untyped-def]
    """The tiny model made to write STEERED (Hermes' <tool_call> tags) by a grammar set on the chat request
    each API's request becomes, which neither API can ask for itself."""
    from lmserve.server import anthropic_api, responses_api
    from lmserve.server.protocol import StructuredOutputsBody

    for cls in (responses_api.ResponsesRequest, anthropic_api.MessagesRequest):
        def to_chat(self, original=cls.to_chat):  # type: ignore[no-untyped-def]
            chat = original(self)
            chat.structured_outputs = StructuredOutputsBody(grammar="root ::= " + json.dumps(STEERED))
            return chat
        monkeypatch.setattr(cls, "to_chat", to_chat)


def test_auto_tool_calls_in_both_apis(client, claude, server, steered):  # type: ignore[no-untyped-def]
    """tool_choice auto (the default with tools): the output is read by the server's tool-call parser, as
    for chat; content and calls come back as a message and function_call items / text and tool_use blocks,
    the same whole and streamed."""
    q = "Weather and time in Paris?"
    kw = dict(model=MODEL, input=q, max_output_tokens=200, temperature=0,
              tools=[WEATHER_FN, {"type": "function", "name": "get_time", "parameters": TIME_SCHEMA}])
    r = client.responses.create(**kw)
    assert [o.type for o in r.output] == ["message", "function_call", "function_call"] and r.status == "completed"
    assert r.output_text.strip() == "Let me check."
    calls = [(o.name, json.loads(o.arguments)) for o in r.output[1:]]
    assert calls == [("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {"zone": "CET"})]
    events = list(client.responses.create(stream=True, **kw))
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.type for i in done] == ["message", "function_call", "function_call"]
    assert [(i.name, json.loads(i.arguments)) for i in done[1:]] == calls
    assert events[-1].response.output_text == r.output_text
    assert len({i.call_id for i in done[1:]}) == 2

    tools = [WEATHER_TOOL, {"name": "get_time", "input_schema": TIME_SCHEMA}]
    m = claude.messages.create(model=MODEL, max_tokens=200, extra_body=GREEDY, tools=tools,
                               messages=[{"role": "user", "content": q}])
    assert [b.type for b in m.content] == ["text", "tool_use", "tool_use"] and m.stop_reason == "tool_use"
    assert m.content[0].text.strip() == "Let me check." and [(b.name, b.input) for b in m.content[1:]] == calls
    with claude.messages.stream(model=MODEL, max_tokens=200, extra_body=GREEDY, tools=tools,
                                messages=[{"role": "user", "content": q}]) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["text", "tool_use", "tool_use"] and final.stop_reason == "tool_use"
    assert final.content[0].text == m.content[0].text and [(b.name, b.input) for b in final.content[1:]] == calls
    # tool_choice none: the same text is plain text
    m = claude.messages.create(model=MODEL, max_tokens=200, extra_body=GREEDY, tools=tools,
                               tool_choice={"type": "none"}, messages=[{"role": "user", "content": q}])
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == STEERED and m.stop_reason == "end_turn"
    assert_idle(server)


def test_a_cut_response_marks_only_its_last_item_incomplete(client, server, steered):  # type: ignore[no-untyped-def]
    """Cut by max_output_tokens after a whole call: the whole response marked every item incomplete, the
    finished call too, where the stream (and OpenAI) mark only the item that was cut; and its usage lacked
    input_tokens_details.cache_write_tokens, which the SDK's Response model requires."""
    from openai.types.responses import Response
    kw = dict(model=MODEL, input="Weather and time in Paris?", temperature=0,
              tools=[WEATHER_FN, {"type": "function", "name": "get_time", "parameters": TIME_SCHEMA}])
    whole = client.responses.with_raw_response.create(max_output_tokens=200, **kw).http_response.json()
    Response.model_validate(whole)  # every field the SDK requires
    t = whole["usage"]["output_tokens"]
    seen = set()
    for n in sorted({t - 1, t - 4, (2 * t) // 3, t // 2}):
        r = client.responses.create(max_output_tokens=n, **kw)
        got = [(o.type, o.status) for o in r.output]
        assert r.status == "incomplete" and all(st == "completed" for _, st in got[:-1]) and \
            got[-1][1] == "incomplete", (n, got)
        events = list(client.responses.create(stream=True, max_output_tokens=n, **kw))
        assert [(e.item.type, e.item.status) for e in events if e.type == "response.output_item.done"] == got, n
        seen.add(len(got))
    assert max(seen) >= 2  # some cut came after a whole item
    assert_idle(server)


def test_whole_responses_keep_the_models_order(client, claude, server, steered, monkeypatch):  # type: ignore[no-untyped-def]
    """Text after a call: the whole response lists the call, then the text, as the stream sends them (the
    whole response put one text item first, whatever the order); parallel calls off keeps the first call."""
    import sys
    q = "Weather and time in Paris?"
    tools_r = [WEATHER_FN, {"type": "function", "name": "get_time", "parameters": TIME_SCHEMA}]
    tools_m = [WEATHER_TOOL, {"name": "get_time", "input_schema": TIME_SCHEMA}]
    r = client.responses.create(model=MODEL, input=q, max_output_tokens=200, temperature=0, tools=tools_r,
                                parallel_tool_calls=False)
    assert [o.type for o in r.output] == ["message", "function_call"] and r.output[1].name == "get_weather"
    m = claude.messages.create(model=MODEL, max_tokens=200, extra_body=GREEDY, tools=tools_m,
                               tool_choice={"type": "auto", "disable_parallel_tool_use": True},
                               messages=[{"role": "user", "content": q}])
    assert [(b.type, getattr(b, "name", None)) for b in m.content] == [("text", None), ("tool_use", "get_weather")]
    monkeypatch.setattr(sys.modules[__name__], "STEERED", '<tool_call>\n{"name": "get_time", "arguments": '
                        '{"zone": "CET"}}\n</tool_call>\nDone, it is sunny.')
    kw = dict(model=MODEL, input=q, max_output_tokens=200, temperature=0, tools=tools_r)
    r = client.responses.create(**kw)
    assert [o.type for o in r.output] == ["function_call", "message"] and r.output_text == "\nDone, it is sunny."
    done = [e.item for e in client.responses.create(stream=True, **kw) if e.type == "response.output_item.done"]
    assert [i.type for i in done] == [o.type for o in r.output]
    m = claude.messages.create(model=MODEL, max_tokens=200, extra_body=GREEDY, tools=tools_m,
                               messages=[{"role": "user", "content": q}])
    assert [b.type for b in m.content] == ["tool_use", "text"] and m.stop_reason == "tool_use"
    with claude.messages.stream(model=MODEL, max_tokens=200, extra_body=GREEDY, tools=tools_m,
                                messages=[{"role": "user", "content": q}]) as s:
        assert [b.type for b in s.get_final_message().content] == ["tool_use", "text"]
    assert_idle(server)


# ---------------------------------------------------------------- bad input, in each API's own error shape

RESPONSES_BAD = [
    ({"input": "hi", "store": True}, "store"),
    ({"input": "hi", "previous_response_id": "resp_123"}, "previous_response_id"),
    ({}, "input"),
    ({"input": []}, "input"),
    ({"input": 5}, "input"),
    ({"input": [{"role": "wizard", "content": "hi"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type"),
    ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]}, "input[0].call_id"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {"type": "array"}}]},
     "tools[0].parameters"),
    ({"input": "hi", "tools": [{"type": "function", "name": "bad name!"}]}, "tools[0].name"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "hi", "tools": [WEATHER_FN], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"input": "hi", "tool_choice": "sometimes"}, "tool_choice"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "wibble"}}}},
     "text.format.schema"),
    ({"input": "hi", "max_output_tokens": 9000}, "max_output_tokens"),
    ({"input": "hi", "temperature": -1}, "temperature"),
]


@pytest.mark.parametrize("body,param", RESPONSES_BAD)
def test_responses_bad_input(server, client, body, param):  # type: ignore[no-untyped-def]
    r = post(server, "/v1/responses", {"model": MODEL, "max_output_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert (err["param"] or "").startswith(param) or err["message"].startswith(param + ":"), err
    good_request_works(client)


def test_responses_refusals_through_the_sdk(client, server):  # type: ignore[no-untyped-def]
    with pytest.raises(openai.BadRequestError, match="stateless"):
        client.responses.create(model=MODEL, input="hi", store=True)
    r = post(server, "/v1/responses", None, raw=b'{"input": "hi", "max_output_tokens": 2, "top_p": NaN}')
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_p"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="gpt-9", input="hi")
    assert_idle(server)


MESSAGES_BAD = [
    ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"max_tokens": 4, "messages": [{"role": "wizard", "content": "hi"}]}, "messages.role"),
    ({"max_tokens": 4, "messages": []}, "messages"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": ""}]}, "messages.content"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure"}]},
     "messages"),
    ({"max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"max_tokens": 9000, "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages[0].content[0].type"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}]}]}, "messages[0].content[0].tool_use_id"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
      "tools": [{"name": "f", "input_schema": {"type": "array"}}]}, "tools[0].input_schema"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "tools": [{"name": "f"}]},
     "tools[0].input_schema"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
      "tools": [{"name": "bad name!", "input_schema": {"type": "object"}}]}, "tools[0].name"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER_TOOL],
      "tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER_TOOL],
      "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": "any"}},
     "tool_choice"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER_TOOL, {"name": "g",
      "input_schema": {"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}],
      "tool_choice": {"type": "any"}}, "tools[1].input_schema"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "stop_sequences": ["x"] * 40},
     "stop_sequences"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "top_p": 2}, "top_p"),
]


@pytest.mark.parametrize("body,param", MESSAGES_BAD)
def test_messages_bad_input(server, client, body, param):  # type: ignore[no-untyped-def]
    r = httpx.post(server["url"] + "/v1/messages", json={"model": MODEL, **body}, headers={"x-api-key": KEY})
    assert r.status_code == 400, r.text
    data = r.json()
    assert data["type"] == "error" and data["error"]["type"] == "invalid_request_error", data
    assert data["error"]["message"].startswith(param + ":") or data["error"]["message"].startswith(param + "."), data
    good_request_works(client)


def test_messages_errors_statuses_and_auth(claude, server, client):  # type: ignore[no-untyped-def]
    url, msgs = server["url"] + "/v1/messages", [{"role": "user", "content": "hi"}]
    for headers in ({}, {"x-api-key": "wrong"}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(url, json={"model": MODEL, "max_tokens": 2, "messages": msgs}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", r.text
    r = httpx.post(url, json={"model": "claude-9", "max_tokens": 2, "messages": msgs}, headers={"x-api-key": KEY})
    assert r.status_code == 404 and r.json() == {"type": "error", "error": {"type": "not_found_error",
                                                                           "message": r.json()["error"]["message"]}}
    r = httpx.post(url, json={"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "x" * 70000}]},
                   headers={"x-api-key": KEY})
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    r = httpx.post(url, content=b'{"model": "smollm2-135m", "max_tokens": 2, "temperature": NaN, '
                            b'"messages": [{"role": "user", "content": "hi"}]}',
                   headers={"x-api-key": KEY, "Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("temperature")
    r = httpx.post(server["url"] + "/v1/messages/count_tokens", json={"model": MODEL}, headers={"x-api-key": KEY})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("messages")
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        claude.messages.create(model=MODEL, max_tokens=9000, messages=msgs)
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server["url"], api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=2, messages=msgs)
    # x-api-key is Anthropic's header: the OpenAI routes still want a bearer token
    r = httpx.post(server["url"] + "/v1/completions", json={"prompt": "hi"}, headers={"x-api-key": KEY})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    good_request_works(client)
    assert_idle(server)


def test_engine_failure_in_each_shape(server, client, monkeypatch):  # type: ignore[no-untyped-def]
    """A request that fails inside the engine: a 500 in each API's shape, or its stream's failure event;
    the server goes on, every block free."""
    out = server["engine"].output
    original = out._text

    def flaky(seq, new):  # type: ignore[no-untyped-def]
        if seq.params.max_tokens == 13:  # the marked requests
            raise RuntimeError("boom")
        return original(seq, new)

    monkeypatch.setattr(out, "_text", flaky)
    msgs = [{"role": "user", "content": "hi"}]
    r = httpx.post(server["url"] + "/v1/messages", json={"model": MODEL, "max_tokens": 13, "messages": msgs},
                   headers={"x-api-key": KEY}, timeout=120)
    assert r.status_code == 500 and r.json()["error"]["type"] == "api_error" and "boom" in r.json()["error"]["message"]
    events = sse_events(server, "/v1/messages", {"model": MODEL, "max_tokens": 13, "messages": msgs, "stream": True})
    assert events[0][0] == "message_start" and events[-1][0] == "error" and "boom" in events[-1][1]["error"]["message"]
    r = post(server, "/v1/responses", {"input": "hi", "max_output_tokens": 13})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    events = sse_events(server, "/v1/responses", {"input": "hi", "max_output_tokens": 13, "stream": True})
    assert events[-1][0] == "response.failed" and "boom" in events[-1][1]["response"]["error"]["message"]
    assert events[-1][1]["response"]["status"] == "failed"
    monkeypatch.undo()
    good_request_works(client)
    assert_idle(server)


def test_cache_salt_on_every_route(server, client):  # type: ignore[no-untyped-def]
    """vLLM's cache_salt body field, on every route that runs a prompt: a salted prompt hits no block an
    unsalted one cached, the same salt hits; the output does not change; an empty salt is a 400 naming it."""
    eng = server["engine"]
    text = "Salted prefixes: " + " ".join(f"word{i}" for i in range(40))
    msgs = [{"role": "user", "content": text}]
    bodies = {"/v1/completions": {"prompt": text, "max_tokens": 3, "temperature": 0},
              "/v1/chat/completions": {"messages": msgs, "max_tokens": 3, "temperature": 0},
              "/v1/responses": {"input": text, "max_output_tokens": 3, "temperature": 0},
              "/v1/messages": {"model": MODEL, "messages": msgs, "max_tokens": 3, "temperature": 0},
              "/v1/embeddings": {"input": text + " (embedded)"}}

    def hits(path: str, body: dict) -> tuple[int, str]:  # type: ignore[no-untyped-def]
        before = eng.stats().prefix_hit_tokens
        r = post(server, path, body)
        assert r.status_code == 200, r.text
        return eng.stats().prefix_hit_tokens - before, json.dumps(r.json().get("choices") or r.json().get("content")
                                                                 or r.json().get("output") or r.json()["data"][0])
    for path, body in bodies.items():
        plain = hits(path, body)
        salted = [hits(path, {**body, "cache_salt": path + s}) for s in ("one", "one", "two")]  # (chat-based routes
        # render the same prompt: a salt of one route's would be a legitimate hit on the next's)
        assert salted[0][0] == 0 and salted[2][0] == 0 and salted[1][0] > 0, (path, plain, salted)
        if path == "/v1/embeddings":  # (a prefix-cache hit moves the quantized model's states a little: see
            vecs = [json.loads(t)["embedding"] for t in (plain[1], *(t for _, t in salted))]  # docs/architecture.md)
            assert all(sum(a * b for a, b in zip(vecs[0], v)) > 0.999 for v in vecs), path
        elif path != "/v1/responses":  # (its response carries ids and times)
            assert len({plain[1], *(t for _, t in salted)}) == 1, path
        r = post(server, path, {**body, "cache_salt": ""})
        assert r.status_code == 400, (path, r.text)
    r = post(server, "/v1/chat/completions", {"messages": msgs, "cache_salt": ""})
    assert r.json()["error"]["param"] == "cache_salt"
    assert_idle(server)


def test_null_is_the_default_on_responses_and_messages(server):  # type: ignore[no-untyped-def]
    """OpenAI documents Responses' stream and parallel_tool_calls (and chat's parallel_tool_calls) as
    "boolean or null"; vLLM takes Messages' stream as null too: null is the default's answer (it was a
    400). A json_object or text format is echoed without json_schema's name (it carried "response")."""
    body = {"model": MODEL, "input": QUESTION, "max_output_tokens": 4, **GREEDY}
    want = post(server, "/v1/responses", body).json()["output"]
    got = post(server, "/v1/responses", {**body, "stream": None, "parallel_tool_calls": None})
    assert got.status_code == 200 and got.json()["output"][0]["content"] == want[0]["content"], got.text
    msg = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": QUESTION}], **GREEDY}
    got = post(server, "/v1/messages", {**msg, "stream": None})
    assert got.status_code == 200 and got.json()["content"] == post(server, "/v1/messages", msg).json()["content"]
    chat = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 4, **GREEDY}
    assert post(server, "/v1/chat/completions", {**chat, "parallel_tool_calls": None}).status_code == 200
    for kind in ("text", "json_object"):
        r = post(server, "/v1/responses", {**body, "text": {"format": {"type": kind}}})
        assert r.status_code == 200 and r.json()["text"]["format"] == {"type": kind}, r.text
    schema = {"type": "json_schema", "schema": {"type": "object"}}
    assert post(server, "/v1/responses", {**body, "text": {"format": schema}}).json()["text"]["format"]["name"] == "response"


def test_messages_structured_output(claude, server):  # type: ignore[no-untyped-def]
    """Anthropic's structured outputs (output_config.format json_schema): the answer is JSON under the schema,
    whole and streamed, and the SDK's messages.parse reads it into the model (before, the field was ignored
    and the answer was free text); a schema that is no schema is a 400 naming it."""
    pydantic = pytest.importorskip("pydantic")
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "population": {"type": "integer"}},
              "required": ["city", "population"], "additionalProperties": False}
    msgs = [{"role": "user", "content": "Name a large city and its population."}]
    m = claude.messages.create(model=MODEL, max_tokens=60, messages=msgs, extra_body=GREEDY,
                               output_config={"format": {"type": "json_schema", "schema": schema}})
    data = json.loads(m.content[0].text)
    jsonschema.validate(data, schema)
    with claude.messages.stream(model=MODEL, max_tokens=60, messages=msgs, extra_body=GREEDY,
                                output_config={"format": {"type": "json_schema", "schema": schema}}) as s:
        jsonschema.validate(json.loads(s.get_final_message().content[0].text), schema)  # (a prefix-cache hit's
        # float rounding differs from the first run's: the texts may differ, never the schema)

    class City(pydantic.BaseModel):
        city: str
        population: int
    parsed = claude.messages.parse(model=MODEL, max_tokens=60, messages=msgs, extra_body=GREEDY, output_format=City)
    assert isinstance(parsed.parsed_output, City)
    bad = post(server, "/v1/messages", {"model": MODEL, "max_tokens": 5, "messages": msgs,
                                        "output_config": {"format": {"type": "json_schema", "schema": {"type": 7}}}})
    assert bad.status_code == 400 and bad.json()["error"]["message"].startswith("output_config.format.schema"), bad.text


def test_responses_logprobs(client, server):  # type: ignore[no-untyped-def]
    """include ["message.output_text.logprobs"] with top_logprobs: the output_text's tokens with their
    log-probabilities, as chat completions gives them for the same conversation (they were always []),
    whole and streamed (each delta its own tokens', the done event all of them); with tools a 400."""
    body = {"model": MODEL, "input": QUESTION, "max_output_tokens": 6, **GREEDY,
            "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    client.responses.create(**body)  # (the prompt into the prefix cache: the calls below run alike from it)
    r = client.responses.create(**body)
    lps = r.output[0].content[0].logprobs
    chat = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 6,
                                                  **GREEDY, "logprobs": True, "top_logprobs": 2}).json()
    want = chat["choices"][0]["logprobs"]["content"]
    assert [x.token for x in lps] == [x["token"] for x in want] and len(lps) == r.usage.output_tokens
    assert [x.logprob for x in lps] == pytest.approx([x["logprob"] for x in want], abs=1e-4)
    assert all(len(x.top_logprobs) == 2 and x.top_logprobs[0].logprob >= x.top_logprobs[1].logprob for x in lps)
    assert "".join(x.token for x in lps).startswith(r.output_text)
    events = sse_events(server, "/v1/responses", {**body, "stream": True})
    deltas = [x for name, data in events if name == "response.output_text.delta" for x in data["logprobs"]]
    done = next(data for name, data in events if name == "response.output_text.done")["logprobs"]
    assert [x["token"] for x in done] == [x.token for x in lps] and deltas == done[:len(deltas)] and deltas
    assert not client.responses.create(**{**body, "include": None, "top_logprobs": None}).output[0].content[0].logprobs
    bad = post(server, "/v1/responses", {**body, "tools": [WEATHER_FN]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "include", bad.text
