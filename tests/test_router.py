"""The router (lmserve/router): forwards byte-compatibly (the same greedy tokens, streams and errors as
a replica asked directly), routes by prompt prefix or load, retries a request a dead replica had not
started streaming, and ends a started stream with a clear error."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

pytest.importorskip("uvicorn")

from lmserve import LLM  # noqa: E402
from lmserve.router.policy import CHUNK, Replica, Router, chain, routing_text  # noqa: E402
from tests.test_server import BAD, KEY, free_port, serving, wait_healthy  # noqa: E402

AUTH = {"Authorization": f"Bearer {KEY}"}


# ---------------------------------------------------------------- the policy alone

def _router(policy: str, n: int = 2, balance: int = 4) -> Router:
    return Router([Replica(f"http://r{i}", healthy=True) for i in range(n)], policy, balance)


def test_round_robin_and_least_load_and_health():
    r = _router("round-robin", 3)
    assert [r.pick("x").url for _ in range(6)] == ["http://r0", "http://r1", "http://r2"] * 2
    r.replicas[1].healthy = False
    assert {r.pick("x").url for _ in range(4)} == {"http://r0", "http://r2"}
    assert r.pick("x", exclude={"http://r0", "http://r2"}) is None
    ll = _router("least-load", 3)
    ll.replicas[0].in_flight, ll.replicas[1].reported, ll.replicas[2].in_flight = 5, 2, 3
    assert ll.pick("x").url == "http://r1"


def test_prefix_routing_follows_the_longest_shared_prefix_within_the_balance():
    r = _router("prefix", 2, balance=2)
    system = "You are a careful assistant. " * 20  # 580 characters: 9 blocks
    first = r.pick(system + "question one").url
    r.replicas[[x.url for x in r.replicas].index(first)].in_flight = 2
    # the other replica is idle, but within the balance the prefix wins
    assert r.pick(system + "question two").url == first
    assert r.prefix_hit_rate > 0.4
    # an unrelated prompt goes to the least-loaded replica
    other = r.pick("z" * 300).url
    assert other != first
    # past the balance, load wins over the prefix
    r.replicas[[x.url for x in r.replicas].index(first)].in_flight = 9
    assert r.pick(system + "question three").url == other
    # a prefix is a chain: the same block after a different start is not a hit
    assert chain("a" * CHUNK + "b" * CHUNK)[1] != chain("c" * CHUNK + "b" * CHUNK)[1]


def test_routing_text_of_each_api():
    assert routing_text("/v1/completions", {"prompt": "hello"}) == "hello"
    assert routing_text("/v1/completions", {"prompt": [1, 2]}) == "[1, 2]"
    chat = routing_text("/v1/chat/completions", {"messages": [{"role": "system", "content": "S"}]})
    assert chat.startswith("[{") and '"S"' in chat
    assert routing_text("/v1/messages", {"system": "sys", "messages": []}).startswith("sys")
    assert routing_text("/v1/completions", None) == "" and routing_text("/v1/completions", [1]) == ""
    # SageMaker's /invocations: a completions body by its prompt, a chat body by its conversation
    assert routing_text("/invocations", {"prompt": "hello"}) == "hello"
    assert routing_text("/invocations", {"messages": [{"role": "system", "content": "S"}]}) == chat
    with pytest.raises(ValueError, match="policy"):
        Router([Replica("http://a")], "random")


# ---------------------------------------------------------------- through real servers

@pytest.fixture(scope="module")
def replicas(smol):  # type: ignore[no-untyped-def]
    """Two replicas of the default model (fp32, as the `smol` fixture) on loopback, as test_server builds one."""
    from lmserve.server.app import build_app
    from lmserve.server.async_engine import AsyncEngine
    other = LLM(quantization="none", kv_cache_memory="256MiB")
    apps = [build_app(AsyncEngine(e, max_queue=64), "smollm2-135m", api_key=KEY, max_body_bytes=64 * 1024)
            for e in (smol.engine, other.engine)]
    with serving(apps[0]) as (a, _), serving(apps[1]) as (b, _):
        yield [a, b]


@pytest.fixture
def front(replicas):  # type: ignore[no-untyped-def]
    from lmserve.router.app import build_router_app
    router = Router([Replica(u) for u in replicas], "round-robin")
    with serving(build_router_app(router, health_interval=0.2)) as (url, _):
        yield url, router


def _strip(resp: dict) -> dict:
    return {k: v for k, v in resp.items() if k not in ("id", "created")}


def test_forwarded_responses_equal_the_replicas_own(front, replicas):
    url, router = front
    body = {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}
    direct = httpx.post(replicas[0] + "/v1/completions", json=body, headers=AUTH, timeout=60).json()
    for _ in range(2):  # round-robin: once to each replica
        routed = httpx.post(url + "/v1/completions", json=body, headers=AUTH, timeout=60)
        assert routed.status_code == 200 and routed.headers["content-type"].startswith("application/json")
        assert _strip(routed.json()) == _strip(direct)
    assert [r.requests for r in router.replicas] == [1, 1]
    chat = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8, "temperature": 0}
    d = httpx.post(replicas[1] + "/v1/chat/completions", json=chat, headers=AUTH, timeout=60).json()
    r = httpx.post(url + "/v1/chat/completions", json=chat, headers=AUTH, timeout=60).json()
    assert r["choices"] == d["choices"] and r["usage"] == d["usage"]


def _stream(base: str, body: dict) -> list[str]:
    with httpx.stream("POST", base + "/v1/completions", json={**body, "stream": True}, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return [line for line in r.iter_lines() if line]


def test_a_stream_comes_through_chunk_for_chunk(front, replicas):
    url, _ = front
    body = {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0}
    direct, routed = _stream(replicas[0], body), _stream(url, body)
    assert routed[-1] == direct[-1] == "data: [DONE]"
    text = ["".join(json.loads(x[6:])["choices"][0]["text"] for x in lines[:-1]) for lines in (direct, routed)]
    assert text[0] == text[1] and len(text[0]) > 0


@pytest.mark.parametrize("path,body,raw,status,param", BAD)
def test_bad_input_gets_the_replicas_error_unchanged(front, replicas, path, body, raw, status, param):
    url, _ = front
    kw = {"content": raw} if raw is not None else {"json": body}
    direct = httpx.post(replicas[0] + path, headers={**AUTH, "content-type": "application/json"}, timeout=30, **kw)
    routed = httpx.post(url + path, headers={**AUTH, "content-type": "application/json"}, timeout=30, **kw)
    assert routed.status_code == direct.status_code == status
    assert routed.json() == direct.json()



def test_the_router_refuses_what_it_cannot_forward_and_keeps_going(front):
    url, router = front
    bad_key = httpx.post(url + "/v1/completions", json={"prompt": "hi"}, headers={"Authorization": "Bearer no"})
    assert bad_key.status_code == 401 and bad_key.json()["error"]["code"] == "invalid_api_key"
    huge = httpx.post(url + "/v1/completions", content=b"x" * (5 << 20), headers=AUTH, timeout=30)
    assert huge.status_code == 413 and huge.json()["error"]["code"] == "request_too_large"  # (the replicas' code)
    for method, path in (("OPTIONS", "/v1/completions"), ("OPTIONS", "/v1/messages"), ("GET", "/v1/completions")):
        direct = httpx.request(method, router.replicas[0].url + path, headers=AUTH)
        routed = httpx.request(method, url + path, headers=AUTH)
        assert routed.status_code == direct.status_code == 405 and routed.json() == direct.json(), routed.text
    assert httpx.get(url + "/v1/nope", headers=AUTH).status_code == 404  # the replica's 404
    before = sum(r.requests for r in router.replicas)
    internal = httpx.post(url + "/v1/internal/kv", content=b"LMKV", headers=AUTH)  # never from a client
    assert internal.status_code == 404 and sum(r.requests for r in router.replicas) == before
    assert httpx.get(url + "/health").status_code == 200 and all(r.healthy for r in router.replicas)


def test_prefix_policy_keeps_a_shared_system_prompt_on_one_replica(replicas):
    from lmserve.router.app import build_router_app
    router = Router([Replica(u) for u in replicas], "prefix")
    system = "You are lmserve's test assistant. Answer in one short sentence, politely. " * 3
    with serving(build_router_app(router, health_interval=0.2)) as (url, _):
        for q in ("What is 2+2?", "Name a colour.", "Say yes."):
            chat = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": q}],
                    "max_tokens": 2, "temperature": 0}
            assert httpx.post(url + "/v1/chat/completions", json=chat, headers=AUTH, timeout=60).status_code == 200
        metrics = httpx.get(url + "/metrics").text
    assert sorted(r.requests for r in router.replicas) == [0, 3]
    rate = float(next(line.split()[1] for line in metrics.splitlines() if line.startswith("lmserve_router_prefix_hit_rate")))
    assert rate >= 0.5  # requests 2 and 3 match every block of their key; request 1 none
    assert 'lmserve_router_requests_total{replica="' in metrics


# ---------------------------------------------------------------- a replica killed mid-run

def _start_replica(folder: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "lmserve.cli", "serve", "--model", folder, "--port", str(port),
                             "--kv-cache-memory", "16MiB"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, f"http://127.0.0.1:{port}"


def test_a_killed_replica_loses_no_request_that_had_not_started_streaming(tiny_models, tmp_path):
    from lmserve.router.app import build_router_app
    from tests.conftest import char_tokenizer_model
    folder = str(char_tokenizer_model(tiny_models["llama"][0], tmp_path / "chars"))  # text streams token by token
    (pa, a), (pb, b) = _start_replica(folder), _start_replica(folder)
    try:
        wait_healthy(a)
        wait_healthy(b)
        router = Router([Replica(a), Replica(b)], "round-robin")
        with serving(build_router_app(router, health_interval=0.2)) as (url, _):
            long = {"prompt": [5, 9, 13], "max_tokens": 1500, "temperature": 0, "ignore_eos": True}
            want = httpx.post(b + "/v1/completions", json=long, timeout=120).json()["choices"][0]["text"]
            # non-streamed requests on both replicas (round-robin: a, b, a, b), then a stream (the fifth: a);
            # replica a dies as soon as the stream's first bytes arrived, with its other requests in flight
            results: list[httpx.Response] = []
            posts = [threading.Thread(target=lambda: results.append(
                httpx.post(url + "/v1/completions", json=long, timeout=120))) for _ in range(4)]
            for t in posts:
                t.start()
            while sum(r.requests for r in router.replicas) < 4:  # all four routed before the stream
                time.sleep(0.01)
            lines: list[str] = []
            started = threading.Event()

            def stream() -> None:
                with httpx.stream("POST", url + "/v1/completions", json={**long, "stream": True}, timeout=120) as r:
                    for line in r.iter_lines():
                        if line:
                            lines.append(line)
                            started.set()

            th = threading.Thread(target=stream)
            th.start()
            assert started.wait(60)
            pa.send_signal(signal.SIGKILL)
            for t in [th, *posts]:
                t.join(120)
            metrics = httpx.get(url + "/metrics").text
        assert [r.status_code for r in results] == [200] * 4  # those on a went to b
        assert all(r.json()["choices"][0]["text"] == want for r in results)
        assert lines[-1] == "data: [DONE]"  # after the error event, as the server's own error path
        assert "error" in json.loads(lines[-2][6:]), "the stream ended before the kill: make it longer"
        err = json.loads(lines[-2][6:])["error"]
        assert err["code"] == "replica_failed" and "failed" in err["message"]  # the started stream: a clear end
        retries = float(next(x.split()[1] for x in metrics.splitlines() if x.startswith("lmserve_router_retries_total")))
        assert retries >= 1
        assert not router.replicas[0].healthy and router.replicas[1].healthy
    finally:
        for p in (pa, pb):
            p.kill()
            p.wait()


def test_serve_data_parallel_starts_replicas_behind_a_router(tiny_models):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "lmserve.cli", "serve", "--data-parallel", "2", "--model",
                             str(tiny_models["llama"][0]), "--port", str(port), "--kv-cache-memory", "16MiB",
                             "--policy", "round-robin"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)  # the router answers 200 once a replica is up
        for _ in range(600):  # both replicas up
            up = [x for x in httpx.get(url + "/metrics").text.splitlines() if x.startswith("lmserve_router_replica_up{")]
            if len(up) == 2 and all(x.endswith(" 1.0") for x in up):
                break
            time.sleep(0.1)
        for _ in range(4):
            r = httpx.post(url + "/v1/completions", json={"prompt": [5, 9, 13], "max_tokens": 4}, timeout=60)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        metrics = httpx.get(url + "/metrics").text
        counts = [float(x.split()[1]) for x in metrics.splitlines() if x.startswith("lmserve_router_requests_total")]
        assert counts == [2.0, 2.0]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    out = proc.stdout.read()
    assert "lmserve router: round-robin over http://127.0.0.1:" in out and "Traceback" not in out, out[-2000:]


def test_dot_segments_cannot_reach_internal_routes(front):  # type: ignore[no-untyped-def]
    """/x/../v1/internal/kv and its kin, sent raw (httpx would collapse them client-side): refused (before,
    the upstream request collapsed them and the replica's internal route was reached)."""
    import socket
    url, router = front
    host, port = url.removeprefix("http://").split(":")
    before = sum(r.requests for r in router.replicas)
    for path in ("/x/../v1/internal/kv", "/./v1/internal/kv", "/%2e/v1/internal/kv", "/v1/x/../internal/kv"):
        with socket.create_connection((host, int(port))) as s:
            s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nConnection: close\r\n\r\nLMKV".encode())
            status = s.recv(64).split()[1]
        assert status in (b"400", b"404"), path
    assert sum(r.requests for r in router.replicas) == before


def test_a_slow_replica_is_not_a_dead_one_and_a_client_gone_is_gone(replicas):  # type: ignore[no-untyped-def]
    """A read timeout (2 s here; 600 s by default) on an unstreamed 1,500-token request: a 504, the replica
    still up and not asked again (before: marked down, the request run again on the other replica, then
    a 503). Then a client that gives up on an unstreamed request: the replica stops generating (before,
    the router waited for the whole answer while the replica generated for nobody)."""
    from lmserve.router.app import build_router_app
    from tests.test_server import assert_idle
    router = Router([Replica(u) for u in replicas], "round-robin")
    body = {"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True}
    with serving(build_router_app(router, health_interval=0.2, timeout=2.0)) as (url, _):
        for _ in range(100):
            if all(r.healthy for r in router.replicas):
                break
            time.sleep(0.1)
        r = httpx.post(url + "/v1/completions", json=body, headers=AUTH, timeout=60)
        assert r.status_code == 504 and r.json()["error"]["code"] == "replica_timeout"
        assert sum(x.requests for x in router.replicas) == 1 and all(x.healthy for x in router.replicas)
        for u in replicas:
            assert_idle({"url": u})  # the closed connection aborted it at the replica
    with serving(build_router_app(router, health_interval=0.2)) as (url, _):
        with pytest.raises(httpx.TimeoutException):
            httpx.post(url + "/v1/completions", json=body, headers=AUTH, timeout=1.0)
        for u in replicas:
            assert_idle({"url": u})


def test_serve_data_parallel_stops_when_a_replica_dies():  # type: ignore[no-untyped-def]
    """--data-parallel 2 on a model that does not exist: both replicas exit, and so does the front, non-zero
    (before, it answered 503 forever)."""
    proc = subprocess.Popen([sys.executable, "-m", "lmserve.cli", "serve", "--data-parallel", "2", "--model",
                             "/nonexistent/model", "--port", str(free_port())], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.wait(90) == 1  # (not 130 and a KeyboardInterrupt traceback: uvicorn raises the SIGINT again)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = proc.stdout.read()
    assert "exited with" in out and "Traceback" not in out


def test_a_health_check_does_not_revive_a_replica_that_failed_while_it_ran():  # type: ignore[no-untyped-def]
    """The check's 200 left the replica before a forwarded request failed on it (marked down): the
    check's answer must not mark it up again (before, it did, until the next check)."""
    import asyncio

    from lmserve.router.app import check
    rep = Replica("http://r0", healthy=True)

    class Client:
        async def get(self, url: str, timeout: float) -> httpx.Response:
            if url.endswith("/health"):  # meanwhile a forwarded request fails on it
                rep.healthy, rep.failures = False, rep.failures + 1
                return httpx.Response(200, text="ok")
            return httpx.Response(200, text="lmserve_num_requests_running 0\n")

    asyncio.run(check(Client(), rep))  # type: ignore[arg-type]
    assert not rep.healthy

    class Quiet:
        async def get(self, url: str, timeout: float) -> httpx.Response:
            return httpx.Response(200, text="ok" if url.endswith("/health") else "lmserve_num_requests_running 2\n")

    asyncio.run(check(Quiet(), rep))  # type: ignore[arg-type]
    assert rep.healthy and rep.reported == 2  # a clean check brings it back


def test_a_killed_front_takes_its_replicas_along(tiny_models):  # type: ignore[no-untyped-def]
    """serve --data-parallel 2, the front SIGKILLed (no finally runs): its replicas exit too (they run in
    their own session, so a terminal's Ctrl-C reaches the front alone, and die with their parent)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "lmserve.cli", "serve", "--data-parallel", "2", "--model",
                             str(tiny_models["llama"][0]), "--port", str(port), "--kv-cache-memory", "16MiB"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        replicas = []
        for _ in range(600):  # both replicas up: their URLs from the router's metrics
            up = [x for x in httpx.get(url + "/metrics").text.splitlines() if x.startswith("lmserve_router_replica_up{")]
            if len(up) == 2 and all(x.endswith(" 1.0") for x in up):
                replicas = [x.split('"')[1] for x in up]
                break
            time.sleep(0.1)
        assert len(replicas) == 2
        proc.kill()
        proc.wait(30)
        for _ in range(200):
            alive = []
            for r in replicas:
                try:
                    httpx.get(r + "/health", timeout=1)
                    alive.append(r)
                except httpx.HTTPError:
                    pass
            if not alive:
                break
            time.sleep(0.1)
        assert not alive
    finally:
        if proc.poll() is None:
            proc.kill()


def test_what_a_replica_answers_the_router_answers_too(replicas, smol):  # type: ignore[no-untyped-def]
    """Found by the router hunt (each failed before): a prompt with a lone surrogate under the prefix
    policy is the replica's 400 (the router's hash raised: a 500); a header value outside ASCII goes
    through as sent (httpx refused to encode it: a 500); a replica whose engine died says Retry-After,
    so the router takes the request elsewhere (its 503 reached the client while the other replica was
    healthy); `serve` takes no abbreviated flag (`--pol` went on to the replicas, which refused it)."""
    from starlette.testclient import TestClient

    from lmserve.cli import build_parser
    from lmserve.router.app import build_router_app, refused
    from lmserve.server.app import build_app
    from lmserve.server.async_engine import AsyncEngine
    router = Router([Replica(u) for u in replicas], "prefix")
    body = {"prompt": "\ud800" + "a" * (2 * CHUNK), "max_tokens": 2}
    with serving(build_router_app(router, health_interval=0.2)) as (url, _):
        direct = httpx.post(replicas[0] + "/v1/completions", content=json.dumps(body), headers={
            **AUTH, "content-type": "application/json"}, timeout=30)
        routed = httpx.post(url + "/v1/completions", content=json.dumps(body), headers={
            **AUTH, "content-type": "application/json"}, timeout=30)
        assert routed.status_code == direct.status_code == 400 and routed.json() == direct.json()
        r = httpx.get(url + "/v1/models", headers={**AUTH, "x-note": "caf\xe9".encode("latin-1")}, timeout=30)
        assert r.status_code == 200 and r.json()["data"][0]["id"] == "smollm2-135m", r.text
    with TestClient(build_app(AsyncEngine(smol.engine), "m", manage_engine=False)) as c:  # its loop never ran
        dead = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert dead.status_code == 503 and refused(dead)  # (the router's test: not run here, try another)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--pol", "round-robin"])
