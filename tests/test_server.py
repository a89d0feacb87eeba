"""The OpenAI-compatible server, driven by the official `openai` client and raw HTTP, on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import threading
import time
from collections import deque

import httpx
import pytest

from tests.conftest import FailOnCall

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

KEY = "test-key-123"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc=None, verify=True) -> None:  # type: ignore[no-untyped-def]
    """Until url's /health answers 200 (a minute at most; at once an AssertionError if proc exited);
    verify: httpx's (an https URL's certificate file)."""
    for _ in range(600):
        try:
            if httpx.get(url + "/health", timeout=1, verify=verify).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc is not None and proc.poll() is not None:
            break
        time.sleep(0.1)
    raise AssertionError(f"{url} did not come up")


@contextlib.contextmanager
def serving(app):  # type: ignore[no-untyped-def]
    """The app under uvicorn on a free loopback port, in a thread: (base url, the uvicorn Server)."""
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    for _ in range(200):
        if srv.started:
            break
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", srv
    finally:
        srv.should_exit = True
        th.join(30)


@pytest.fixture(scope="module")
def server(smol_default):  # type: ignore[no-untyped-def]
    from lmserve.server.app import build_app
    from lmserve.server.async_engine import AsyncEngine
    ae = AsyncEngine(smol_default.engine, max_queue=64)
    app = build_app(ae, "smollm2-135m", api_key=KEY, max_body_bytes=64 * 1024)
    with serving(app) as (url, _):
        yield {"url": url, "ae": ae, "engine": smol_default.engine, "llm": smol_default, "srv": app.state.server}


@pytest.fixture
def client(server):  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=server["url"] + "/v1", api_key=KEY, max_retries=0, timeout=120)


def post(server, path: str, body: object, headers: dict | None = None, raw: bytes | None = None) -> httpx.Response:  # type: ignore[no-untyped-def]
    h = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json", **(headers or {})}
    return httpx.post(server["url"] + path, content=raw if raw is not None else json.dumps(body), headers=h,
                      timeout=120)


def assert_idle(server) -> None:  # type: ignore[no-untyped-def]
    """No running requests and every KV block free, per /metrics."""
    for _ in range(100):
        text = httpx.get(server["url"] + "/metrics").text
        vals = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                if line and not line.startswith("#")}
        if vals["lmserve_num_requests_running"] == 0 and vals["lmserve_kv_blocks_used"] == 0 \
                and vals["lmserve_num_requests_waiting"] == 0:
            assert vals["lmserve_kv_blocks_free"] == vals["lmserve_kv_blocks_total"]
            return
        time.sleep(0.1)
    raise AssertionError(f"server not idle: {vals}")


def good_request_works(client) -> None:  # type: ignore[no-untyped-def]
    r = client.completions.create(model="smollm2-135m", prompt="The capital of France is", max_tokens=4,
                                  temperature=0)
    assert r.choices[0].text and r.usage.completion_tokens == 4


# ---------------------------------------------------------------- happy paths

def test_completion_plain_and_usage(client, server):  # type: ignore[no-untyped-def]
    r = client.completions.create(model="smollm2-135m", prompt="The capital of France is", max_tokens=8, temperature=0)
    ref = server["engine"].tokenizer
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(ref.encode("The capital of France is"))
    assert r.usage.completion_tokens == 8 and r.usage.total_tokens == r.usage.prompt_tokens + 8


def test_completion_stream_equals_plain(client):  # type: ignore[no-untyped-def]
    kw = dict(model="smollm2-135m", prompt="Once upon a time", max_tokens=24, temperature=0.9, seed=5)
    plain = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == plain
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24


def test_a_stream_of_line_separators_parses_line_by_line(server):  # type: ignore[no-untyped-def]
    """U+2028 / U+2029 / U+0085 are legal raw in JSON, but readers built on str.splitlines (httpx's
    iter_lines, and so many Python SSE clients) split a line there: a stream carrying them broke such a
    client mid-event (found by `bench serve`). They go out escaped, so each data line parses alone."""
    body = {"model": "smollm2-135m", "prompt": "Hello", "max_tokens": 8, "temperature": 0, "stream": True,
            "logit_bias": {"321": 100, "118": 100}}  # the two byte tokens of U+2028
    text = ""
    with httpx.stream("POST", server["url"] + "/v1/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    assert text == "\u2028" * 4


def test_chat_plain_and_stream(client):  # type: ignore[no-untyped-def]
    msgs = [{"role": "user", "content": "What is 2+2? Answer with one number."}]
    plain = client.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=16, temperature=0)
    assert "4" in plain.choices[0].message.content and plain.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model="smollm2-135m", messages=msgs, max_completion_tokens=16,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens


def test_n_and_seed(client):  # type: ignore[no-untyped-def]
    kw = dict(model="smollm2-135m", prompt="My favourite colour is", max_tokens=10, temperature=1.0, seed=42)
    a = client.completions.create(n=3, **kw)
    b = client.completions.create(n=3, **kw)
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # same seed, same texts
    assert a.usage.completion_tokens == 30


def test_a_streamed_choice_that_ends_first_finishes_once(client):  # type: ignore[no-untyped-def]
    """n = 3 streamed: a choice that ended before its siblings was sent again (a finish chunk, and with
    forced tools the whole call under a new id) on every step until the last one ended. Each choice
    finishes once now, with the text the response has."""
    from collections import Counter
    kw = dict(model="smollm2-135m", n=3, max_tokens=30, temperature=1.0, seed=1)
    comp = dict(prompt="Q: name a color.\nA:", stop=["\n", "."], **kw)
    chat = dict(messages=[{"role": "user", "content": "Name a color, one word."}], **kw)
    for api, body in ((client.completions, comp), (client.chat.completions, chat)):
        api.create(**body)  # the prompt in the prefix cache: the runs below read it alike
        plain = api.create(**body)
        chunks = list(api.create(stream=True, **body))
        ends = Counter(c.index for ch in chunks for c in ch.choices if c.finish_reason)
        assert ends == {0: 1, 1: 1, 2: 1}, ends
        texts = [c.text if api is client.completions else c.message.content for c in plain.choices]
        assert len(set(map(len, texts))) > 1  # the choices end at different steps
        for c in plain.choices:
            got = "".join((x.text if api is client.completions else x.delta.content or "")
                          for ch in chunks for x in ch.choices if x.index == c.index)
            assert got == (c.text if api is client.completions else c.message.content)


def test_chat_streamed_logprobs_cover_every_token(client):  # type: ignore[no-untyped-def]
    """Tokens whose text was held back (behind a stop string's look-behind, or part of a character) lost
    their logprobs in a chat stream: 16 of 20 entries sent. Every token's entry goes out now."""
    kw = dict(model="smollm2-135m", messages=[{"role": "user", "content": "Say something nice."}], max_tokens=20,
              temperature=0, logprobs=True, top_logprobs=2, stop=["Z" * 20])
    client.chat.completions.create(**kw)  # the prompt in the prefix cache: the runs below read it alike
    plain = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    streamed = [e for ch in chunks for c in ch.choices if c.logprobs for e in c.logprobs.content]
    assert len(streamed) == plain.usage.completion_tokens == len(plain.choices[0].logprobs.content)
    assert [e.token for e in streamed] == [e.token for e in plain.choices[0].logprobs.content]


def finished_requests(server) -> float:  # type: ignore[no-untyped-def]
    """lmserve_requests_total over every finish reason, per /metrics."""
    text = httpx.get(server["url"] + "/metrics").text
    return sum(float(line.split()[1]) for line in text.splitlines() if line.startswith("lmserve_requests_total{"))


def test_metrics_count_each_request_once(client, server):  # type: ignore[no-untyped-def]
    """An n=4 request is one finished request, not four (plain or streamed); each prompt of a batch is one."""
    kw = dict(model="smollm2-135m", max_tokens=3, temperature=1.0, seed=3, n=4)
    before = finished_requests(server)
    assert len(client.completions.create(prompt="Once", **kw).choices) == 4
    assert finished_requests(server) == before + 1
    assert len(list(client.completions.create(prompt="Once", stream=True, **kw))) > 0
    assert finished_requests(server) == before + 2
    assert len(client.completions.create(prompt=["Once", "Twice"], **kw).choices) == 8
    assert finished_requests(server) == before + 4


def test_metrics_under_vllms_names(client, server):  # type: ignore[no-untyped-def]
    """Each series VLLM_NAMES lists is also given under vLLM's name, with its model_name label (and
    finished_reason for finish_reason), equal to ours in the same scrape; the router's load reading
    takes a vLLM server's series (labelled, per engine) and does not count ours twice."""
    from prometheus_client.parser import text_string_to_metric_families

    from lmserve.router.health import parse_load
    from lmserve.server.metrics import VLLM_NAMES
    client.completions.create(model="smollm2-135m", prompt="Once", max_tokens=3)
    text = httpx.get(server["url"] + "/metrics").text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}
    checked = 0
    for (name, labels), value in samples.items():
        ours = next((k for k in VLLM_NAMES if name.startswith(k) and not name.endswith("_created")), None)
        if ours is None:
            continue
        for theirs in VLLM_NAMES[ours]:
            want = {("finished_reason" if k == "finish_reason" else k): v for k, v in labels}
            want["model_name"] = "smollm2-135m"
            assert samples[(theirs + name[len(ours):], tuple(sorted(want.items())))] == value, (name, theirs)
            checked += 1
    assert checked >= 40  # gauges, counters, four reasons, every bucket of four histograms
    assert samples[("vllm:generation_tokens_total", (("model_name", "smollm2-135m"),))] >= 3
    load = samples[("lmserve_num_requests_running", ())] + samples[("lmserve_num_requests_waiting", ())]
    assert parse_load(text) == load
    vllm = ('# TYPE vllm:num_requests_running gauge\n'
            'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
            'vllm:num_requests_running{engine="1",model_name="m"} 1.0\n'
            'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0\n'
            'vllm:num_requests_waiting{engine="1",model_name="m"} 0.0\n'
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5\n')
    assert parse_load(vllm) == 6


def test_vllms_request_and_step_histograms(client, server):  # type: ignore[no-untyped-def]
    """vLLM's series that dashboards read (they were missing): inter-token latency (one a sequence a step
    after its first; under its older name too), tokens a step, and per request its prompt / generated /
    longest-choice tokens, n, max_tokens and the prefill / decode / inference phases. Checked against a
    known workload: one n=2 request of 5 tokens each, one streamed request of 4."""
    from prometheus_client.parser import text_string_to_metric_families

    def scrape() -> dict[str, float]:
        text = httpx.get(server["url"] + "/metrics").text
        return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                if s.name.startswith("vllm:") and s.name.endswith(("_count", "_sum"))}
    before = scrape()
    a = client.completions.create(model="smollm2-135m", prompt="Once upon a time", max_tokens=5, n=2, temperature=1.0,
                                  seed=1, extra_body={"ignore_eos": True})
    b = list(client.completions.create(model="smollm2-135m", prompt="Hello", max_tokens=4, stream=True, temperature=0,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    after = scrape()
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    prompt_tokens = a.usage.prompt_tokens + b[-1].usage.prompt_tokens
    for name in ("request_prompt_tokens", "request_generation_tokens", "request_max_num_generation_tokens",
                 "request_params_n", "request_params_max_tokens", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds"):
        assert d[f"vllm:{name}_count"] == 2, name
    assert d["vllm:request_prompt_tokens_sum"] == prompt_tokens
    assert d["vllm:request_generation_tokens_sum"] == 10 + 4 and d["vllm:request_max_num_generation_tokens_sum"] == 5 + 4
    assert d["vllm:request_params_n_sum"] == 3 and d["vllm:request_params_max_tokens_sum"] == 9
    assert 0 < d["vllm:request_decode_time_seconds_sum"] < d["vllm:request_inference_time_seconds_sum"]
    assert d["vllm:inter_token_latency_seconds_count"] == 2 * 4 + 3 > 0 and d["vllm:inter_token_latency_seconds_sum"] > 0
    assert d["vllm:time_per_output_token_seconds_count"] == d["vllm:inter_token_latency_seconds_count"]
    assert d["vllm:iteration_tokens_total_count"] >= 5 and d["vllm:iteration_tokens_total_sum"] >= prompt_tokens + 11


def test_beam_search_and_best_of(client, server):  # type: ignore[no-untyped-def]
    kw = dict(model="smollm2-135m", prompt="The three primary colours are", max_tokens=8, n=2)
    beam = client.completions.create(extra_body={"use_beam_search": True}, best_of=3, temperature=0, **kw)
    again = client.completions.create(extra_body={"use_beam_search": True}, best_of=3, temperature=0, **kw)
    assert len(beam.choices) == 2 and beam.usage.completion_tokens > 0
    assert [c.text for c in beam.choices] == [c.text for c in again.choices]  # deterministic
    assert beam.choices[0].text != beam.choices[1].text  # two different beams
    best = client.completions.create(best_of=3, temperature=1.0, seed=4, **kw)
    assert len(best.choices) == 2
    r = post(server, "/v1/completions", {"prompt": "hi", "use_beam_search": True, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "use_beam_search"
    assert_idle(server)


def test_logprobs_and_echo(client, server):  # type: ignore[no-untyped-def]
    r = client.completions.create(model="smollm2-135m", prompt="The sky is", max_tokens=3, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 3 and len(lp.token_logprobs) == 3
    assert all(x <= 0 for x in lp.token_logprobs) and all(len(t) == 2 for t in lp.top_logprobs)
    ids = [504, 7042, 314, 1345]
    e = client.completions.create(model="smollm2-135m", prompt=ids, max_tokens=1, temperature=0, echo=True,
                                  logprobs=1)
    elp = e.choices[0].logprobs
    assert elp.token_logprobs[0] is None and len(elp.tokens) == len(ids) + 1
    tok = server["engine"].tokenizer
    assert e.choices[0].text.startswith(tok.decode(ids, skip_special_tokens=False))
    # prompt logprobs equal the model's own log-softmax at those positions
    full = server["llm"].score(ids).double().log_softmax(-1)
    for i in range(1, len(ids)):
        assert abs(elp.token_logprobs[i] - full[i - 1, ids[i]].item()) < 1e-3
    # scoring mode: max_tokens=0 with echo returns the prompt only
    s = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0}).json()
    assert len(s["choices"][0]["logprobs"]["tokens"]) == len(ids) and s["usage"]["completion_tokens"] == 0
    c = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
    assert len(c.choices[0].logprobs.content) == 3 and len(c.choices[0].logprobs.content[0].top_logprobs) == 2


def test_legacy_top_logprobs_hold_the_chosen_token(server):  # type: ignore[no-untyped-def]
    """OpenAI: the sampled token's logprob is always returned (up to logprobs + 1 entries), as vLLM
    does; the prompt's tokens under echo too. Before, a sampled or prompt token outside the top N was
    missing from its entry, and logprobs 0 gave {}."""
    body = {"model": "smollm2-135m", "prompt": "The sky is green and the grass is", "max_tokens": 8,
            "temperature": 1.5, "seed": 5, "logprobs": 1, "echo": True}
    lp = post(server, "/v1/completions", body).json()["choices"][0]["logprobs"]
    rows = [(t, v, top) for t, v, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]) if top is not None]
    assert len(rows) == len(lp["tokens"]) - 1
    assert all(t in top and 1 <= len(top) <= 2 and top[t] == v for t, v, top in rows)
    assert sum(len(top) == 2 for _, _, top in rows) >= 3  # chosen tokens outside the top 1 occurred
    zero = post(server, "/v1/completions", {**body, "logprobs": 0, "echo": False}).json()["choices"][0]["logprobs"]
    assert zero["top_logprobs"] == [{t: v} for t, v in zip(zero["tokens"], zero["token_logprobs"])]


def sse_events(server, path: str, body: dict) -> list[dict]:  # type: ignore[type-arg]
    """The JSON events of a streamed response."""
    with httpx.stream("POST", server["url"] + path, json=body, timeout=120,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_prompt_logprobs(server):  # type: ignore[no-untyped-def]
    """vLLM's prompt_logprobs: per prompt token (the first: null) its logprob, rank and text, and the
    top k by token id, against the model's own log-softmax in float64; on chat beside the choices; with
    echo and logprobs the echoed prompt keeps logprobs' number of alternatives; refused when streamed."""
    ids = [504, 7042, 314, 1345, 6777, 28]
    tok = server["engine"].tokenizer
    full = server["llm"].score(ids).double().log_softmax(-1)  # (T, V)
    body = {"model": "smollm2-135m", "prompt": ids, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 3,
            "echo": True, "logprobs": 1}
    r = post(server, "/v1/completions", body).json()
    plp = r["choices"][0]["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for i in range(1, len(ids)):
        row, tid, got = full[i - 1], ids[i], plp[i]
        mine = got[str(tid)]
        assert abs(mine["logprob"] - row[tid].item()) < 1e-3 and mine["decoded_token"] == tok.decode([tid])
        assert int((row > row[tid] + 1e-3).sum()) + 1 <= mine["rank"] <= int((row > row[tid] - 1e-3).sum()) + 1
        top = sorted((v for v in got.values() if v["rank"] <= 3), key=lambda v: v["rank"])
        assert [v["rank"] for v in top] == [1, 2, 3] and len(got) == (3 if mine["rank"] <= 3 else 4)
        ref = row.topk(3).values  # (3,)
        assert all(abs(v["logprob"] - ref[v["rank"] - 1].item()) < 1e-3 for v in top)
        assert all(abs(v["logprob"] - row[int(k)].item()) < 1e-3 for k, v in got.items())
    echo_tops = r["choices"][0]["logprobs"]["top_logprobs"]
    assert echo_tops[0] is None and all(1 <= len(t) <= 2 for t in echo_tops[1:])  # logprobs 1 (+ the chosen)
    c = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                                              "prompt_logprobs": 0}).json()
    assert len(c["prompt_logprobs"]) == c["usage"]["prompt_tokens"] and c["prompt_logprobs"][0] is None
    assert all(len(row) == 1 for row in c["prompt_logprobs"][1:])  # k = 0: the prompt's token alone
    for bad in ({**body, "stream": True}, {**body, "prompt_logprobs": -1}, {**body, "prompt_logprobs": 21}):
        e = post(server, "/v1/completions", bad)
        assert e.status_code == 400 and e.json()["error"]["param"] == "prompt_logprobs", e.text
    assert_idle(server)


def test_allowed_token_ids_and_bad_words(server):  # type: ignore[no-untyped-def]
    """vLLM's allowed_token_ids and bad_words reach the sampler from both routes; ids outside the
    vocabulary and more bad words than --max-stop are 400s naming the field."""
    tok = server["engine"].tokenizer
    allowed = tok.encode(" yes no", add_special_tokens=False)
    r = post(server, "/v1/completions", {"prompt": "Is the sky blue?", "max_tokens": 6, "temperature": 1.0,
                                         "seed": 3, "allowed_token_ids": allowed, "return_token_ids": True}).json()
    assert r["choices"][0]["token_ids"] and set(r["choices"][0]["token_ids"]) <= set(allowed)
    body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    free = post(server, "/v1/completions", body).json()["choices"][0]["text"]
    assert "Paris" in free
    banned = post(server, "/v1/completions", {**body, "bad_words": ["Paris"]}).json()["choices"][0]["text"]
    assert "Paris" not in banned
    chat = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Capital of France?"}],
                                                 "max_tokens": 12, "temperature": 0, "bad_words": ["Paris"]}).json()
    assert "Paris" not in chat["choices"][0]["message"]["content"]
    for bad, field in (({"allowed_token_ids": [10 ** 7]}, "allowed_token_ids"),
                       ({"allowed_token_ids": []}, "allowed_token_ids"),
                       ({"bad_words": ["x"] * 17}, "bad_words"), ({"bad_words": [""]}, "bad_words"),
                       ({"bad_words": ["\ud800"]}, "bad_words")):
        e = post(server, "/v1/completions", {**body, **bad})
        assert e.status_code == 400 and e.json()["error"]["param"] == field, e.text
    assert_idle(server)


def test_return_token_ids(server):  # type: ignore[no-untyped-def]
    """vLLM's return_token_ids: the prompt's ids and each choice's generated ids, whole and streamed (a
    stream's token_ids add up to the response's, held-back text included: a stop string holds text)."""
    tok = server["engine"].tokenizer
    body = {"model": "smollm2-135m", "prompt": "Count: 1, 2, 3,", "max_tokens": 12, "temperature": 0,
            "return_token_ids": True, "stop": [" 6"]}
    r = post(server, "/v1/completions", body).json()["choices"][0]
    assert r["prompt_token_ids"] == tok.encode("Count: 1, 2, 3,") and r["finish_reason"] == "stop"
    assert tok.decode(r["token_ids"]).startswith(r["text"]) and len(r["token_ids"]) >= 2
    # (streamed: a stream's ids are its own text's; its greedy tokens may differ from the first request's,
    # whose prompt it finds in the prefix cache: the default quantized path rounds by chunking)
    events = sse_events(server, "/v1/completions", {**body, "stream": True})
    assert events[0]["choices"][0]["prompt_token_ids"] == r["prompt_token_ids"]
    streamed = [t for e in events for c in e["choices"] for t in c["token_ids"]]
    assert tok.decode(streamed).startswith("".join(c["text"] for e in events for c in e["choices"]))
    assert len(streamed) >= 2 and events[-1]["choices"][0]["finish_reason"] == "stop"
    msgs = [{"role": "user", "content": "Name three colors."}]
    chat = {"messages": msgs, "max_tokens": 10, "temperature": 0, "return_token_ids": True}
    whole = post(server, "/v1/chat/completions", chat).json()
    ids = whole["choices"][0]["token_ids"]
    assert len(whole["prompt_token_ids"]) == whole["usage"]["prompt_tokens"] and len(ids) == 10
    assert tok.decode(ids, skip_special_tokens=True) == whole["choices"][0]["message"]["content"]
    events = sse_events(server, "/v1/chat/completions", {**chat, "stream": True})
    assert events[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    streamed = [t for e in events for c in e["choices"] for t in c.get("token_ids", [])]
    assert len(streamed) == 10 and tok.decode(streamed, skip_special_tokens=True) == "".join(
        c["delta"].get("content", "") for e in events for c in e["choices"])
    plain = post(server, "/v1/completions", {k: v for k, v in body.items() if k != "return_token_ids"}).json()
    assert "token_ids" not in plain["choices"][0] and "prompt_logprobs" not in plain["choices"][0]


def test_truncate_prompt_tokens(server):  # type: ignore[no-untyped-def]
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens run (usage, prompt_token_ids, echo and the
    greedy text are those of the last k ids sent as the prompt: 6 tokens, less than a KV block, so neither
    request finds the other in the prefix cache); chat truncates the templated conversation; 0 and more
    than the context are 400s naming the field."""
    tok = server["engine"].tokenizer
    text = "The quick brown fox jumps over the lazy dog, and then the dog"
    ids = tok.encode(text)
    body = {"model": "smollm2-135m", "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    cut = post(server, "/v1/completions", {**body, "prompt": text, "truncate_prompt_tokens": 6, "echo": True}).json()
    alone = post(server, "/v1/completions", {**body, "prompt": ids[-6:]}).json()
    c = cut["choices"][0]
    assert len(ids) > 12 and cut["usage"]["prompt_tokens"] == 6 and c["prompt_token_ids"] == ids[-6:]
    assert c["token_ids"] == alone["choices"][0]["token_ids"]
    assert c["text"] == tok.decode(ids[-6:], skip_special_tokens=False) + alone["choices"][0]["text"]
    whole = post(server, "/v1/completions", {**body, "prompt": text, "truncate_prompt_tokens": 100, "echo": True}).json()
    assert whole["choices"][0]["prompt_token_ids"] == ids  # a prompt shorter than k is left whole, its text echoed
    assert whole["choices"][0]["text"].startswith(text)
    chat = {**body, "messages": [{"role": "user", "content": text}]}
    full = post(server, "/v1/chat/completions", chat).json()["prompt_token_ids"]
    r = post(server, "/v1/chat/completions", {**chat, "truncate_prompt_tokens": 9}).json()
    assert r["usage"]["prompt_tokens"] == 9 and r["prompt_token_ids"] == full[-9:]
    events = sse_events(server, "/v1/chat/completions", {**chat, "truncate_prompt_tokens": 9, "stream": True})
    assert events[0]["prompt_token_ids"] == full[-9:]
    for k in (0, -2, 10 ** 6):
        err = post(server, "/v1/completions", {**body, "prompt": text, "truncate_prompt_tokens": k})
        assert err.status_code == 400 and "truncate_prompt_tokens" in err.json()["error"]["message"], err.text
    assert_idle(server)


def test_chat_echo_returns_the_assistants_prefill(server):  # type: ignore[no-untyped-def]
    """vLLM's chat echo: with the conversation's last message the assistant's (a prefill continued with
    continue_final_message), the reply's content is that message and then what was generated, whole and
    streamed; after a user's message, or without echo, the content is what was generated alone."""
    prefill = [{"role": "user", "content": "Write the word hello."}, {"role": "assistant", "content": "Sure, the word is"}]
    body = {"messages": prefill, "max_tokens": 4, "temperature": 0, "add_generation_prompt": False,
            "continue_final_message": True}
    plain = post(server, "/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
    echoed = post(server, "/v1/chat/completions", {**body, "echo": True}).json()["choices"][0]["message"]["content"]
    assert echoed == "Sure, the word is" + plain and plain
    events = sse_events(server, "/v1/chat/completions", {**body, "echo": True, "stream": True})
    assert "".join(c["delta"].get("content") or "" for e in events for c in e["choices"]) == echoed
    user = {"messages": prefill[:1], "max_tokens": 4, "temperature": 0}
    alone = post(server, "/v1/chat/completions", user).json()["choices"][0]["message"]["content"]
    assert post(server, "/v1/chat/completions", {**user, "echo": True}).json()["choices"][0]["message"]["content"] == alone


def test_stop_and_token_id_prompts(client):  # type: ignore[no-untyped-def]
    free = client.completions.create(model="smollm2-135m", prompt="Count: 1, 2, 3,", max_tokens=12, temperature=0)
    words = free.choices[0].text.split(",")
    stop = words[1] + ","
    r = client.completions.create(model="smollm2-135m", prompt="Count: 1, 2, 3,", max_tokens=12, temperature=0,
                                  stop=[stop])
    assert r.choices[0].finish_reason == "stop" and stop not in r.choices[0].text
    batch = client.completions.create(model="smollm2-135m", prompt=[[504, 7042], [504, 2988, 314]], max_tokens=2,
                                      temperature=0)
    assert len(batch.choices) == 2 and batch.usage.prompt_tokens == 5


def test_tokenize_detokenize_models_health(server):  # type: ignore[no-untyped-def]
    t = post(server, "/tokenize", {"prompt": "Hello world"}).json()
    assert t["count"] == len(t["tokens"]) > 0 and t["token_strs"] is None
    assert post(server, "/detokenize", {"tokens": t["tokens"]}).json()["prompt"] == "Hello world"
    assert post(server, "/detokenize", {"tokens": [10**7]}).status_code == 400
    # vLLM's return_token_strs: the vocabulary's strings (byte-level: a space is G-dot); it was dropped
    t = post(server, "/tokenize", {"prompt": "Hello world", "return_token_strs": True}).json()
    assert t["token_strs"] == ["Hello", "\u0120world"] and len(t["tokens"]) == 2, t
    assert post(server, "/tokenize", {"prompt": "Hi", "return_token_strs": "yes"}).status_code == 400
    assert post(server, "/tokenize", {"prompt": "Hi", "return_token_strs": None}).status_code == 200  # vLLM's None
    # messages: add_special_tokens taken (it was dropped), False by default as vLLM's; a request's own
    # chat_template refused by a server that does not trust them (it was dropped, the model's used)
    msgs = [{"role": "user", "content": "hi"}]
    tok = server["llm"].tokenizer
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tok, "add_bos", True)  # (a model whose tokenizer adds a BOS the template does not write:
        mp.setattr(tok, "bos_token_id", 2)  # SmolLM2's adds none)
        plain = post(server, "/tokenize", {"messages": msgs}).json()["tokens"]
        assert plain[0] != tok.bos_token_id
        assert post(server, "/tokenize", {"messages": msgs, "add_special_tokens": True}).json()["tokens"] == \
            [tok.bos_token_id, *plain]
    r = post(server, "/tokenize", {"messages": msgs, "chat_template": "X{{ messages[0].content }}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text
    m = httpx.get(server["url"] + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()
    card = m["data"][0]
    assert card["id"] == "smollm2-135m" and card["parent"] is None and card["root"]  # vLLM's ModelCard
    assert card["permission"][0]["object"] == "model_permission" and card["permission"][0]["allow_sampling"] is True
    assert httpx.get(server["url"] + "/health").status_code == 200  # open without a key


def test_ping_and_version_are_open(server):  # type: ignore[no-untyped-def]
    """vLLM's /ping (GET and POST: SageMaker's probe) answers as /health does; /version names ours."""
    import pathlib
    import tomllib

    import lmserve
    with open(pathlib.Path(__file__).parent.parent / "pyproject.toml", "rb") as f:
        assert lmserve.__version__ == tomllib.load(f)["project"]["version"]
    assert httpx.get(server["url"] + "/ping").status_code == 200
    assert httpx.post(server["url"] + "/ping").status_code == 200
    assert httpx.get(server["url"] + "/version").json() == {"version": lmserve.__version__}
    doc = httpx.get(server["url"] + "/openapi.json").json()
    ids = [op["operationId"] for item in doc["paths"].values() for op in item.values()]
    assert set(doc["paths"]["/ping"]) == {"get", "post"} and len(ids) == len(set(ids))  # one id each


def test_cors_only_for_the_origins_named(server):  # type: ignore[no-untyped-def]
    """No CORS headers by default; with allowed origins, a browser's preflight to a /v1 route is answered
    (before the API key's 401, which a preflight cannot carry) and the answers name the origin, an error
    included; another origin gets none."""
    from lmserve.server.app import build_app
    from lmserve.server.cors import Cors
    origin = {"Origin": "https://app.example"}
    r = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 1}, headers=origin)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    app = build_app(server["ae"], "smollm2-135m", api_key=KEY, manage_engine=False,
                    cors=Cors(allowed_origins=("https://app.example",)))
    with serving(app) as (url, _):
        pre = httpx.options(url + "/v1/chat/completions", headers={
            **origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "https://app.example"
        ok = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1},
                        headers={**origin, "Authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://app.example"
        denied = httpx.post(url + "/v1/completions", json={"prompt": "Hi"}, headers=origin)
        assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == "https://app.example"
        other = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1},
                           headers={"Origin": "https://evil.example", "Authorization": f"Bearer {KEY}"})
        assert "access-control-allow-origin" not in other.headers


def test_cors_flags():  # type: ignore[no-untyped-def]
    """--allowed-origins repeated or as vLLM's JSON list; a bad list names its flag; the replicas of
    --data-parallel get no CORS flags (the front answers for CORS), --allow-credentials takes no value."""
    import argparse

    from lmserve.router.cli import replica_argv
    from lmserve.server.cors import add_cors_args, cors_from_args
    p = argparse.ArgumentParser()
    add_cors_args(p)
    c = cors_from_args(p.parse_args(["--allowed-origins", '["https://a.example", "https://b.example"]',
                                     "--allowed-origins", "https://c.example", "--allow-credentials"]))
    assert c.allowed_origins == ("https://a.example", "https://b.example", "https://c.example")
    assert c.allow_credentials and c.allowed_methods == ("*",)
    with pytest.raises(ValueError, match="allowed_origins"):
        cors_from_args(p.parse_args(["--allowed-origins", '["https://a.example", 3]']))
    assert replica_argv(["--allowed-origins", "*", "--allow-credentials", "--model", "m",
                         "--allowed-headers=x"]) == ["--model", "m"]


# ---------------------------------------------------------------- auth

def test_auth(server):  # type: ignore[no-untyped-def]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(server["url"] + "/v1/completions", json={"prompt": "hi"}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(server["url"] + "/v1/models").status_code == 401


def test_the_key_gates_every_route_but_the_probes(server):  # type: ignore[no-untyped-def]
    """Every route of the API document, /v1 or not (/score, /rerank and /tokenize run the model or its
    template: vLLM leaves them open), is a 401 without the key, none of them runs; the probes, metrics,
    documents and the console's page answer without it."""
    doc = httpx.get(server["url"] + "/openapi.json").json()
    gated = [(path, method) for path, item in doc["paths"].items() for method in item]
    assert {("/score", "post"), ("/rerank", "post"), ("/tokenize", "post"), ("/v1/embeddings", "post")} <= set(gated)
    before = server["engine"].stats().computed_tokens
    for path, method in gated:
        r = httpx.request(method.upper(), server["url"] + path, json={"query": "a", "documents": ["b"],
                                                                    "text_1": "a", "text_2": "b", "prompt": "hi"})
        if path in ("/health", "/ping", "/version", "/metrics"):
            assert r.status_code == 200, (path, method)
        else:
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", (path, method, r.text)
    assert server["engine"].stats().computed_tokens == before  # nothing ran
    for path in ("/docs", "/openapi.json"):
        assert httpx.get(server["url"] + path).status_code == 200, path
    for path in ("/", "/web/app.js"):  # the console's page and files (a 404 here: this app serves no console)
        assert httpx.get(server["url"] + path).status_code == 404, path
    assert httpx.get(server["url"] + "/nowhere").status_code == 401  # (an unknown route: no route listing)
    assert post(server, "/rerank", {"query": "a", "documents": ["b"]}).status_code == 200  # with the key


def test_sagemaker_invocations_route_by_body(server):  # type: ignore[no-untyped-def]
    """POST /invocations (SageMaker's route, as vLLM serves it) answers a body as the route its shape names
    answers it: chat, completions (streamed too), embeddings, score, rerank, each equal to the route's own
    answer; a body of no API is a 400 naming them; no key, a 401."""
    chat = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 6, "temperature": 0}
    comp = {"prompt": "The sky is", "max_tokens": 5, "temperature": 0}
    for body, path in ((chat, "/v1/chat/completions"), (comp, "/v1/completions")):
        post(server, path, body)  # its prompt's blocks cached: both answers below are prefix hits (a cold
        # prefill's logits differ from a hit's by up to ~0.1 on this quantized model: a near-tie may flip)
        want, got = post(server, path, body).json(), post(server, "/invocations", body).json()
        assert got["object"] == want["object"] and got["choices"] == want["choices"], (path, got)
    streamed = post(server, "/invocations", {**comp, "stream": True})
    assert streamed.headers["content-type"].startswith("text/event-stream")
    text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in streamed.text.splitlines()
                   if line.startswith("data: {"))
    assert text == post(server, "/v1/completions", comp).json()["choices"][0]["text"]
    emb = {"input": ["a red car", "the blue sea"]}
    want = post(server, "/v1/embeddings", emb).json()["data"]
    got = post(server, "/invocations", emb).json()["data"]
    assert len(got) == len(want) == 2
    for g, w in zip(got, want):
        assert g["embedding"] == pytest.approx(w["embedding"], abs=1e-5)
    score = {"text_1": "a red car", "text_2": ["a red car", "the sea"]}
    assert [d["score"] for d in post(server, "/invocations", score).json()["data"]] == pytest.approx(
        [d["score"] for d in post(server, "/score", score).json()["data"]], abs=1e-5)
    rerank = {"query": "a red car", "documents": ["the sea", "a red truck"]}
    ranked = [post(server, p, rerank).json()["results"] for p in ("/invocations", "/rerank")]
    assert [r["index"] for r in ranked[0]] == [r["index"] for r in ranked[1]]
    assert [r["relevance_score"] for r in ranked[0]] == pytest.approx([r["relevance_score"] for r in ranked[1]], abs=1e-5)
    bad = post(server, "/invocations", {"max_tokens": 3})
    assert bad.status_code == 400 and "'messages' (/v1/chat/completions)" in bad.json()["error"]["message"]
    bad = post(server, "/invocations", {"prompt": "hi", "max_tokens": "four"})  # the chosen route's own check
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    assert post(server, "/invocations", None, raw=b"{oops").status_code == 400
    assert httpx.post(server["url"] + "/invocations", json=comp).status_code == 401
    assert_idle(server)


def test_continuous_usage_is_each_choices_own(server):  # type: ignore[no-untyped-def]
    """vLLM's continuous_usage_stats: only with include_usage (it was on alone); each chunk's usage counts
    its own choice's tokens so far (it summed every choice); each choice's role chunk is its own chunk
    (they shared one) and carries usage with 0 completion tokens."""
    body = {"messages": [{"role": "user", "content": "Count to twenty."}], "max_tokens": 8, "n": 2,
            "temperature": 1.0, "seed": 3, "ignore_eos": True, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = [json.loads(line[6:]) for line in post(server, "/v1/chat/completions", body).text.splitlines()
              if line.startswith("data: {")]
    heads = [c for c in chunks if c["choices"] and "role" in c["choices"][0]["delta"]]
    assert [[ch["index"] for ch in c["choices"]] for c in heads] == [[0], [1]]
    prompt = heads[0]["usage"]["prompt_tokens"]
    assert prompt > 0 and all(c["usage"] == {"prompt_tokens": prompt, "completion_tokens": 0, "total_tokens": prompt}
                              for c in heads)
    seen = {0: 0, 1: 0}
    for c in chunks[2:-1]:
        (ch,) = c["choices"]
        seen[ch["index"]] += len(ch.get("token_ids") or [])
        assert c["usage"]["completion_tokens"] == seen[ch["index"]], c
    assert seen == {0: 8, 1: 8} and chunks[-1]["usage"]["completion_tokens"] == 16 and not chunks[-1]["choices"]
    alone = {**body, "stream_options": {"continuous_usage_stats": True}}  # without include_usage: no usage at all
    assert not any("usage" in json.loads(line[6:]) for line in
                   post(server, "/v1/chat/completions", alone).text.splitlines() if line.startswith("data: {"))


def test_null_is_the_default_where_openai_documents_null(server):  # type: ignore[no-untyped-def]
    """OpenAI documents n, presence_penalty, frequency_penalty, stream, chat's logprobs and completions'
    echo as nullable (vLLM reads null as the default): clients that send every key get the default's
    answer, not a 400 (before: 400 for each); a required field stays required."""
    chat = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 5, "temperature": 0}
    nulls = {"n": None, "presence_penalty": None, "frequency_penalty": None, "stream": None, "logprobs": None}
    got = post(server, "/v1/chat/completions", {**chat, **nulls})
    assert got.status_code == 200, got.text
    assert got.json()["choices"] == post(server, "/v1/chat/completions", chat).json()["choices"]
    comp = {"prompt": "The sky is", "max_tokens": 4, "temperature": 0}
    got = post(server, "/v1/completions", {**comp, **{k: None for k in ("n", "echo", "stream", "presence_penalty")}})
    assert got.status_code == 200 and got.json()["choices"] == post(server, "/v1/completions", comp).json()["choices"]
    bad = post(server, "/v1/chat/completions", {**chat, "messages": None})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
    bad = post(server, "/v1/chat/completions", {**chat, "n": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "n"


# ---------------------------------------------------------------- bad input

BAD = [
    ("/v1/completions", None, b"{not json", 400, None),
    ("/v1/completions", {"max_tokens": 4}, None, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "four"}, None, 400, "max_tokens"),
    ("/v1/completions", {"prompt": ""}, None, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, None, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, -3]}, None, 400, "prompt_token_ids"),
    ("/v1/completions", {"prompt": [1, 49152]}, None, 400, "prompt_token_ids"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 9000}, None, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "n": 100}, None, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 50}, None, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"999999": 5}}, None, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"abc": 5}}, None, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, None, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 2}, None, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "stop": ["x"] * 40}, None, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-9"}, None, 404, "model"),
    ("/v1/completions", {"prompt": "x" * 70000}, None, 413, None),
    ("/v1/chat/completions", {"messages": []}, None, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, None, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hello"}, None, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 99}, None, 400,
     "top_logprobs"),
    # a beam family that could never fit the KV pool at once (each beam alone would): refused up front
    ("/v1/completions", {"prompt": "hi", "use_beam_search": True, "n": 1, "best_of": 16, "max_tokens": 2000}, None,
     400, "best_of"),
    # non-finite numbers (Python's json reads the bare tokens NaN / Infinity)
    ("/v1/completions", None, b'{"prompt": "hi", "max_tokens": 2, "temperature": NaN}', 400, "temperature"),
    ("/v1/completions", None, b'{"prompt": "hi", "max_tokens": 2, "temperature": Infinity}', 400, "temperature"),
    ("/v1/completions", None, b'{"prompt": "hi", "max_tokens": 2, "temperature": 1e999}', 400, "temperature"),
    ("/v1/completions", None, b'{"prompt": "hi", "max_tokens": 2, "top_p": -Infinity}', 400, "top_p"),
    ("/v1/completions", None, b'{"prompt": "hi", "max_tokens": 2, "min_p": NaN}', 400, "min_p"),
    ("/v1/completions", None, b'{"prompt": "hi", "max_tokens": 2, "repetition_penalty": Infinity}', 400,
     "repetition_penalty"),
    ("/v1/completions", None, b'{"prompt": "hi", "max_tokens": 2, "presence_penalty": NaN}', 400,
     "presence_penalty"),
    ("/v1/completions", None, b'{"prompt": "hi", "max_tokens": 2, "length_penalty": NaN}', 400, "length_penalty"),
    ("/v1/completions", None, b'{"prompt": "hi", "max_tokens": 2, "logit_bias": {"5": Infinity}}', 400,
     "logit_bias"),
    ("/v1/chat/completions", None,
     b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": NaN}', 400, "temperature"),
    # stream_options only with stream: true
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stream_options": {"include_usage": True}}, None, 400,
     "stream_options"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": False,
                              "stream_options": {"include_usage": True}}, None, 400, "stream_options"),
    # chat top_logprobs only with logprobs: true
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "top_logprobs": 2},
     None, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": False,
                              "top_logprobs": 0}, None, 400, "top_logprobs"),
    # content is required but for assistant messages
    ("/v1/chat/completions", {"messages": [{"role": "user"}], "max_tokens": 2}, None, 400, "messages.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}], "max_tokens": 2}, None, 400,
     "messages.content"),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": None}, {"role": "user", "content": "hi"}],
                              "max_tokens": 2}, None, 400, "messages.content"),
    # output constraints: a schema, regex or grammar that does not compile, several at once, a malformed one
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "structured_outputs": {"regex": "[a-"}}, None, 400,
     "structured_outputs.regex"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "structured_outputs": {"grammar": "root ::= nothere"}},
     None, 400, "structured_outputs.grammar"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "structured_outputs": {"json": {"type": "wibble"}}}, None,
     400, "structured_outputs.json"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "structured_outputs": {"json": "{not json"}}, None, 400,
     "structured_outputs.json"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "structured_outputs": {"choice": []}}, None, 400,
     "structured_outputs.choice"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "structured_outputs": {"regex": "a", "choice": ["b"]}},
     None, 400, "structured_outputs"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "guided_regex": "a+", "guided_choice": ["b"]}, None, 400,
     "guided_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                              "response_format": {"type": "json_schema"}}, None, 400, "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                              "response_format": {"type": "xml"}}, None, 400, "response_format"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "structured_outputs": {"regex": "a" * 70000}}, None, 413,
     None),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "use_beam_search": True, "n": 2,
                         "structured_outputs": {"regex": "a+"}}, None, 400, "structured_outputs"),
    # (length + 1) ** 400 overflowed in the beam step: a 500 for every request in flight
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "use_beam_search": True, "n": 2, "length_penalty": 400},
     None, 400, "length_penalty"),
    # beam search ranks raw log-probs and reports none: refused, not silently dropped
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "use_beam_search": True, "n": 2, "logprobs": 1}, None, 400,
     "logprobs"),
    # unbounded inputs are bounded
    ("/v1/completions", {"prompt": ["hi"] * 257, "max_tokens": 1}, None, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "logit_bias": {str(i): 1 for i in range(1025)}}, None, 400,
     "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "stop_token_ids": list(range(65))}, None, 400,
     "stop_token_ids"),
    # 0 was read as "not given" (1.0): no penalty where the client asked for an impossible one
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "repetition_penalty": 0}, None, 400, "repetition_penalty"),
    # min_tokens past max_tokens was cut to max_tokens without a word (vLLM refuses it)
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "min_tokens": 5}, None, 400, "min_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 2,
                              "min_tokens": 3}, None, 400, "min_tokens"),
    ("/v1/completions", {"prompt": "hi", "min_tokens": 10 ** 6}, None, 400, "min_tokens"),  # past the context
]


@pytest.mark.parametrize("path,body,raw,status,param", BAD)
def test_bad_input(server, client, path, body, raw, status, param):  # type: ignore[no-untyped-def]
    r = post(server, path, body, raw=raw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param or (err["param"] or "").startswith(param), err
    good_request_works(client)


def test_assistant_message_may_omit_content(server):  # type: ignore[no-untyped-def]
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}
    msgs = [{"role": "user", "content": "What is the weather?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "user", "content": "Never mind."}]
    r = post(server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 2


@pytest.mark.parametrize("ctype", ["text/plain", "text/plain;charset=application/json", "application/jsonx",
                                   "multipart/form-data; boundary=application/json"])
def test_wrong_content_type(server, client, ctype):  # type: ignore[no-untyped-def]
    """The media type itself must be application/json (as vLLM checks it): a substring let
    text/plain;charset=application/json through, a type any web page may send cross-site unasked."""
    r = post(server, "/v1/completions", None, headers={"Content-Type": ctype}, raw=b'{"prompt": "hi"}')
    assert r.status_code == 415 and "error" in r.json()
    good_request_works(client)


def test_json_content_type_with_parameters_and_any_case(server):  # type: ignore[no-untyped-def]
    for ctype in ("application/json; charset=utf-8", "Application/JSON"):
        r = post(server, "/v1/completions", None, headers={"Content-Type": ctype},
                 raw=b'{"model": "smollm2-135m", "prompt": "hi", "max_tokens": 2, "seed": -1}')
        assert r.status_code == 200, (ctype, r.text)


def test_queue_full_gives_429(server, client, monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setattr(server["engine"].scheduler, "max_num_seqs", 1)
    monkeypatch.setattr(server["ae"], "max_queue", 1)

    async def go() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as c:
            h = {"Authorization": f"Bearer {KEY}"}

            async def until(cond) -> None:  # type: ignore[no-untyped-def]
                for _ in range(200):
                    if cond():
                        return
                    await asyncio.sleep(0.05)
                raise AssertionError("condition not reached")

            def send(i: int):  # type: ignore[no-untyped-def]
                return asyncio.ensure_future(c.post(server["url"] + "/v1/completions", headers=h,
                                                    json={"prompt": f"Story {i}:", "max_tokens": 40,
                                                          "ignore_eos": True}))
            first = send(0)
            await until(lambda: server["ae"].stats.num_running == 1)  # as the engine thread published it
            second = send(1)  # max_num_seqs=1: this one waits
            await until(lambda: server["ae"].num_waiting == 1)
            extra = await c.post(server["url"] + "/v1/completions", headers=h, json={"prompt": "hi", "max_tokens": 2})
            return [extra, await first, await second]

    extra, *long = asyncio.run(go())
    assert extra.status_code == 429 and extra.headers["Retry-After"] == "1"
    assert extra.json()["error"]["type"] == "rate_limit_error"
    assert all(r.status_code == 200 for r in long)
    monkeypatch.undo()
    good_request_works(client)


def test_a_burst_of_streams_past_the_queue_gets_429s(server, client, monkeypatch):  # type: ignore[no-untyped-def]
    """Streamed requests were queued only after their 200 and headers went out: a burst passed the queue
    check together, and those past max_queue got a 200 carrying a server_error event (the openai SDK
    does not retry that, where it retries a 429). They are queued before the headers now."""
    monkeypatch.setattr(server["engine"].scheduler, "max_num_seqs", 1)
    monkeypatch.setattr(server["ae"], "max_queue", 2)

    async def one(c: httpx.AsyncClient, i: int) -> tuple[int, bool]:
        body = {"prompt": f"Story {i}:", "max_tokens": 12, "ignore_eos": True, "stream": True}
        async with c.stream("POST", server["url"] + "/v1/completions", json=body,
                            headers={"Authorization": f"Bearer {KEY}"}) as r:
            text = (await r.aread()).decode()
        return r.status_code, '"error"' in text if r.status_code == 200 else r.json()["error"]["type"] == "rate_limit_error"

    async def burst() -> list[tuple[int, bool]]:
        async with httpx.AsyncClient(timeout=120) as c:
            return await asyncio.gather(*(one(c, i) for i in range(10)))

    got = asyncio.run(burst())
    assert {s for s, _ in got} == {200, 429}, got
    assert not any(err for s, err in got if s == 200)  # every stream that started ran to its end
    assert all(ok for s, ok in got if s == 429)
    monkeypatch.undo()
    assert_idle(server)
    good_request_works(client)


def test_exception_in_one_request_is_500_others_unharmed(server, client, monkeypatch):  # type: ignore[no-untyped-def]
    out = server["engine"].output  # the OutputProcessor: text and stop strings of each step's tokens
    original = out._text

    def flaky(seq, new):  # type: ignore[no-untyped-def]
        if seq.params.max_tokens == 13:  # the marked request
            raise RuntimeError("boom")
        return original(seq, new)

    monkeypatch.setattr(out, "_text", flaky)

    async def go() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as c:
            h = {"Authorization": f"Bearer {KEY}"}
            ok = asyncio.ensure_future(c.post(server["url"] + "/v1/completions", headers=h,
                                              json={"prompt": "The capital of France is", "max_tokens": 12,
                                                    "temperature": 0}))
            bad = asyncio.ensure_future(c.post(server["url"] + "/v1/completions", headers=h,
                                               json={"prompt": "EXPLODE now", "max_tokens": 13}))
            return await bad, await ok

    bad, ok = asyncio.run(go())
    assert bad.status_code == 500 and "boom" in bad.json()["error"]["message"]
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 12
    monkeypatch.undo()
    assert_idle(server)


def metric(server, name: str) -> float:  # type: ignore[no-untyped-def]
    """One sample of /metrics (a labelled counter not yet counted is absent: 0)."""
    lines = httpx.get(server["url"] + "/metrics").text.splitlines()
    return next((float(x.split()[1]) for x in lines if x.split() and x.split()[0] == name), 0.0)


def test_metrics_count_an_aborted_streams_tokens(server):  # type: ignore[no-untyped-def]
    """A stream the client leaves after a few chunks: its prompt and the tokens generated so far are in
    the token counters (they were counted only when a request finished: an aborted one added nothing)."""
    p0, g0 = metric(server, "lmserve_prompt_tokens_total"), metric(server, "lmserve_generation_tokens_total")
    body = {"prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    usage = None
    with httpx.stream("POST", server["url"] + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage") or usage
                if usage and usage["completion_tokens"] >= 10:
                    break
    assert_idle(server)
    assert usage is not None
    assert metric(server, "lmserve_prompt_tokens_total") - p0 == usage["prompt_tokens"]
    assert usage["completion_tokens"] <= metric(server, "lmserve_generation_tokens_total") - g0 < 2000


def test_a_request_failed_by_a_failed_step_counts_as_an_error(server, monkeypatch):  # type: ignore[no-untyped-def]
    """A step that raises fails the requests in it (a 500): /metrics counts each as finish_reason error
    (it counted nothing: the exception ended the request, not an output)."""
    eng = server["engine"]
    real = eng.step
    monkeypatch.setattr(eng, "step", FailOnCall(real, 2, RuntimeError("injected step failure")))
    name = 'lmserve_requests_total{finish_reason="error"}'
    before = metric(server, name)
    r = post(server, "/v1/completions", {"prompt": "Once", "max_tokens": 8, "ignore_eos": True})
    assert r.status_code == 500 and "injected step failure" in r.json()["error"]["message"]
    assert metric(server, name) == before + 1
    eng.step.calls = 0  # three prompts failed by the same step: three errors, as streamed (it counted one)
    r = post(server, "/v1/completions", {"prompt": ["Once", "Twice", "Thrice"], "max_tokens": 8, "ignore_eos": True})
    assert r.status_code == 500 and metric(server, name) == before + 4
    # streamed, an error event (the step loop's failure, or a failed forward's error choice) is followed
    # by [DONE] alone: no usage chunk after it (there was one)
    monkeypatch.undo()
    for obj, name_ in ((eng, "step"), (eng.runner, "execute")):
        monkeypatch.setattr(obj, name_, FailOnCall(getattr(obj, name_), 2, RuntimeError("injected step failure")))
        r = post(server, "/v1/completions", {"prompt": "Once", "max_tokens": 8, "ignore_eos": True, "stream": True,
                                             "stream_options": {"include_usage": True}})
        monkeypatch.undo()
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert "injected step failure" in json.loads(events[-2])["error"]["message"] and events[-1] == "[DONE]", events
        assert not any("usage" in json.loads(e) for e in events[:-1]), name_
    monkeypatch.setattr(eng, "step", real)
    assert_idle(server)


def test_an_exception_inside_the_engine_answers_json_and_keeps_the_connection(server, monkeypatch):  # type: ignore[no-untyped-def]
    """A request that fails with an exception outside an output (here building its RequestOutput) gets
    the JSON 500, and the client's keep-alive connection stays usable (the generic handler re-raised:
    uvicorn closed the socket, and the client's next request on it was reset)."""
    out = server["engine"].output
    real = out.make

    def make(rid, seqs, beam=None):  # type: ignore[no-untyped-def]
        if seqs[0].params.max_tokens == 13:
            raise RuntimeError("boom in make")
        return real(rid, seqs, beam)
    monkeypatch.setattr(out, "make", make)
    h = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=server["url"], headers=h, timeout=60) as c:
        for _ in range(2):
            r = c.post("/v1/completions", json={"prompt": "Once", "max_tokens": 13})
            assert r.status_code == 500 and "boom in make" in r.json()["error"]["message"]
            assert c.post("/v1/completions", json={"prompt": "Once", "max_tokens": 2}).status_code == 200
    monkeypatch.setattr(out, "make", real)
    assert_idle(server)


def test_arrival_is_stamped_when_the_server_queues_a_request(server, monkeypatch):  # type: ignore[no-untyped-def]
    """A request's arrival time (TTFT, queue time, e2e, max_waiting_time) is when the server queued it,
    not when the engine thread took it in after its current step (up to a whole step later: the
    latencies came out short by that much)."""
    eng = server["engine"]
    real, seen = eng.add_request, []

    def spy(rid, request, *a, arrival_time=None, **kw):  # type: ignore[no-untyped-def]
        seen.append((arrival_time, time.time()))
        return real(rid, request, *a, arrival_time=arrival_time, **kw)
    monkeypatch.setattr(eng, "add_request", spy)
    t0 = time.time()
    assert post(server, "/v1/completions", {"prompt": "Once", "max_tokens": 2}).status_code == 200
    (arrived, taken_in), = seen
    assert arrived is not None and t0 <= arrived <= taken_in


@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": "Once upon a time"}),
                                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})])
def test_an_unstreamed_request_whose_client_left_is_aborted(server, path, body):  # type: ignore[no-untyped-def]
    """A client that gives up on an unstreamed request (its 1 s timeout) frees the engine at once
    (before, under Starlette's BaseHTTPMiddleware the route never saw the disconnect: 2,000 tokens
    ran on for nobody, holding their blocks)."""
    aborted = metric(server, 'lmserve_requests_total{finish_reason="abort"}')
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server["url"] + path, json={**body, "max_tokens": 2000, "ignore_eos": True},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=1.0)
    assert_idle(server)  # within 10 s: 2,000 tokens would take over a minute
    assert metric(server, 'lmserve_requests_total{finish_reason="abort"}') == aborted + 1


def test_a_failed_job_of_a_many_prompt_request_ends_its_siblings(server, monkeypatch):  # type: ignore[no-untyped-def]
    """Two 4-prompt requests pass the queue check together (the check bypassed here, as two requests
    in the same instant would), and the second's third job finds the queue full: it answers 429, and
    its two queued siblings are aborted (before, they ran to the end for nobody: 6 requests finished
    for 4 answered prompts)."""
    monkeypatch.setattr(server["srv"], "first_check", lambda jobs: None)
    monkeypatch.setattr(server["ae"], "max_queue", 6)
    name = 'lmserve_requests_total{finish_reason="length"}'
    before = metric(server, name)

    async def go() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as c:
            return await asyncio.gather(*(c.post(
                server["url"] + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                json={"prompt": [f"Story {i}.{j}:" for j in range(4)], "max_tokens": 32, "ignore_eos": True})
                for i in range(2)))

    codes = sorted(r.status_code for r in asyncio.run(go()))
    monkeypatch.undo()
    assert codes == [200, 429]
    assert_idle(server)
    assert metric(server, name) == before + 4


def test_a_job_failing_in_the_engine_ends_its_siblings(server, monkeypatch):  # type: ignore[no-untyped-def]
    """A 2-prompt request whose first prompt fails inside the engine (its output processing raises): the
    500 answers at once and the other prompt's 1,500 tokens stop with it (before, they ran to the end for
    nobody, and only then came the 500)."""
    out = server["engine"].output
    original = out._text
    marked = server["llm"].tokenizer.encode("EXPLODE now", add_special_tokens=False)

    def flaky(seq, new):  # type: ignore[no-untyped-def]
        if seq.prompt_token_ids[-len(marked):] == marked:
            raise RuntimeError("boom")
        return original(seq, new)

    monkeypatch.setattr(out, "_text", flaky)
    name = 'lmserve_requests_total{finish_reason="%s"}'
    before = {k: metric(server, name % k) for k in ("abort", "length")}
    r = post(server, "/v1/completions", {"prompt": ["EXPLODE now", "Once upon a time"], "max_tokens": 1500,
                                         "ignore_eos": True})
    assert r.status_code == 500 and "boom" in r.json()["error"]["message"]
    assert_idle(server)
    monkeypatch.undo()
    assert metric(server, name % "abort") == before["abort"] + 1  # the sibling was stopped,
    assert metric(server, name % "length") == before["length"]  # not run to its 1,500th token


def test_streamed_scoring_and_logprob_offsets_equal_the_response(server):  # type: ignore[no-untyped-def]
    """echo with max_tokens 0 (scoring) streamed: the prompt alone and 0 completion tokens, as the
    response has it (before, the throw-away token was streamed and counted); streamed logprobs'
    text_offset runs on over the choice (before, it restarted at 0 in every chunk)."""
    def run(body: dict, stream: bool) -> tuple[str, list[int], dict]:
        r = post(server, "/v1/completions", {**body, "stream": stream, **(
            {"stream_options": {"include_usage": True}} if stream else {})})
        if not stream:
            ch = r.json()["choices"][0]
            return ch["text"], (ch["logprobs"] or {}).get("text_offset", []), r.json()["usage"]
        text, offsets, use = "", [], {}
        for line in r.text.splitlines():
            if line.startswith("data: {"):
                ev = json.loads(line[6:])
                use = ev.get("usage") or use
                for ch in ev["choices"]:
                    text += ch["text"]
                    offsets += (ch["logprobs"] or {}).get("text_offset", [])
        return text, offsets, use

    score = {"prompt": "The capital of France is", "max_tokens": 0, "echo": True}
    assert run(score, True) == run(score, False)
    assert run(score, True)[2]["completion_tokens"] == 0 and run(score, True)[0] == score["prompt"]
    for body in ({**score, "logprobs": 1}, {**score, "max_tokens": 6, "temperature": 0, "logprobs": 1}):
        plain, streamed = run(body, False), run(body, True)  # the prompt's logprobs streamed too
        assert streamed == plain and len(plain[1]) == 5 + body["max_tokens"], body
    gen = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "logprobs": 1}
    plain, streamed = run(gen, False), run(gen, True)
    assert streamed[:2] == plain[:2] and len(set(plain[1])) == 8


def test_chat_logprob_bytes_rebuild_a_character_split_over_tokens(server):  # type: ignore[no-untyped-def]
    """Output held to the choice "游让 🙂" (characters of 3 and 4 UTF-8 bytes that the tokenizer splits
    over several tokens): the tokens' `bytes` joined are the content's UTF-8 (before, each partial
    token's bytes were U+FFFD's, so a client could not rebuild the characters; and the choice's 🙂, escaped
    into the grammar as two UTF-16 surrogates, forced 6 bytes no UTF-8 text holds: content "游让 ")."""
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Say it"}], "max_tokens": 24,
                                              "logprobs": True, "top_logprobs": 1,
                                              "structured_outputs": {"choice": ["游让 🙂"]}}).json()
    ch = r["choices"][0]
    toks = ch["logprobs"]["content"]
    assert ch["message"]["content"] == "游让 🙂" and any(t["token"] == "\ufffd" for t in toks)  # split characters
    assert bytes(b for t in toks for b in t["bytes"]).removesuffix(b"<|im_end|>") == "游让 🙂".encode()


# ---------------------------------------------------------------- concurrency

PROMPTS = [f"Tell me fact number {i} about {t}:" for i, t in
           enumerate(["cats", "the moon", "rivers", "bread", "jazz", "glaciers", "owls", "copper"] * 8)]


async def stream_one(c: httpx.AsyncClient, url: str, prompt: str, max_tokens: int, stop_after: int | None = None
                     ) -> str:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    text = ""
    async with c.stream("POST", url + "/v1/completions", json=body,
                        headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200
        n = 0
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            text += chunk["choices"][0]["text"]
            n += 1
            if stop_after is not None and n >= stop_after:
                return text  # leaving the block closes the connection mid-stream
    return text


def test_64_concurrent_streams_match_alone(server, client):  # type: ignore[no-untyped-def]
    lengths = [4 + (i * 7) % 20 for i in range(64)]

    async def go() -> list[str]:
        async with httpx.AsyncClient(timeout=300) as c:
            return await asyncio.gather(*(stream_one(c, server["url"], p, n) for p, n in zip(PROMPTS, lengths)))

    texts = asyncio.run(go())
    for i in range(0, 64, 9):  # spot-check against the same request sent alone
        alone = client.completions.create(model="smollm2-135m", prompt=PROMPTS[i], max_tokens=lengths[i],
                                          temperature=0).choices[0].text
        assert texts[i] == alone, i
    assert_idle(server)


class _ThreadLog(deque):
    """A deque that records the threads that ask its length."""

    threads: set[str]

    def __len__(self) -> int:
        self.threads.add(threading.current_thread().name)
        return super().__len__()


def test_engine_state_is_read_on_the_engine_thread_only(server, monkeypatch):  # type: ignore[no-untyped-def]
    """/metrics and the queue limit read the engine thread's published snapshot: Engine.stats walks the KV
    free queue that the engine thread mutates ("dictionary changed size during iteration")."""
    eng = server["engine"]
    threads: set[str] = set()
    stats = eng.stats

    def recorded_stats():  # type: ignore[no-untyped-def]
        threads.add(threading.current_thread().name)
        return stats()

    monkeypatch.setattr(eng, "stats", recorded_stats)
    waiting = _ThreadLog(eng.scheduler.waiting)
    waiting.threads = threads
    monkeypatch.setattr(eng.scheduler, "waiting", waiting)

    async def go() -> list[str]:
        async with httpx.AsyncClient(timeout=300) as c:
            streams = asyncio.gather(*(stream_one(c, server["url"], p, 12) for p in PROMPTS[:8]))
            while not streams.done():
                r = await c.get(server["url"] + "/metrics")
                assert r.status_code == 200 and "lmserve_kv_blocks_used" in r.text
                await asyncio.sleep(0.01)
            return await streams

    assert all(asyncio.run(go()))
    assert_idle(server)
    monkeypatch.undo()
    assert threads == {"lmserve-engine"}


def test_32_disconnects_free_everything(server, client):  # type: ignore[no-untyped-def]
    async def go() -> None:
        async with httpx.AsyncClient(timeout=300) as c:
            await asyncio.gather(*(stream_one(c, server["url"], p, 200, stop_after=2) for p in PROMPTS[:32]))

    asyncio.run(go())
    assert_idle(server)
    good_request_works(client)
    text = httpx.get(server["url"] + "/metrics").text
    assert 'lmserve_requests_total{finish_reason="abort"}' in text


def test_bench_serve_against_server(server, tmp_path):  # type: ignore[no-untyped-def]
    from lmserve.cli import main
    out = tmp_path / "serve.json"
    rc = main(["bench", "serve", "--url", server["url"], "--api-key", KEY, "--num-requests", "10",
               "--request-rate", "20", "--input-len", "4", "16", "--output-len", "4", "12",
               "--shared-prefix-fraction", "0.5", "--num-prefixes", "1", "--prefix-len", "64", "--n-fraction", "0.3",
               "--max-concurrency", "1",  # (the run's own hit rate: requests all at once would all miss)
               "--slo-ttft-ms", "60000", "--output-json", str(out), "--plot", "--no-progress"])
    assert rc == 0
    r = json.loads(out.read_text())["results"]
    assert r["completed"] == 10 and r["failed"] == 0
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        assert set(r[key]) >= {"mean", "p50", "p90", "p99"}
    assert r["goodput_requests_per_s"] > 0 and r["output_tokens_per_s"] > 0
    assert 0 < r["prefix_cache_hit_rate"] <= 1
    assert out.with_suffix(".png").stat().st_size > 1000
    assert_idle(server)


def test_request_timeout_aborts(server, client, monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setattr(server["srv"], "request_timeout", 0.5)
    r = post(server, "/v1/completions", {"prompt": "Tell me a long story.", "max_tokens": 500, "ignore_eos": True})
    assert r.status_code == 408 and r.json()["error"]["code"] == "request_timeout"
    monkeypatch.undo()
    assert_idle(server)
    good_request_works(client)


# ---------------------------------------------------------------- structured output (constrained decoding)
def test_response_format_json_schema_and_structured_outputs(client, server):  # type: ignore[no-untyped-def]
    """OpenAI's response_format (json_schema, json_object) and vLLM's structured_outputs / guided_* through
    the openai client: the text parses and obeys the constraint, streamed or not; then the server is idle."""
    import re
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
              "required": ["city", "population"], "additionalProperties": False}
    msgs = [{"role": "user", "content": "The capital of France as JSON with its population."}]
    r = client.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=40, temperature=0,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "city", "schema": schema}})
    if r.choices[0].finish_reason == "stop":
        obj = json.loads(r.choices[0].message.content)
        assert set(obj) == {"city", "population"} and isinstance(obj["population"], int)
    else:  # cut by max_tokens: still a prefix the schema allows
        assert r.choices[0].message.content.startswith('{"city": "')
    r = client.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=30, temperature=0,
                                       response_format={"type": "json_object"})
    text = r.choices[0].message.content
    assert text.startswith("{") and (r.choices[0].finish_reason != "stop" or isinstance(json.loads(text), dict))
    stream = client.completions.create(model="smollm2-135m", prompt="My phone number is", max_tokens=20, temperature=0.9,
                                       seed=3, stream=True, extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}})
    text = "".join(c.choices[0].text for c in stream)
    assert re.fullmatch(r"\d{3}-\d{4}", text), text
    r = client.completions.create(model="smollm2-135m", prompt="The movie was a delight. Sentiment:", max_tokens=10,
                                  temperature=0, extra_body={"guided_choice": ["positive", "negative"]})
    assert r.choices[0].text in ("positive", "negative") and r.choices[0].finish_reason == "stop"
    assert_idle(server)


# ---------------------------------------------------------------- tool calling
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 10}}, "required": ["zone"]}}}


def _streamed_calls(stream) -> tuple[str, dict[int, dict], str | None]:  # type: ignore[no-untyped-def]
    """(content, calls by index with the id / name of their first delta and the concatenated arguments,
    finish_reason) of a streamed chat completion; each call's name comes before its arguments."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        content += ch.delta.content or ""
        for tc in ch.delta.tool_calls or []:
            if tc.index not in calls:
                assert tc.id and tc.function.name, "a call's first delta carries its id and name"
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": tc.function.arguments or ""}
            else:
                assert tc.id is None and not tc.function.name
                calls[tc.index]["arguments"] += tc.function.arguments or ""
        finish = ch.finish_reason or finish
    return content, calls, finish


def test_tool_choice_required_and_named_are_enforced(client, server):  # type: ignore[no-untyped-def]
    """tool_choice required / a named function: constrained decoding makes the output a call whose
    arguments parse and obey the function's parameters; streamed, the same calls arrive name first."""
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    # a named function: exactly one call whatever parallel_tool_calls says, finish_reason "stop" (OpenAI, vLLM)
    for choice, names, parallel, reason in (
            ("required", {"get_weather", "get_time"}, False, "tool_calls"),
            ({"type": "function", "function": {"name": "get_weather"}}, {"get_weather"}, True, "stop")):
        r = client.chat.completions.create(model="smollm2-135m", messages=msgs, tools=[WEATHER, TIME], tool_choice=choice,
                                           parallel_tool_calls=parallel, max_tokens=60, temperature=0)
        ch = r.choices[0]
        assert ch.finish_reason == reason and ch.message.content is None and len(ch.message.tool_calls) == 1
        call = ch.message.tool_calls[0]
        assert call.id.startswith("call_") and call.function.name in names
        args = json.loads(call.function.arguments)
        if call.function.name == "get_weather":
            assert set(args) == {"city", "unit"} and args["unit"] in ("c", "f") and len(args["city"]) <= 20
        stream = client.chat.completions.create(model="smollm2-135m", messages=msgs, tools=[WEATHER, TIME],
                                                tool_choice=choice, parallel_tool_calls=parallel, max_tokens=60,
                                                temperature=0, stream=True)
        content, calls, finish = _streamed_calls(stream)
        assert finish == reason and content == "" and len(calls) == 1
        assert calls[0]["name"] == call.function.name and json.loads(calls[0]["arguments"]) == args
    assert_idle(server)


def test_auto_tool_calls_are_parsed_whole_and_streamed(client, server):  # type: ignore[no-untyped-def]
    """tool_choice auto: the output is read by the model's tool-call parser (Hermes' <tool_call> tags).
    The tiny model is steered into that format with a regex constraint; the response lists the calls,
    and the stream gives the same content and calls, each name before its arguments, nothing lost."""
    out = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
           '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')
    extra = {"structured_outputs": {"grammar": "root ::= " + json.dumps(out)}}  # exactly `out`
    msgs = [{"role": "user", "content": "Weather and time in Paris?"}]
    r = client.chat.completions.create(model="smollm2-135m", messages=msgs, tools=[WEATHER, TIME], max_tokens=200,
                                       temperature=0, extra_body=extra)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content.strip() == "Let me check."
    got = [(c.function.name, json.loads(c.function.arguments)) for c in ch.message.tool_calls]
    assert got == [("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {"zone": "CET"})]
    stream = client.chat.completions.create(model="smollm2-135m", messages=msgs, tools=[WEATHER, TIME], max_tokens=200,
                                            temperature=0, extra_body=extra, stream=True)
    content, calls, finish = _streamed_calls(stream)
    assert finish == "tool_calls" and content.strip() == "Let me check."
    assert [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)] == got
    # parallel_tool_calls false: the first call only, whole and streamed (as vLLM keeps; both were returned)
    kw = dict(model="smollm2-135m", messages=msgs, tools=[WEATHER, TIME], max_tokens=200, temperature=0,
              extra_body=extra, parallel_tool_calls=False)
    one = client.chat.completions.create(**kw).choices[0]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in one.message.tool_calls] == got[:1]
    content, calls, finish = _streamed_calls(client.chat.completions.create(**kw, stream=True))
    assert finish == "tool_calls" and [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == got[:1]
    # tool_choice none: the same text is plain content
    r = client.chat.completions.create(model="smollm2-135m", messages=msgs, tools=[WEATHER], tool_choice="none",
                                       max_tokens=200, temperature=0, extra_body=extra)
    assert r.choices[0].message.content == out and not r.choices[0].message.tool_calls
    # the calls and their results go back in as messages
    follow = msgs + [ch.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": ch.message.tool_calls[0].id, "content": "18 C, sunny"}]
    r = client.chat.completions.create(model="smollm2-135m", messages=follow, tools=[WEATHER, TIME], max_tokens=8)
    assert r.choices[0].message.role == "assistant"
    assert_idle(server)


def test_streamed_tool_calls_keep_every_tokens_logprobs(client, server):  # type: ignore[no-untyped-def]
    """logprobs with tool calls, streamed: text the parser holds back (a possible <tool_call> tag) keeps
    its tokens' logprobs for the next chunk that goes out, so the stream carries the logprob of every
    token, the same as the whole response (before, a held-back step's logprobs were dropped)."""
    out = 'Sure.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
    extra = {"structured_outputs": {"grammar": "root ::= " + json.dumps(out)}}
    msgs = [{"role": "user", "content": "Time in Paris?"}]
    kw = dict(model="smollm2-135m", messages=msgs, tools=[WEATHER, TIME], max_tokens=100, temperature=0,
              logprobs=True, top_logprobs=2, extra_body=extra)
    # once first, so that the two runs compared both find the prompt's blocks in the prefix cache: a
    # full prefill and a cached one differ in float rounding, which the default model's int8
    # activations can amplify past 1e-3 (issue #18's deterministic mode is what makes them equal)
    client.chat.completions.create(**kw)
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls"
    ref = [(t.token, t.logprob) for t in whole.logprobs.content]
    got = []
    for chunk in client.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            if ch.logprobs is not None and ch.logprobs.content:
                got += [(t.token, t.logprob) for t in ch.logprobs.content]
    assert [t for t, _ in got] == [t for t, _ in ref] and len(ref) > 10
    assert max(abs(a - b) for (_, a), (_, b) in zip(got, ref)) < 1e-3  # two runs of one greedy request
    assert_idle(server)


@pytest.mark.parametrize("body,param", [
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_tools_are_400(server, client, body, param):  # type: ignore[no-untyped-def]
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"] or "").startswith(param) or err["message"].startswith(param), err
    good_request_works(client)


def test_a_slow_grammar_compile_does_not_hold_up_the_server(server, client, monkeypatch):  # type: ignore[no-untyped-def]
    """A request whose grammar takes 2 s to compile: meanwhile /health and another request are answered
    at once (validation runs on a worker thread, not the event loop)."""
    structured = server["engine"].structured
    real = structured._compile

    def slow(*a):  # type: ignore[no-untyped-def]
        time.sleep(2.0)
        return real(*a)
    monkeypatch.setattr(structured, "_compile", slow)
    result = {}

    def constrained() -> None:
        result["r"] = post(server, "/v1/completions", {"prompt": "Digits:", "max_tokens": 4, "temperature": 0,
                                                        "structured_outputs": {"regex": "[0-9]{4} ok"}})
    th = threading.Thread(target=constrained)
    th.start()
    time.sleep(0.3)  # the compile is under way
    t0 = time.monotonic()
    assert httpx.get(server["url"] + "/health", timeout=5).status_code == 200
    good_request_works(client)
    elapsed = time.monotonic() - t0
    th.join(60)
    assert elapsed < 1.5, elapsed
    assert result["r"].status_code == 200 and re.fullmatch(r"[0-9]{4} ok|[0-9]{1,4}", result["r"].json()["choices"][0]["text"])


@pytest.mark.parametrize("route,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 2}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}]}),
])
def test_a_slow_chat_template_does_not_hold_up_the_server(server, client, monkeypatch, route, body):  # type: ignore[no-untyped-def]
    """A conversation whose template takes 1.5 s to render: meanwhile /health and another request are
    answered at once, on every route that renders one (rendering runs on a worker thread)."""
    tok = server["engine"].tokenizer
    real = tok.apply_chat_template

    def slow(*a, **k):  # type: ignore[no-untyped-def]
        time.sleep(1.5)
        return real(*a, **k)
    monkeypatch.setattr(tok, "apply_chat_template", slow)
    result = {}
    th = threading.Thread(target=lambda: result.setdefault("r", post(server, route, {"model": "smollm2-135m", **body})))
    th.start()
    time.sleep(0.3)  # the render is under way
    t0 = time.monotonic()
    assert httpx.get(server["url"] + "/health", timeout=5).status_code == 200
    elapsed = time.monotonic() - t0
    th.join(60)
    monkeypatch.undo()
    assert elapsed < 0.8, elapsed
    assert result["r"].status_code == 200, result["r"].text
    good_request_works(client)


def test_prompt_tokens_details_says_what_the_cache_served(server):  # type: ignore[no-untyped-def]
    """--enable-prompt-tokens-details (vLLM's flag): usage carries prompt_tokens_details.cached_tokens, the
    prompt tokens served from the prefix cache (the engine's count), whole and streamed, completions and
    chat; without the flag usage has no such key."""
    from fastapi.testclient import TestClient

    from lmserve.server.app import build_app
    from lmserve.server.limits import ServerLimits
    text = "Cached details: " + " ".join(f"item{i}" for i in range(60))
    app = build_app(server["ae"], "smollm2-135m", manage_engine=False,
                    limits=ServerLimits(enable_prompt_tokens_details=True))
    with TestClient(app) as c:
        eng = server["engine"]
        got = []
        for _ in range(2):
            before = eng.stats().prefix_hit_tokens
            u = c.post("/v1/completions", json={"prompt": text, "max_tokens": 2}).json()["usage"]
            got.append((u["prompt_tokens_details"]["cached_tokens"], eng.stats().prefix_hit_tokens - before))
        assert got[0][0] == got[0][1] and got[1][0] == got[1][1] > 0, got  # the second one hits the first's blocks
        body = {"messages": [{"role": "user", "content": text}], "max_tokens": 2}
        first = c.post("/v1/chat/completions", json=body).json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        with c.stream("POST", "/v1/chat/completions",
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] > first, chunks[-1]  # the first's blocks
    plain = post(server, "/v1/completions", {"prompt": text, "max_tokens": 2}).json()["usage"]
    assert "prompt_tokens_details" not in plain


def test_limits_are_the_servers_and_in_its_document(server):  # type: ignore[no-untyped-def]
    """ServerLimits (each a `serve` flag): an app with max_n 2, max_messages 3 and max_stop 1 refuses
    what is past them (chat and /tokenize too) naming the field and the flag, accepts what is within,
    and its OpenAPI document states those bounds."""
    from fastapi.testclient import TestClient

    from lmserve.server.app import build_app
    from lmserve.server.limits import ServerLimits
    app = build_app(server["ae"], "smollm2-135m", manage_engine=False,
                    limits=ServerLimits(max_n=2, max_messages=3, max_stop=1))
    msg = {"role": "user", "content": "hi"}
    with TestClient(app) as c:
        for route, body, param in (("/v1/completions", {"prompt": "Hi", "n": 3}, "n"),
                                   ("/v1/completions", {"prompt": "Hi", "best_of": 3}, "best_of"),
                                   ("/v1/completions", {"prompt": "Hi", "stop": ["a", "b"]}, "stop"),
                                   ("/v1/chat/completions", {"messages": [msg] * 4}, "messages"),
                                   ("/tokenize", {"messages": [msg] * 4}, "messages"),
                                   ("/v1/messages", {"messages": [msg] * 4, "max_tokens": 2}, None)):
            r = c.post(route, json={"max_tokens": 2, **body})
            assert r.status_code == 400, (route, r.text)
            if param is not None:
                assert r.json()["error"]["param"] == param and "--max-" in r.json()["error"]["message"], r.text
        assert c.post("/v1/completions", json={"prompt": "Hi", "n": 2, "max_tokens": 2}).status_code == 200
        assert c.post("/v1/chat/completions", json={"messages": [msg] * 3, "max_tokens": 2}).status_code == 200
        doc = c.get("/openapi.json").json()["components"]["schemas"]
    assert doc["CompletionRequest"]["properties"]["n"]["anyOf"][0]["maximum"] == 2  # (null: the default)
    assert doc["ChatCompletionRequest"]["properties"]["messages"]["maxItems"] == 3


def test_several_served_model_names(server):  # type: ignore[no-untyped-def]
    """--served-model-name a b (vLLM's): a request may name either, responses carry the first, another
    name is a 404 listing them, /v1/models has a card for each, the OpenAPI document enumerates them."""
    import argparse

    from fastapi.testclient import TestClient

    from lmserve.server.app import build_app
    from lmserve.server.cli import add_parser
    sub = argparse.ArgumentParser().add_subparsers()
    add_parser(sub)
    assert sub.choices["serve"].parse_args(["--served-model-name", "smol", "alias"]).served_model_name == ["smol", "alias"]
    app = build_app(server["ae"], ["smol", "alias"], manage_engine=False)
    with TestClient(app) as c:
        for name in ("smol", "alias"):
            r = c.post("/v1/completions", json={"model": name, "prompt": "Hi", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["model"] == "smol", r.text
        r = c.post("/v1/chat/completions", json={"model": "other", "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 404 and "'smol', 'alias'" in r.json()["error"]["message"], r.text
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["smol", "alias"]
        model = c.get("/openapi.json").json()["components"]["schemas"]["CompletionRequest"]["properties"]["model"]
    assert ["smol", "alias"] in [alt.get("enum") for alt in model.get("anyOf", [model])]


def test_max_logprobs_bounds_every_route(server, tiny_models, tmp_path):  # type: ignore[no-untyped-def]
    """The engine's max_logprobs (--max-logprobs, vLLM's; 20 by default) bounds completions' logprobs,
    chat's top_logprobs and prompt_logprobs: past it a 400 naming the field the client sent; within a
    raised one, as many alternatives as asked; the OpenAPI document states the bound in force."""
    from fastapi.testclient import TestClient

    from lmserve import LLM
    from lmserve.server.app import build_app
    from lmserve.server.async_engine import AsyncEngine
    from tests.conftest import char_tokenizer_model
    msg = [{"role": "user", "content": "hi"}]
    for route, body, param in (("/v1/completions", {"prompt": "Hi", "logprobs": 21}, "logprobs"),
                               ("/v1/chat/completions", {"messages": msg, "logprobs": True, "top_logprobs": 21},
                                "top_logprobs"),
                               ("/v1/chat/completions", {"messages": msg, "prompt_logprobs": 21}, "prompt_logprobs")):
        r = post(server, route, {"max_tokens": 2, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param and "at most 20" in r.text, r.text
    path = char_tokenizer_model(tiny_models["llama"][0], tmp_path / "llama")
    tpl = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<a>"
    app = build_app(AsyncEngine(LLM(str(path), max_logprobs=30, chat_template=tpl).engine), "tiny")
    with TestClient(app) as c:
        r = c.post("/v1/completions", json={"prompt": [5, 17, 33], "max_tokens": 2, "logprobs": 25,
                                            "prompt_logprobs": 30})
        assert r.status_code == 200, r.text
        c0 = r.json()["choices"][0]  # (the chosen token, and a prompt's own, come beside the k likeliest)
        assert [len(t) in (25, 26) for t in c0["logprobs"]["top_logprobs"]] == [True, True]
        assert [len(t) in (30, 31) for t in c0["prompt_logprobs"][1:]] == [True, True]
        chat = {"messages": msg, "max_tokens": 2, "logprobs": True, "top_logprobs": 28}
        r = c.post("/v1/chat/completions", json=chat)
        assert r.status_code == 200, r.text
        assert [len(t["top_logprobs"]) for t in r.json()["choices"][0]["logprobs"]["content"]] == [28, 28]
        r = c.post("/v1/chat/completions", json={**chat, "top_logprobs": 31})
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs" and "at most 30" in r.text
        doc = c.get("/openapi.json").json()["components"]["schemas"]
    def maximum(model: str, prop: str) -> list[int]:  # (a nullable property's bound is on its integer alternative)
        p = doc[model]["properties"][prop]
        return [alt["maximum"] for alt in p.get("anyOf", [p]) if "maximum" in alt]
    assert maximum("ChatCompletionRequest", "top_logprobs") == maximum("ChatCompletionRequest", "prompt_logprobs") == [30]
    assert maximum("CompletionRequest", "logprobs") == maximum("CompletionRequest", "prompt_logprobs") == [30]


def test_a_requests_own_chat_template_needs_the_operators_trust(server, client):  # type: ignore[no-untyped-def]
    """chat_template in a request: a 400 naming it unless the server trusts request templates; trusted,
    the request's template renders the prompt (in the same sandbox: one that runs past the render
    time limit is a 400, and the server goes on)."""
    from fastapi.testclient import TestClient

    from lmserve.server.app import build_app
    from lmserve.server.limits import ServerLimits
    msgs = [{"role": "user", "content": "The cat sat."}]
    r = post(server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 1, "chat_template": "{{ 1 }}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text
    app = build_app(server["ae"], "smollm2-135m", manage_engine=False,
                    limits=ServerLimits(trust_request_chat_template=True, template_max_seconds=0.5))
    tok = server["engine"].tokenizer
    with TestClient(app) as c:
        own = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
        r = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 1, "chat_template": own})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(tok.encode("[The cat sat.]", add_special_tokens=False))
        slow = "{% for i in range(90000) %}{% for j in range(90000) %}{% endfor %}{% endfor %}"
        r = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 1, "chat_template": slow})
        assert r.status_code == 400 and "longer than 0.5 s" in r.json()["error"]["message"], r.text
        r = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 1, "chat_template": "{% for %}"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text
    good_request_works(client)


def test_overload_a_request_past_max_waiting_time_is_a_503(server, client):  # type: ignore[no-untyped-def]
    """With max_waiting_time (here: any wait is too long) a request that has not started is answered
    503 with Retry-After and code queue_timeout, streamed or not; /health answers; `priority` is a field
    (an integer: else a 400)."""
    eng = server["engine"]
    object.__setattr__(eng.config, "max_waiting_time", 1e-9)
    try:
        r = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 4, "priority": 2})
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert r.json()["error"]["code"] == "queue_timeout"
        with httpx.stream("POST", server["url"] + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                          json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True},
                          timeout=30) as s:
            events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        assert events[-1]["error"]["code"] == "queue_timeout"
        assert httpx.get(server["url"] + "/health", timeout=5).status_code == 200
    finally:
        object.__setattr__(eng.config, "max_waiting_time", None)
    r = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "priority": "high"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
    assert post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "priority": -3}).status_code == 200
    good_request_works(client)


def test_auto_tool_choice_can_be_turned_off(server):  # type: ignore[no-untyped-def]
    """vLLM's --enable-auto-tool-choice is accepted (on by default here); with --no-enable-auto-tool-choice
    a request that lets the model choose (tools with tool_choice auto, or none given) is a 400 naming
    tool_choice, on the Messages API in its own shape, while a forced call still runs."""
    import argparse

    from lmserve.server import cli as server_cli
    from lmserve.server.app import build_app
    p = argparse.ArgumentParser()
    sub = p.add_subparsers()
    server_cli.add_parser(sub)
    assert p.parse_args(["serve", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]).enable_auto_tool_choice
    assert not p.parse_args(["serve", "--no-enable-auto-tool-choice"]).enable_auto_tool_choice
    app = build_app(server["ae"], "smollm2-135m", manage_engine=False, auto_tool_choice=False)
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    with serving(app) as (url, _):
        for extra in ({}, {"tool_choice": "auto"}):
            r = httpx.post(url + "/v1/chat/completions", json={"messages": msgs, "tools": [WEATHER], **extra}, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
        r = httpx.post(url + "/v1/messages", json={"messages": msgs, "max_tokens": 8, "tools": [{
            "name": "get_weather", "input_schema": {"type": "object"}}]}, timeout=60)
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
        forced = {"messages": msgs, "tools": [WEATHER], "tool_choice": "required", "max_tokens": 40, "temperature": 0}
        assert httpx.post(url + "/v1/chat/completions", json=forced, timeout=120).status_code == 200
        plain = {"messages": msgs, "max_tokens": 2}
        assert httpx.post(url + "/v1/chat/completions", json=plain, timeout=60).status_code == 200
    assert_idle(server)
