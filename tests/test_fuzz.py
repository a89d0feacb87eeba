"""The API under fuzzing: schemathesis against our OpenAPI document (every route, positive and
negative generation), and hypothesis-drawn raw bodies (wrong types, huge numbers, NaN / Infinity,
deep nesting, huge arrays, invalid UTF-8, duplicate keys). The server runs a tiny model with a
character tokenizer and a chat template, so every accepted request really generates. Afterwards: no
5xx was answered, every 4xx carried its API's error body, the engine is alive and every KV block is
free.

LMSERVE_FUZZ_EXAMPLES (default 60: ~1,700 schemathesis cases over the 19 routes) sets the examples per route and mode; README shows a longer run."""

from __future__ import annotations

import json
import os
import time
from collections import Counter

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
uvicorn = pytest.importorskip("uvicorn")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402

from lmserve import LLM  # noqa: E402
from tests.conftest import char_tokenizer_model  # noqa: E402
from tests.test_server import serving  # noqa: E402

EXAMPLES = int(os.environ.get("LMSERVE_FUZZ_EXAMPLES", "60"))
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] if m['content'] is string else '' }}\n"
            "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
ROUTES = ["/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize", "/v1/responses",
          "/v1/messages", "/v1/messages/count_tokens", "/v1/embeddings", "/score", "/v1/score", "/rerank",
          "/v1/rerank", "/v2/rerank", "/invocations", "/health", "/ping", "/version", "/metrics"]


@pytest.fixture(scope="module")
def fuzz_server(tiny_models, tmp_path_factory):  # type: ignore[no-untyped-def]
    from lmserve.server.app import build_app
    from lmserve.server.async_engine import AsyncEngine
    path = char_tokenizer_model(tiny_models["llama"][0], tmp_path_factory.mktemp("fuzz") / "model")
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "eos_token": "\x02"}))
    llm = LLM(str(path), max_model_len=96, max_num_seqs=32)
    ae = AsyncEngine(llm.engine, max_queue=64)
    app = build_app(ae, "tiny", max_body_bytes=64 * 1024)
    with serving(app) as (url, _):
        yield {"url": url, "ae": ae, "engine": llm.engine, "app": app}


def idle(server) -> None:  # type: ignore[no-untyped-def]
    """The engine alive, nothing left running, every KV block free."""
    assert httpx.get(server["url"] + "/health", timeout=10).status_code == 200
    eng = server["engine"]
    for _ in range(200):
        if not eng.requests:
            break
        time.sleep(0.05)
    assert not eng.requests
    bm = eng.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def error_body_ok(path: str, resp) -> bool:  # type: ignore[no-untyped-def]
    """A 4xx in the error shape of the route's API."""
    try:
        body = resp.json()
    except ValueError:
        return False
    if path.startswith("/v1/messages"):
        return body.get("type") == "error" and isinstance(body.get("error", {}).get("message"), str)
    err = body.get("error")
    return isinstance(err, dict) and isinstance(err.get("message"), str) and isinstance(err.get("type"), str)


def test_the_document_declares_every_route(fuzz_server):  # type: ignore[no-untyped-def]
    """Every route with its request model (bounds included), its response and its errors; a wrong
    method is a 405 that names the allowed one."""
    doc = httpx.get(fuzz_server["url"] + "/openapi.json").json()
    assert sorted(doc["paths"]) == sorted(ROUTES)
    schemas = doc["components"]["schemas"]
    for path, item in doc["paths"].items():
        for method, op in item.items():
            assert "200" in op["responses"], (path, method)
            if method == "post" and path != "/ping":  # (a probe: no body)
                ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
                assert ref.rsplit("/", 1)[1] in schemas
                assert {"400", "413", "415"} <= set(op["responses"]), path
    n = schemas["CompletionRequest"]["properties"]["n"]  # (null: the default, as OpenAI documents it)
    assert n["anyOf"][1] == {"type": "null"} and n["anyOf"][0]["maximum"] == 16 and n["anyOf"][0]["minimum"] == 1
    assert schemas["CompletionRequest"]["properties"]["max_tokens"]["anyOf"][0]["minimum"] == 0
    r = httpx.get(fuzz_server["url"] + "/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST" and error_body_ok("/v1/completions", r)


def test_schemathesis_every_route_positive_and_negative(fuzz_server):  # type: ignore[no-untyped-def]
    """schemathesis draws bodies from the document (conforming, and violating it): no 5xx, every 4xx
    with the error body, every response as the document says (status, content type, schema, a 405's
    Allow). Not checked: that every conforming body is accepted (rules across fields, such as prompt +
    max_tokens within the context, are not in a JSON schema)."""
    from schemathesis import GenerationMode
    from schemathesis.checks import negative_data_rejection, positive_data_acceptance
    url = fuzz_server["url"]
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    counts: Counter = Counter()
    failures: list[str] = []
    for result in schema.get_all_operations():
        op = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @given(case=op.as_strategy(generation_mode=mode))
            @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            def run(case):  # type: ignore[no-untyped-def]
                resp = case.call(base_url=url, timeout=120)
                counts[(op.path, mode.value, resp.status_code // 100)] += 1
                if os.environ.get("LMSERVE_FUZZ_DEBUG") and mode is GenerationMode.POSITIVE and resp.status_code >= 400:
                    print("DEBUG", op.path, resp.status_code, resp.text[:150])
                if resp.status_code >= 500:
                    failures.append(f"{op.method} {op.path} {mode.value}: {resp.status_code} {resp.text[:300]}")
                elif resp.status_code >= 400 and not error_body_ok(op.path, resp):
                    failures.append(f"{op.method} {op.path}: {resp.status_code} without an error body: {resp.text[:200]}")
                # a 413 (the body is over the size limit) refuses any body; schemathesis' list of
                # refusals for schema-violating data does not have it
                excluded = [positive_data_acceptance] + ([negative_data_rejection] if resp.status_code == 413 else [])
                try:
                    case.validate_response(resp, excluded_checks=excluded)
                except Exception as e:  # noqa: BLE001 - collected: one report for the whole run
                    failures.append(f"{op.method} {op.path} {mode.value}: {str(e)[:600]}")
            try:
                run()
            except Unsatisfiable:  # nothing to violate (a GET or POST /ping without parameters, negative mode)
                assert mode is GenerationMode.NEGATIVE and (op.method.upper() == "GET" or op.path == "/ping"), (
                    op.path, mode)
    total = sum(counts.values())
    by_class = Counter()
    for (_, _, cls), k in counts.items():
        by_class[cls] += k
    print(f"schemathesis: {total} cases over {len(ROUTES)} routes; by status class {dict(sorted(by_class.items()))}")
    for key in sorted(counts):
        print("  ", key, counts[key])
    assert not failures, "\n".join(failures[:10])
    assert total >= 12.5 * EXAMPLES  # 8 POST routes x 2 modes (some exhaust sooner), the GETs: 1,000 at the default
    assert by_class[2] > 0 and by_class[4] > 0  # both accepted and refused bodies were tried
    idle(fuzz_server)


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


HOSTILE = ['{"prompt": "a", "max_tokens": NaN}', '{"prompt": "a", "temperature": Infinity}',
           '{"prompt": "a", "max_tokens": -Infinity}', '{"prompt": "a", "max_tokens": 1e400}',
           '{"prompt": "a", "max_tokens": 99999999999999999999999999}',
           '{"prompt": "a", "n": 2, "n": 1000000}', '{"messages": [], "messages": 5}',
           '{"prompt": "a", "logit_bias": {"1": 1e308}}', '{"prompt": "a", "seed": -1}',
           '{"prompt": "\\ud800", "max_tokens": 2}', '{"prompt": "\\udfff\\ud800x"}',
           '{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}',
           '{"input": "\\ud800", "max_output_tokens": 2}', '"just a string"', '[1, 2, 3]', 'null', '',
           '{"prompt": [[1, 2], [3, 99999999]]}', '{"prompt": "' + "a" * 5000 + '", "max_tokens": 1}',
           '{"prompt": ' + "[" * 5000 + "]" * 5000 + "}", '{"prompt": ' + "[" * 100 + "]" * 100 + "}",
           '{"tools": ' + "[" * 100 + "]" * 100 + ', "messages": [{"role": "user", "content": "x"}]}']


@pytest.mark.parametrize("raw", HOSTILE)
def test_known_hostile_bodies_on_every_route(fuzz_server, raw):  # type: ignore[no-untyped-def]
    """Each hostile body above (NaN / Infinity, huge numbers, duplicate keys, lone surrogates, not an
    object, deep nesting) to every POST route: a 4xx with the error body (or a 2xx), never a 5xx."""
    url = fuzz_server["url"]
    with httpx.Client(timeout=60) as c:
        for route in [r for r in ROUTES if r not in ("/v1/models", "/health", "/metrics")]:
            r = c.post(url + route, content=raw.encode(), headers={"content-type": "application/json"})
            assert r.status_code < 500, (route, raw[:80], r.status_code, r.text[:300])
            if r.status_code >= 400:
                assert error_body_ok(route, r), (route, r.status_code, r.text[:200])


ANY_TEXT = st.text(st.characters(exclude_categories=()), max_size=40)  # lone surrogates included
RAW = st.one_of(
    st.binary(max_size=200),  # anything at all, invalid UTF-8 included
    st.builds(lambda v: json.dumps({"prompt": v, "max_tokens": 4}),
              st.one_of(st.integers(), st.floats(allow_nan=False), st.booleans(), st.none(),
                        st.lists(st.integers(-5, 300), max_size=5), st.dictionaries(st.text(max_size=3), st.integers()))),
    ANY_TEXT.map(lambda t: json.dumps({"prompt": t, "max_tokens": 2})),
    ANY_TEXT.map(lambda t: json.dumps({"messages": [{"role": "user", "content": t}], "max_tokens": 2})),
    st.integers(1000, 50_000).map(lambda d: '{"prompt": ' + _nested(d) + "}"),  # deep nesting
    st.integers(10_000, 60_000).map(lambda n: json.dumps({"prompt": [7] * n})),  # a huge array
    st.builds(lambda k, v: json.dumps({k: v}), st.sampled_from(["prompt", "messages", "input", "tokens", "stop",
                                                              "tools", "response_format", "logprobs", "n"]),
              st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=5)),
                           lambda ch: st.lists(ch, max_size=3) | st.dictionaries(st.text(max_size=3), ch, max_size=3),
                           max_leaves=8)),
)


def test_raw_bodies_never_get_a_5xx(fuzz_server):  # type: ignore[no-untyped-def]
    """Hypothesis-drawn raw bodies to every POST route: each is answered 2xx or 4xx with the error body
    (a 413 for the huge ones), never a 5xx; the engine serves on."""
    url = fuzz_server["url"]
    posts = [r for r in ROUTES if r not in ("/v1/models", "/health", "/metrics")]
    seen: Counter = Counter()
    with httpx.Client(timeout=120) as client:
        @given(route=st.sampled_from(posts), raw=RAW)
        @settings(max_examples=3 * EXAMPLES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        def run(route, raw):  # type: ignore[no-untyped-def]
            data = raw if isinstance(raw, bytes) else raw.encode("utf-8", "surrogatepass")
            r = client.post(url + route, content=data, headers={"content-type": "application/json"})
            seen[r.status_code] += 1
            assert r.status_code < 500, (route, data[:200], r.status_code, r.text[:300])
            if r.status_code >= 400:
                assert error_body_ok(route, r), (route, r.status_code, r.text[:200])
        run()
    print(f"raw bodies: {sum(seen.values())} posted; statuses {dict(sorted(seen.items()))}")
    assert seen[400] > 0 and seen[413] > 0
    idle(fuzz_server)


def test_numbers_are_what_the_document_says(fuzz_server):  # type: ignore[no-untyped-def]
    """A number field takes a JSON number and nothing else (pydantic's lax float took true and "0.5",
    which the document forbids: schemathesis' negative data found it); an integer field takes 2.0, which
    JSON Schema counts as an integer, and not 2.5 or true."""
    url = fuzz_server["url"] + "/v1/completions"
    for field, value, status in (("min_p", True, 400), ("temperature", "0.5", 400), ("top_p", [1], 400),
                                 ("temperature", 1, 200), ("n", 2.0, 200), ("n", 2.5, 400), ("n", True, 400),
                                 ("max_tokens", 3.0, 200), ("temperature", 10**400, 400)):
        r = httpx.post(url, json={"prompt": "ab", "max_tokens": 2, field: value}, timeout=60)
        assert r.status_code == status, (field, value, r.text)
        if status == 400:
            assert r.json()["error"]["param"] == field, r.text
    idle(fuzz_server)
