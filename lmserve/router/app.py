"""The router's app: an OpenAI-compatible front that forwards each request to one replica (policy.py).

Forwarding is byte-for-byte: the request's body and headers (Authorization included: the replicas
check the key) go to the replica as they came, and its status, headers and body come back as they
are, a stream chunk by chunk, so a client sees what the replica said, its 4xx errors included. The
router reads a body only to find its routing text and whether it streams.

Disaggregation (`prefill`: a second Router over prefill instances): a generating request first goes,
not streamed, to a prefill instance with the header naming the decode replica picked for it; that
instance runs the prompt and pushes its KV blocks to the decode replica (server/disagg.py); then the
request goes to the decode replica as usual, where its prompt hits those blocks. A prefill that fails
is counted and skipped: the decode replica then computes the prompt itself.

Failures: a replica that cannot be reached, or drops a request before its first byte reached the
client, is marked down and the request goes to the next one (`retries`). A replica that is only slow
(no byte within the read timeout) is not down: the client gets a 504 and nothing is retried (the
request may have run). A client that leaves before the first byte ends the request at the replica
too (the upstream connection closes, and the replica aborts it); once bytes were streamed,
a replica that dies ends the stream with an SSE error event (`replica_failed`), since a generation
cannot be resumed elsewhere (an event in the stream's own API: OpenAI's error then [DONE], Anthropic's
`event: error`; an unstreamed body cut short is a cut connection, never a complete-looking reply). A
replica that refuses (429, or 503 with Retry-After: the request did not run) sends the request to another
replica that has not refused it; when all have, the client gets the last refusal. A background task
polls each replica's /health and /metrics (running + waiting: the load `least-load` and `prefix`
balance on) over its own connections (the forwarding pool may be full) and brings replicas back when
they answer. Each replica has its own pool of `max_connections`; a request waits up to POOL_WAIT_S at a
full pool, then tries the next replica; when every pool was full, a 503 with Retry-After (the router is
at its limit, the replicas are not down).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from urllib.parse import quote

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from lmserve.router.errors import error, stream_error
from lmserve.router.health import LORA_ROUTES, Adapters, check
from lmserve.router.policy import Replica, Router, routing_text

GENERATING = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages")
PUSH_HEADER = "x-lmserve-kv-push"  # = lmserve.server.disagg.PUSH_HEADER (the router does not import the server)
HOP = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "upgrade",
       "proxy-authorization", "proxy-connection", "trailer"}
NOT_FROM_CLIENTS = HOP | {PUSH_HEADER, "x-lmserve-kv-secret"}  # the instances' own headers
NOT_TO_CLIENTS = (HOP - {"content-length"}) | {"date", "server"}  # uvicorn writes its own date and server
SLOW = (httpx.ReadTimeout, httpx.WriteTimeout)  # a replica that answers slowly: not a replica that is down
POOL_WAIT_S = 5.0  # a request waits this long for a free connection to its replica
log = logging.getLogger("lmserve.router")
BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
def _after(data: bytes, sep: bytes) -> int:
    """The index just after sep's last occurrence in data (0: none)."""
    i = data.rfind(sep)
    return i + len(sep) if i >= 0 else 0


async def _chain(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    if first:
        yield first
    async for chunk in rest:
        yield chunk


class _Metrics:
    def __init__(self, router: Router, prefill: Router | None) -> None:
        self.registry = r = CollectorRegistry()
        self.router = router
        self.everyone = router.replicas + (prefill.replicas if prefill is not None else [])
        self.requests = Counter("lmserve_router_requests", "Requests routed, by replica", ["replica"], registry=r)
        self.retries = Counter("lmserve_router_retries", "Requests sent to another replica after one failed", registry=r)
        self.broken = Counter("lmserve_router_failed_streams", "Streams cut by a replica failure after bytes were sent",
                              registry=r)
        self.queue = Histogram("lmserve_router_queue_seconds", "Arrival to the replica's response headers",
                               buckets=BUCKETS, registry=r)
        self.prefills = Counter("lmserve_router_prefills", "Disaggregated prefills by outcome (pushed, failed, "
                                "skipped: no prefill instance up)", ["outcome"], registry=r)
        self.prefill_time = Histogram("lmserve_router_prefill_seconds", "A prefill and its KV push",
                                      buckets=BUCKETS, registry=r)
        r.register(self)

    def collect(self):  # type: ignore[no-untyped-def]
        up = GaugeMetricFamily("lmserve_router_replica_up", "1 while the replica answers its health check",
                               labels=["replica"])
        load = GaugeMetricFamily("lmserve_router_replica_load", "Requests in flight or queued at the replica",
                                 labels=["replica"])
        for rep in self.everyone:  # prefill instances too
            up.add_metric([rep.url], 1.0 if rep.healthy else 0.0)
            load.add_metric([rep.url], float(rep.load))
        yield up
        yield load
        yield GaugeMetricFamily("lmserve_router_prefix_hit_rate", "Prompt prefix characters matched as routed / "
                                "looked up (policy prefix)", value=self.router.prefix_hit_rate)


def build_router_app(router: Router, health_interval: float = 1.0, max_body_bytes: int = 4 << 20,
                     timeout: float | None = 600.0, prefill: Router | None = None,
                     max_connections: int = 1024) -> FastAPI:
    """The router's FastAPI app over `router` (replicas start down until their first health check);
    with `prefill`, its replicas prefill for `router`'s, which decode (disaggregation). timeout: seconds a
    replica may send nothing before the client gets a 504 (None: no limit); max_connections: open
    connections to each replica (a stream holds one)."""
    metrics = _Metrics(router, prefill)
    state: dict[str, Any] = {}
    everyone = router.replicas + (prefill.replicas if prefill is not None else [])
    warned: set[tuple[str, int]] = set()  # (prefill instance, status) whose failed pushes were logged
    adapters = Adapters()  # runtime LoRA loads: on every replica alike

    async def health_loop() -> None:
        while True:
            await asyncio.gather(*(adapters.checked(state["health"], state, r) for r in everyone))
            await asyncio.sleep(health_interval)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):  # type: ignore[no-untyped-def]
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=min(256, max_connections))
        async with contextlib.AsyncExitStack() as stack:
            state["health"] = await stack.enter_async_context(httpx.AsyncClient(limits=httpx.Limits(
                max_connections=2 * len(everyone))))
            for rep in everyone:  # a pool a replica: one replica's streams never starve another's requests
                state[rep.url] = await stack.enter_async_context(httpx.AsyncClient(
                    timeout=httpx.Timeout(timeout, connect=5.0, pool=POOL_WAIT_S), limits=limits))
            await asyncio.gather(*(check(state["health"], r) for r in everyone))
            task = asyncio.create_task(health_loop())
            try:
                yield
            finally:
                task.cancel()

    app = FastAPI(title="lmserve router", lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> Response:  # a 405: the replicas' body
        return error(e.status_code, str(e.detail), None, getattr(e, "headers", None), path=request.scope["path"])

    @app.exception_handler(Exception)
    async def failed(request: Request, e: Exception) -> Response:  # a router bug: still a JSON error
        return error(500, f"router error: {type(e).__name__}", "router_error", path=request.url.path)

    @app.get("/health")
    async def health() -> Response:
        if router.healthy():
            return PlainTextResponse("ok")
        return error(503, "no replica is healthy", "no_healthy_replica", {"Retry-After": "1"})

    @app.get("/metrics")
    async def prom() -> Response:
        return Response(generate_latest(metrics.registry), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def forward(request: Request, path: str) -> Response:
        where = "/" + path
        if any(seg in (".", "..") for seg in path.split("/")):  # the upstream would collapse them: /x/../v1/...
            return error(400, "dot segments are not allowed in the path", "bad_path", path=where)
        if path.startswith("v1/internal"):  # between instances only, never from a client
            return error(404, "Not Found", "not_found", path=where)
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > max_body_bytes:
            return error(413, f"request body of {size} bytes exceeds the limit of {max_body_bytes}", "request_too_large",
                         path=where)  # (the replicas' words)
        parts, total = [], 0
        async for chunk in request.stream():  # bounded as it arrives (a chunked body has no length)
            total += len(chunk)
            if total > max_body_bytes:
                return error(413, f"request body exceeds the limit of {max_body_bytes} bytes", "request_too_large",
                             path=where)
            parts.append(chunk)
        body = b"".join(parts)
        try:
            parsed = json.loads(body) if body else None
        except (ValueError, RecursionError):
            parsed = None  # the replica will say what is wrong with it
        text = routing_text("/" + path, parsed)
        headers = [(k, v) for k, v in request.headers.raw if k.decode("latin-1").lower() not in NOT_FROM_CLIENTS]
        raw = request.scope.get("raw_path") or where.encode()  # as sent: %3F stays %3F (decoded, it was a query)
        url = quote(raw, safe="/%!$&'()*+,;=:@-._~") + (f"?{request.url.query}" if request.url.query else "")
        if request.method == "POST" and where in LORA_ROUTES:  # every replica's, not one's
            return await adapters.update(state, everyone, where, headers, body)
        t0, first = time.monotonic(), None
        if prefill is not None and request.method == "POST" and "/" + path in GENERATING and isinstance(parsed, dict):
            first = router.pick(text)  # the decode replica, told to the prefill instance
            if first is not None and not await unless_gone(request, prefill_for(first, url, headers, parsed, text)):
                return error(499, "client disconnected", "client_disconnected", path=where)  # prefill aborted
        return await send(request, url, headers, body, text, t0, first)

    async def prefill_for(decode: Replica, url: str, headers: list, parsed: dict, text: str) -> None:
        assert prefill is not None
        rep = prefill.pick(text)
        if rep is None:
            metrics.prefills.labels("skipped").inc()
            return
        t0 = time.monotonic()
        body = json.dumps({k: v for k, v in parsed.items() if k != "stream_options"} | {"stream": False}).encode()
        rep.in_flight += 1
        decode.in_flight += 1  # it will take this request: the next pick must see that
        try:
            r = await state[rep.url].post(rep.url + url, content=body, headers=[
                *((k, v) for k, v in headers if k.lower() != b"content-type"), (b"content-type", b"application/json"),
                (PUSH_HEADER, decode.url)])
            ok = r.status_code == 200
            if r.status_code in (403, 502) and (rep.url, r.status_code) not in warned:  # its --kv-peer / secret
                warned.add((rep.url, r.status_code))
                log.warning("prefill on %s could not push KV (%d: %s); the decode replicas compute prompts "
                            "themselves", rep.url, r.status_code, r.text[:300])
        except (*SLOW, httpx.PoolTimeout):  # slow or busy, not down: the decode replica computes the prompt itself
            ok = False
        except httpx.TransportError:
            rep.mark_down()
            ok = False
        finally:
            rep.in_flight -= 1
            decode.in_flight -= 1
        metrics.prefills.labels("pushed" if ok else "failed").inc()
        metrics.prefill_time.observe(time.monotonic() - t0)

    async def send(request: Request, url: str, headers: list, body: bytes, text: str, t0: float,
                   first: Replica | None = None) -> Response:
        tried: set[str] = set()
        busy = 0  # replicas whose connection pool was full
        refusal: Response | None = None  # the last replica's refusal, the answer when no replica is left
        path = request.scope["path"]  # (request.url is rebuilt from the Host header)
        weight = int(request.method == "POST" and path in (*GENERATING, "/invocations"))  # its load (a console view: none)
        while True:
            rep = first if first is not None and first.healthy and not tried else router.pick(text, tried)
            if rep is None:
                if refusal is not None:
                    return refusal
                what = ("every replica's connections are in use" if busy == len(tried) and tried else
                        "every replica failed this request" if tried else "no replica is healthy")
                return error(503, what, "no_healthy_replica", {"Retry-After": "1"}, path=path)
            if tried:
                metrics.retries.inc()
            tried.add(rep.url)
            rep.in_flight += weight
            rep.requests += 1
            metrics.requests.labels(rep.url).inc()
            opened: list[httpx.Response] = []
            client: httpx.AsyncClient = state[rep.url]

            async def start() -> tuple[httpx.Response, AsyncIterator[bytes], bytes]:
                up = await client.send(client.build_request(request.method, rep.url + url, headers=headers,
                                                            content=body), stream=True)
                opened.append(up)
                metrics.queue.observe(time.monotonic() - t0)
                chunks = up.aiter_raw()
                return up, chunks, await anext(chunks, b"")  # nothing reached the client yet: a failure retries

            task = asyncio.ensure_future(start())
            try:  # an unstreamed answer comes whole: a client gone meanwhile ends it at the replica
                if not await unless_gone(request, task):
                    raise ClientGone
                upstream, chunks, head = task.result()
            except BaseException as e:
                task.cancel()
                rep.in_flight -= weight
                for up in opened:  # the closed connection aborts the request at the replica
                    await up.aclose()
                if isinstance(e, ClientGone):
                    return error(499, "client disconnected", "client_disconnected", path=path)
                if isinstance(e, SLOW):  # slow, not down (its health check says which): no retry, it may have run
                    return error(504, f"the replica sent nothing for {timeout:g} s", "replica_timeout", path=path)
                if isinstance(e, httpx.PoolTimeout):  # the router's own limit: try another, not a failure
                    busy += 1
                    continue
                if not isinstance(e, httpx.TransportError):
                    raise
                rep.mark_down()
                continue
            if refused(upstream) and router.healthy(tried):  # it did not run the request: another may
                rep.in_flight -= weight
                refusal = Response(head + b"".join([c async for c in chunks]), upstream.status_code,
                                   {k: v for k, v in upstream.headers.items() if k.lower() not in NOT_TO_CLIENTS})
                await upstream.aclose()
                continue
            out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in NOT_TO_CLIENTS}
            if out_headers.get("location", "").startswith(rep.url):  # a redirect names the router, not the replica
                out_headers["location"] = str(request.base_url).rstrip("/") + out_headers["location"][len(rep.url):]
            done = _Once(rep, upstream, weight)
            sse = upstream.headers.get("content-type", "").startswith("text/event-stream")
            return _Relayed(relay(rep, head, chunks, done, path if sse else None), done, upstream.status_code,
                            headers=out_headers)

    async def relay(rep: Replica, first: bytes, chunks: AsyncIterator[bytes], done: "_Once",
                    sse_path: str | None) -> AsyncIterator[bytes]:
        """The replica's bytes as they come; an event stream's whole events only (a half event held back
        is dropped if the replica dies, and the stream's error event takes its place)."""
        held = b""
        try:
            async for chunk in _chain(first, chunks):
                if sse_path is None:
                    yield chunk
                    continue
                held += chunk
                end = max(_after(held, b"\n\n"), _after(held, b"\r\n\r\n"))  # after the last whole event
                if end:
                    out, held = held[:end], held[end:]
                    yield out
            if held:
                yield held
        except httpx.TransportError as e:  # bytes were sent: the request cannot move; say so and end
            if not isinstance(e, SLOW):  # (a slow replica is not a dead one)
                rep.mark_down()
            metrics.broken.inc()
            if sse_path is None:  # a body cut short: cut the client's connection too (not a complete reply)
                raise Cut from e
            yield stream_error(sse_path, f"the replica serving this stream failed: {type(e).__name__}")
        finally:
            await done()

    return app


async def unless_gone(request: Request, work: Any) -> bool:
    """Run a coroutine to its end (True), or cancel it when the client disconnects first (False): its
    upstream connection closes, which aborts the request there."""
    task = asyncio.ensure_future(work)
    try:
        while not (await asyncio.wait({task}, timeout=0.25))[0]:
            if await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
                return False
    finally:  # this handler cancelled (the server's shutdown): the work goes too
        if not task.done():
            task.cancel()
    task.result()
    return True


def refused(up: httpx.Response) -> bool:
    """A replica's answer that says it did not run the request: 429, or 503 with Retry-After (its queue or
    its drain)."""
    return up.status_code == 429 or (up.status_code == 503 and "retry-after" in up.headers)


class ClientGone(Exception):
    """The client disconnected before the replica's first byte."""


class Cut(Exception):
    """A replica died inside an unstreamed body: the client's connection is cut too (_Relayed), so its
    truncated body is not taken for a whole one."""


class _Once:
    """Release a forwarded request's hold (the replica's in-flight count, the upstream connection) once,
    whether its stream ran to the end, failed, or never started (the client left first)."""

    def __init__(self, rep: Replica, upstream: httpx.Response, weight: int) -> None:
        self.rep, self.upstream, self.weight, self.done = rep, upstream, weight, False

    async def __call__(self) -> None:
        if self.done:
            return
        self.done = True
        self.rep.in_flight -= self.weight
        await asyncio.shield(self.upstream.aclose())


class _Relayed(StreamingResponse):
    def __init__(self, content: Any, done: _Once, status_code: int, headers: dict[str, str]) -> None:
        super().__init__(content, status_code, headers=headers)
        self._done = done

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        except* Cut:  # the response stays incomplete: the server closes the connection
            pass
        finally:
            await self._done()
