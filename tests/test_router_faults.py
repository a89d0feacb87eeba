"""The router against replicas that fail in the ways real ones do, with small in-process stand-ins (no
model): dying inside a stream or an unstreamed body, refusing (429), redirecting, a full connection
pool; and its own edges (nested bodies, header copies, replica URLs, the flags `serve --data-parallel`
passes to its front). Each of these failed before its fix (a session-22 review, repro scripts then)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")

from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse, PlainTextResponse, RedirectResponse, StreamingResponse  # noqa: E402

from lmserve.router import app as router_app  # noqa: E402
from lmserve.router.policy import Replica, Router  # noqa: E402
from tests.test_server import serving  # noqa: E402


class Died(Exception):
    """A stand-in replica's process dying mid-response (uvicorn then cuts the connection)."""


def replica(name: str, refuse: bool = False, streams: threading.Semaphore | None = None) -> FastAPI:
    """A stand-in: /health, /metrics; /v1/chat/completions and /v1/messages stream one event, then half of
    another, then die; /v1/completions answers 429 (refuse) or {"served_by": name}, with "cut": true half
    a JSON body, then dies, with "hold": true a stream that waits on `streams`; /old redirects to /new."""
    app = FastAPI()

    @app.get("/health")
    async def health() -> PlainTextResponse:
        return PlainTextResponse("ok")

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse("lmserve_num_requests_running 0\n")

    async def dying(events: list[str]):  # type: ignore[no-untyped-def]
        for e in events:
            yield e
            await asyncio.sleep(0.05)
        raise Died

    @app.post("/v1/chat/completions")
    async def chat() -> StreamingResponse:
        return StreamingResponse(dying(['data: {"choices": [{"index": 0, "delta": {"content": "a"}}]}\n\n',
                                        'data: {"choices": [{"index": 0, "delta": {"content": "b']),
                                 media_type="text/event-stream")

    @app.post("/v1/messages")
    async def messages() -> StreamingResponse:
        return StreamingResponse(dying(['event: message_start\ndata: {"type": "message_start"}\n\n',
                                        'event: content_block_delta\ndata: {"type": "content_bl']),
                                 media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):  # type: ignore[no-untyped-def]
        body = await request.json()
        if refuse:
            return JSONResponse({"error": {"message": "queue full"}}, 429, headers={"Retry-After": "1"})
        if body.get("cut"):
            return StreamingResponse(dying(['{"served_by": "', name]), media_type="application/json")
        if body.get("hold"):
            async def held():  # type: ignore[no-untyped-def]
                yield "data: {}\n\n"
                while not streams.acquire(blocking=False):  # type: ignore[union-attr]
                    await asyncio.sleep(0.05)
            return StreamingResponse(held(), media_type="text/event-stream")
        return JSONResponse({"served_by": name})

    @app.get("/echo/{rest:path}")
    async def echo(request: Request) -> JSONResponse:  # the path and query as this replica received them
        return JSONResponse({"raw": request.scope["raw_path"].decode(), "query": request.scope["query_string"].decode()})

    @app.post("/old")
    async def old(request: Request) -> RedirectResponse:  # absolute, from its own address, as redirect_slashes
        return RedirectResponse(str(request.base_url) + "new", 307)

    return app


def front(*urls: str, **kw) -> FastAPI:  # type: ignore[no-untyped-def]
    return router_app.build_router_app(Router([Replica(u) for u in urls], "least-load"), health_interval=0.1, **kw)


def events(raw: str) -> list[str]:
    """The data of each whole SSE event."""
    return ["\n".join(x[6:] for x in e.split("\n") if x.startswith("data: ")) for e in raw.split("\n\n") if e.strip()]


def test_a_replica_dying_mid_stream_ends_it_in_the_streams_own_api():
    """Half an event is held back, not glued to the error event (the OpenAI SDK raised a JSONDecodeError
    on the glued text); the error then [DONE] as the server's own error path; on /v1/messages Anthropic's
    `event: error` (the SDK skipped an unnamed event: the stream looked complete), and the router's own
    errors there in Anthropic's shape."""
    with serving(replica("a")) as (rep, _), serving(front(rep, max_body_bytes=1000)) as (url, _):
        time.sleep(0.3)
        raw = httpx.post(url + "/v1/chat/completions", json={"stream": True}).text
        data = events(raw)
        assert [json.loads(d) for d in data[:-1]][0]["choices"][0]["delta"]["content"] == "a"
        assert json.loads(data[1])["error"]["code"] == "replica_failed" and data[2] == "[DONE]" and len(data) == 3
        time.sleep(0.3)  # marked down by the failure, back at the next health check
        raw = httpx.post(url + "/v1/messages", json={"stream": True}).text
        last = raw.strip().split("\n\n")[-1]
        assert last.startswith("event: error\ndata: ")
        assert json.loads(last.split("data: ", 1)[1]) == {"type": "error", "error": {
            "type": "api_error", "message": "the replica serving this stream failed: RemoteProtocolError"}}
        assert all(json.loads(d) for d in events(raw))  # no half event
        big = httpx.post(url + "/v1/messages", content=b"x" * 2000, headers={"content-type": "application/json"})
        assert big.status_code == 413 and big.json()["type"] == "error"
        assert big.json()["error"]["type"] == "request_too_large"


def test_an_unstreamed_body_cut_short_cuts_the_clients_connection():
    """A JSON body the replica died inside: the client's read fails (before: a 200 whose body ended with an
    SSE error event, taken for a whole reply)."""
    with serving(replica("a")) as (rep, _), serving(front(rep)) as (url, _):
        time.sleep(0.3)
        with pytest.raises(httpx.HTTPError):
            httpx.post(url + "/v1/completions", json={"cut": True})


def test_a_refusal_goes_to_a_replica_that_has_not_refused():
    """429 (with Retry-After: it did not run the request) from one replica: the other serves it; both
    refusing: the client gets the 429 (before, every 429 came back while a replica sat idle)."""
    with serving(replica("busy", refuse=True)) as (busy, _), serving(replica("idle")) as (idle, _):
        with serving(front(busy, idle)) as (url, _):
            time.sleep(0.3)
            got = [httpx.post(url + "/v1/completions", json={}) for _ in range(4)]
            assert [r.json()["served_by"] for r in got] == ["idle"] * 4
        with serving(replica("busy2", refuse=True)) as (busy2, _), serving(front(busy, busy2)) as (url, _):
            time.sleep(0.3)
            r = httpx.post(url + "/v1/completions", json={})
            assert r.status_code == 429 and r.headers["retry-after"] == "1"


def test_a_full_connection_pool_is_the_routers_limit_not_a_dead_replica(monkeypatch):
    """max_connections streams open: health checks still pass (they have their own connections: before,
    they timed out on the forwarding pool and every replica was marked down), and a new request gets a
    503 with Retry-After once it has waited POOL_WAIT_S; when a stream ends, requests go through again."""
    monkeypatch.setattr(router_app, "POOL_WAIT_S", 0.3)
    release = threading.Semaphore(0)
    with serving(replica("a", streams=release)) as (rep, _), serving(front(rep, max_connections=2)) as (url, _):
        time.sleep(0.3)
        clients = [httpx.Client(timeout=30) for _ in range(2)]
        streams = [c.stream("POST", url + "/v1/completions", json={"hold": True}) for c in clients]
        for s in streams:
            s.__enter__()
        try:
            time.sleep(0.5)  # several health checks
            assert httpx.get(url + "/health").status_code == 200
            r = httpx.post(url + "/v1/completions", json={})
            assert r.status_code == 503 and r.headers["retry-after"] == "1" and "in use" in r.json()["error"]["message"]
            release.release()
            deadline = time.monotonic() + 5
            while (r := httpx.post(url + "/v1/completions", json={})).status_code != 200:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        finally:
            release.release()
            for s, c in zip(streams, clients):
                s.__exit__(None, None, None)
                c.close()


def test_redirects_headers_and_nested_bodies():
    """A replica's redirect names the router (it named the replica: clients went around the router); one
    Date and one Server header, Content-Length kept; a body nested past json's depth gets the replica's
    answer (the routing text raised RecursionError: a plain-text 500)."""
    with serving(replica("a")) as (rep, _), serving(front(rep)) as (url, _):
        time.sleep(0.3)
        r = httpx.post(url + "/old", json={})
        assert r.status_code == 307 and r.headers["location"] == url + "/new"
        r = httpx.post(url + "/v1/completions", json={})
        names = [k for k, _ in r.headers.multi_items()]
        assert names.count("date") == 1 and names.count("server") == 1
        assert int(r.headers["content-length"]) == len(r.content)
        deep = b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"
        r = httpx.post(url + "/v1/chat/completions", content=deep, headers={"content-type": "application/json"})
        assert r.status_code == 200 and events(r.text)[-1] == "[DONE]"  # the stand-in's answer, forwarded


def test_replica_urls_are_checked_and_serve_passes_its_limits_to_the_front(monkeypatch):
    """A replica URL without a scheme is refused at start (it was taken and never became healthy);
    `serve --data-parallel` gives its front its --max-body-bytes, --upstream-timeout (0: none) and
    --shutdown-timeout (the front kept 4 MiB and 600 s), and SIGTERM stops the replicas as the front's
    shutdown starts, so their drain reaches the clients (they were stopped after it)."""
    import argparse
    import signal

    import uvicorn

    from lmserve.router import cli
    from lmserve.server.cli import add_parser
    with pytest.raises(ValueError, match="--replica: 'localhost:8000'"):
        cli.check_url("localhost:8000", "--replica")
    assert cli.check_url("http://127.0.0.1:8000/", "--replica") == "http://127.0.0.1:8000"
    sub = argparse.ArgumentParser().add_subparsers()
    add_parser(sub)
    a = sub.choices["serve"].parse_args(["--data-parallel", "2", "--max-body-bytes", str(16 << 20),
                                         "--upstream-timeout", "0", "--shutdown-timeout", "7"])
    seen: dict = {}
    monkeypatch.setattr(router_app, "build_router_app", lambda *args: seen.setdefault("args", args))

    def run(self, *args) -> None:  # type: ignore[no-untyped-def]
        seen["grace"] = self.config.timeout_graceful_shutdown
        self.handle_exit(signal.SIGTERM, None)
    monkeypatch.setattr(uvicorn.Server, "run", run)
    stopped: list[bool] = []
    prev = signal.getsignal(signal.SIGTERM)
    try:
        cli.serve_router(["http://127.0.0.1:1"], a, on_exit=lambda: stopped.append(True))
    finally:
        signal.signal(signal.SIGTERM, prev)
    _, _, max_body, timeout, _, conns = seen["args"]
    assert (max_body, timeout, conns, seen["grace"]) == (16 << 20, None, 1024, 17)
    assert stopped == [True]
    assert cli.replica_argv(["--model", "m", "--upstream-timeout", "5", "--max-connections=9", "--port", "1"]) \
        == ["--model", "m"]


def test_the_path_goes_as_sent_and_a_console_view_is_no_load():
    """A percent-encoded '?' in the path reaches the replica encoded (the router decoded it: the rest of
    the path became a query); while the replica handles it, a GET (the web console's engine view, a
    long-lived stream) counts no load on it, a generating request counts one (views skewed least-load
    and prefix routing)."""
    seen: list[int] = []
    app = FastAPI()

    @app.get("/health")
    async def health() -> PlainTextResponse:
        return PlainTextResponse("ok")

    @app.get("/echo/{rest:path}")
    async def echo(request: Request) -> JSONResponse:
        return JSONResponse({"raw": request.scope["raw_path"].decode(), "query": request.scope["query_string"].decode()})

    @app.api_route("/v1/{rest:path}", methods=["GET", "POST"])
    async def observe() -> JSONResponse:  # the router's count for this replica while it handles the request
        seen.append(router.replicas[0].in_flight)
        return JSONResponse({})
    app.add_api_route("/invocations", observe, methods=["POST"])  # (SageMaker's: generating too)
    with serving(app) as (rep, _):
        router = Router([Replica(rep)], "least-load")
        with serving(router_app.build_router_app(router, health_interval=0.1)) as (url, _):
            time.sleep(0.3)
            assert httpx.get(url + "/echo/x%3Fa=1?b=2").json() == {"raw": "/echo/x%3Fa=1", "query": "b=2"}
            httpx.get(url + "/v1/engine/stream")
            httpx.post(url + "/v1/completions", json={})
            httpx.post(url + "/v1/chat/completions", json={})
            httpx.post(url + "/invocations", json={})
    assert seen == [0, 1, 1, 1] and router.replicas[0].in_flight == 0


def test_a_client_gone_during_the_disaggregated_prefill_ends_it_there():
    """The prefill instance is told at once (its connection closes) and the decode replica never gets the
    request (before, the router noticed only when the decode request started)."""
    seen: dict[str, float] = {}
    slow = FastAPI()

    @slow.get("/health")
    async def health() -> PlainTextResponse:
        return PlainTextResponse("ok")

    @slow.post("/v1/completions")
    async def prefill(request: Request) -> JSONResponse:  # a long prompt: 10 s, unless the caller leaves
        for _ in range(200):
            if await request.is_disconnected():
                seen["gone"] = time.monotonic()
                break
            await asyncio.sleep(0.05)
        return JSONResponse({})
    with serving(slow) as (pre, _), serving(replica("decode")) as (dec, _):
        decode = Router([Replica(dec)], "least-load")
        app = router_app.build_router_app(decode, 0.1, prefill=Router([Replica(pre)], "least-load"))
        with serving(app) as (url, _):
            time.sleep(0.3)
            t0 = time.monotonic()
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(url + "/v1/completions", json={"prompt": "x"}, timeout=0.5)
            deadline = time.monotonic() + 5
            while "gone" not in seen and time.monotonic() < deadline:
                time.sleep(0.05)
            assert seen["gone"] - t0 < 3
            assert decode.replicas[0].requests == 0 and decode.replicas[0].in_flight == 0


def test_a_cut_streams_last_event_is_in_its_routes_shape():
    """Chat / completions: OpenAI's error then [DONE]; Messages: Anthropic's; Responses: its `error` event
    (it never sends [DONE]); the web console's engine view: the `event: error` its reader looks for (the
    first two only were shaped before; the others got OpenAI chat's)."""
    from lmserve.router.errors import stream_error

    def parse(raw: bytes) -> list[tuple[str | None, str]]:
        out = []
        for e in raw.decode().strip().split("\n\n"):
            lines = dict(x.split(": ", 1) for x in e.split("\n"))
            out.append((lines.get("event"), lines["data"]))
        return out
    chat = parse(stream_error("/v1/chat/completions", "gone"))
    assert json.loads(chat[0][1])["error"]["code"] == "replica_failed" and chat[1] == (None, "[DONE]")
    msg = parse(stream_error("/v1/messages", "gone"))
    assert msg == [("error", json.dumps({"type": "error", "error": {"type": "api_error", "message": "gone"}}))]
    (ev, data), = parse(stream_error("/v1/responses", "gone"))
    assert ev == "error" and json.loads(data)["type"] == "error" and json.loads(data)["code"] == "replica_failed"
    (ev, data), = parse(stream_error("/v1/engine/stream", "gone"))
    assert ev == "error" and json.loads(data) == {"message": "gone"}


def test_a_prefill_instance_that_cannot_push_is_logged_once(caplog):  # type: ignore[no-untyped-def]
    """A prefill instance whose --kv-peer list lacks the decode replica answers 403: the request still
    decodes (the decode replica computes the prompt), and the router says why, once (it was silent:
    only a counter showed that every request fell back)."""
    import logging
    pre = FastAPI()

    @pre.get("/health")
    async def health() -> PlainTextResponse:
        return PlainTextResponse("ok")

    @pre.post("/v1/completions")
    async def refuse() -> JSONResponse:
        return JSONResponse({"error": {"message": "x-lmserve-kv-push: not one of this instance's --kv-peer URLs"}},
                            403)
    with serving(pre) as (pre_url, _), serving(replica("decode")) as (dec, _):
        app = router_app.build_router_app(Router([Replica(dec)], "least-load"), 0.1,
                                          prefill=Router([Replica(pre_url)], "least-load"))
        with serving(app) as (url, _), caplog.at_level(logging.WARNING, logger="lmserve.router"):
            time.sleep(0.3)
            got = [httpx.post(url + "/v1/completions", json={"prompt": "x"}) for _ in range(2)]
            assert [r.json()["served_by"] for r in got] == ["decode", "decode"]
        warnings = [r.getMessage() for r in caplog.records if "could not push KV" in r.getMessage()]
        assert len(warnings) == 1 and "403" in warnings[0] and "--kv-peer" in warnings[0]


def test_the_front_answers_for_cors():
    """With --allowed-origins the router answers a browser's preflight itself (its catch-all route has no
    OPTIONS) and its CORS headers replace a replica's (two Access-Control-Allow-Origin values: a browser
    refuses the answer)."""
    from lmserve.server.cors import Cors
    rep_app = replica("a")

    @rep_app.post("/v1/cors")
    async def cors_reply() -> JSONResponse:
        return JSONResponse({"ok": True}, headers={"Access-Control-Allow-Origin": "*"})

    with serving(rep_app) as (rep, _):
        app = front(rep)
        Cors(allowed_origins=("https://app.example",)).install(app)
        with serving(app) as (url, _):
            time.sleep(0.3)
            origin = {"Origin": "https://app.example"}
            pre = httpx.options(url + "/v1/cors", headers={**origin, "Access-Control-Request-Method": "POST"})
            assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "https://app.example"
            r = httpx.post(url + "/v1/cors", json={}, headers=origin)
            assert r.status_code == 200 and r.headers.get_list("access-control-allow-origin") == ["https://app.example"]
