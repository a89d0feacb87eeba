"""Prefill / decode disaggregation on the server side (`lmserve serve --role prefill|decode`).

A prefill instance, asked with the PUSH_HEADER naming a decode instance it was told it may push to
(`--kv-peer`), runs the request's prompt (one token, thrown away), reads the prompt's full KV blocks
from its prefix cache and POSTs them, as raw bytes (kv/transfer.py: a fixed header and the tensors;
never pickle), to the decode instance's /v1/internal/kv, which writes them into free blocks and
registers them in its prefix cache. The router then sends the request itself to the decode instance:
its prompt hits those blocks, and it computes only the tail and the new tokens. The key the client
sent goes along (every instance checks it: /v1/internal/kv is under /v1).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from lmserve.kv.transfer import export_prefix, import_prefix
from lmserve.sequence import SamplingParams
from lmserve.server.errors import ApiError

PUSH_HEADER = "x-lmserve-kv-push"  # a decode instance's base URL: prefill here, push the prompt's KV there
ROLES = ("both", "prefill", "decode")
MAX_KV_BYTES = 2 << 30  # one transfer's body


def register(app: FastAPI, srv: Any, role: str = "both", peers: tuple[str, ...] = ()) -> None:
    """Give the server its role; a decode instance gets the route that receives KV."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    srv.role, srv.kv_peers = role, tuple(p.rstrip("/") for p in peers)
    if role == "decode":
        app.add_api_route("/v1/internal/kv", functools.partial(receive_kv, srv), methods=["POST"],
                          include_in_schema=False)


async def receive_kv(srv: Any, request: Request) -> Response:
    """POST /v1/internal/kv: a prefill instance's blocks, registered in this instance's prefix cache."""
    size = request.headers.get("content-length", "")
    if size.isdigit() and int(size) > MAX_KV_BYTES:
        raise ApiError(413, f"KV transfer over {MAX_KV_BYTES} bytes")
    payload = await request.body()
    try:
        n = await srv.ae.call(lambda engine: import_prefix(engine, payload))
    except ValueError as e:
        raise ApiError(400, str(e)) from None
    return JSONResponse({"registered_blocks": n})


async def prefill_and_push(srv: Any, request: Request, jobs: list, target: str) -> Response:
    """Run each job's prompt for one token, then push its KV blocks to `target` (a --kv-peer)."""
    import httpx

    target = target.rstrip("/")
    if getattr(srv, "role", "both") != "prefill":
        raise ApiError(400, f"{PUSH_HEADER}: this instance is not a prefill instance (--role prefill)")
    if target not in srv.kv_peers:
        raise ApiError(403, f"{PUSH_HEADER}: {target!r} is not one of this instance's --kv-peer URLs")
    one = [(rid, dataclasses.replace(req, params=SamplingParams(max_tokens=1), grammar=None)) for rid, req in jobs]
    await srv.run_all(request, one)
    auth = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "x-api-key")}
    pushed = 0
    async with httpx.AsyncClient(timeout=600) as client:
        for _, req in one:
            payload = await srv.ae.call(lambda engine, ids=req.prompt_token_ids: export_prefix(engine, ids))
            try:
                r = await client.post(target + "/v1/internal/kv", content=payload,
                                      headers={**auth, "content-type": "application/octet-stream"})
            except httpx.HTTPError as e:
                raise ApiError(502, f"the decode instance {target} could not be reached: {e}") from None
            if r.status_code != 200:
                raise ApiError(502, f"the decode instance refused the KV ({r.status_code}): {r.text[:300]}")
            pushed += r.json()["registered_blocks"]
    return JSONResponse({"object": "prefill", "pushed_blocks": pushed,
                         "prompt_tokens": [len(req.prompt_token_ids) for _, req in one]})
