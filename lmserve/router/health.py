"""The router's view of its replicas' state: their health and load (a check per interval), and the LoRA
adapters loaded through it at run time, which every replica must hold alike."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
from fastapi.responses import Response

from lmserve.router.errors import error
from lmserve.router.policy import Replica

LORA_ROUTES = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")  # vLLM's runtime LoRA updates


def parse_load(metrics_text: str) -> int:
    """running + waiting from a replica's Prometheus text: lmserve's series, else vLLM's (a vLLM server, or
    one engine of it: its gauges carry labels; summed over them)."""
    ours, vllm = 0.0, 0.0
    seen = False
    for line in metrics_text.splitlines():
        series, _, value = line.rpartition(" ")
        name = series.partition("{")[0]
        if name in ("lmserve_num_requests_running", "lmserve_num_requests_waiting"):
            ours, seen = ours + float(value), True
        elif name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
            vllm += float(value)
    return int(ours if seen else vllm)


async def check(client: httpx.AsyncClient, rep: Replica) -> None:
    """One health check: /health 200 -> up (and its load from /metrics); anything else -> down. A request
    that failed on the replica while the check ran wins (the check's 200 may predate the failure)."""
    failures = rep.failures
    try:
        ok = (await client.get(rep.url + "/health", timeout=2.0)).status_code == 200
        if ok:
            rep.reported = parse_load((await client.get(rep.url + "/metrics", timeout=2.0)).text)
    except (httpx.HTTPError, ValueError):
        ok = False
    rep.healthy = ok and rep.failures == failures


class Adapters:
    """Runtime LoRA updates (`--allow-runtime-lora-updating` on the replicas): a load or an unload goes to
    every healthy replica, as vLLM's data parallelism adds an adapter to every engine (sent to one, the
    adapter's requests got 404s from the others), and a replica that comes back up (a restart, or a
    missed health check) is given the unloads it missed, then the loads, before it takes requests."""

    def __init__(self) -> None:
        self.loaded: dict[str, tuple[list, bytes]] = {}  # lora_name -> its load's headers and body, as sent
        # replica url -> {lora_name: the unload's headers and body}: unloads sent while it was down (one that
        # only missed a health check still holds the adapter: it would serve it, and refuse a new one by its name)
        self.missed: dict[str, dict[str, tuple[list, bytes]]] = {}

    async def update(self, clients: dict[str, Any], replicas: list[Replica], path: str, headers: list,
                     body: bytes) -> Response:
        """POST `path` (of LORA_ROUTES) to every healthy replica. The answer: a failure's, if any replica
        failed a load (the others keep the adapter: load it again, or unload it); an unload any replica
        did is done; else the first replica's."""
        up = [r for r in replicas if r.healthy]
        if not up:
            return error(503, "no replica is healthy", "no_healthy_replica", {"Retry-After": "1"}, path=path)
        try:
            name = json.loads(body).get("lora_name")
        except (ValueError, AttributeError, RecursionError):
            name = None

        async def post(rep: Replica) -> httpx.Response | Exception:
            try:
                return await clients[rep.url].post(rep.url + path, content=body, headers=headers)
            except httpx.HTTPError as e:
                return e
        answers = await asyncio.gather(*(post(r) for r in up))
        ok: list[httpx.Response | Exception] = []
        failed: list[httpx.Response | Exception] = []
        for a in answers:
            (ok if isinstance(a, httpx.Response) and a.status_code < 400 else failed).append(a)
        if ok and isinstance(name, str):
            if path == LORA_ROUTES[0]:
                self.loaded[name] = (headers, body)
            else:
                self.loaded.pop(name, None)
                for rep in replicas:
                    if rep not in up:
                        self.missed.setdefault(rep.url, {})[name] = (headers, body)
        answer = ok[0] if ok and (not failed or path == LORA_ROUTES[1]) else failed[0]
        if isinstance(answer, Exception):
            return error(502, f"a replica failed the update: {type(answer).__name__}", "replica_failed", path=path)
        return Response(answer.content, answer.status_code, media_type=answer.headers.get("content-type"))

    async def checked(self, client: httpx.AsyncClient, clients: dict[str, Any], rep: Replica) -> None:
        """A health check (check); a replica that was down and is up gets the unloads it missed (a restarted
        one answers 404 for each: none loaded), then the adapters loaded so far (one that kept them
        answers 400 for each: already loaded)."""
        was = rep.healthy
        await check(client, rep)
        missed = self.missed.get(rep.url, {})
        if rep.healthy and not was and (self.loaded or missed):
            rep.healthy = False  # (no request until it has them)
            for route, sent in [(LORA_ROUTES[1], s) for s in list(missed.values())] + \
                               [(LORA_ROUTES[0], s) for s in list(self.loaded.values())]:
                try:
                    await clients[rep.url].post(rep.url + route, content=sent[1], headers=sent[0])
                except httpx.HTTPError:
                    return  # down again: the next check tries (the missed unloads kept)
            self.missed.pop(rep.url, None)
            rep.healthy = True
