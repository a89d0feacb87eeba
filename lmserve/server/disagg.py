"""Prefill / decode disaggregation on the server side (`lmserve serve --role prefill|decode`).

A prefill instance, asked with the PUSH_HEADER naming a decode instance it was told it may push to
(`--kv-peer`), runs the request's prompt (one token, thrown away), reads the prompt's full KV blocks
from its prefix cache and POSTs them, as raw bytes (kv/transfer.py: a fixed header and the tensors;
never pickle), to the decode instance's /v1/internal/kv, which writes them into free blocks and
registers them in its prefix cache. The router then sends the request itself to the decode instance:
its prompt hits those blocks, and it computes only the tail and the new tokens.

Trust: what lands in a prefix cache is served to every later request with that prefix, so
/v1/internal/kv takes a transfer only with the shared secret both instances were started with
(`--kv-secret` / LMSERVE_KV_SECRET, compared in constant time), besides the API key; the router never
forwards /v1/internal/ from clients, nor a client's own push or secret headers. A body is read up to
MAX_KV_BYTES, and checked (header fields, token ids, finite values) off the engine thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hmac
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from lmserve.kv.transfer import export_prefix, import_prefix, parse
from lmserve.sequence import SamplingParams, block_salt
from lmserve.server.errors import ApiError

PUSH_HEADER = "x-lmserve-kv-push"  # a decode instance's base URL: prefill here, push the prompt's KV there
SECRET_HEADER = "x-lmserve-kv-secret"  # the instances' shared secret, on a transfer
ROLES = ("both", "prefill", "decode")
MAX_KV_BYTES = 2 << 30  # one transfer's body


def register(app: FastAPI, srv: Any, role: str = "both", peers: tuple[str, ...] = (), secret: str | None = None,
             engine: Any = None) -> None:
    """Give the server its role; a decode instance gets the route that receives KV. A prefill or decode
    role needs the shared secret, and an engine that can move KV (kv/transfer.check_engine)."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    if role != "both":
        if not secret:
            raise ValueError(f"role {role}: give both instances the same --kv-secret (or LMSERVE_KV_SECRET)")
        if engine is None:
            raise ValueError(f"role {role}: the engine is needed to check it can move KV")
        from lmserve.kv.transfer import check_engine, fingerprint
        check_engine(engine)
        srv.kv_model = fingerprint(engine)  # once: the weights never change (a walk over every tensor)
    srv.role, srv.kv_peers, srv.kv_secret = role, tuple(p.rstrip("/") for p in peers), secret
    srv.kv_engine = engine  # parse() reads its static shapes (and the fingerprint given) only, from a worker thread
    if role == "decode":
        app.add_api_route("/v1/internal/kv", functools.partial(receive_kv, srv), methods=["POST"],
                          include_in_schema=False)


async def receive_kv(srv: Any, request: Request) -> Response:
    """POST /v1/internal/kv: a prefill instance's blocks, registered in this instance's prefix cache."""
    given = request.headers.get(SECRET_HEADER, "")
    if not hmac.compare_digest(given.encode(), srv.kv_secret.encode()):
        raise ApiError(403, f"KV transfer: missing or wrong {SECRET_HEADER}", type_="authentication_error")
    chunks, size = [], 0
    async for chunk in request.stream():  # bounded as it arrives (a chunked body has no content-length)
        size += len(chunk)
        if size > MAX_KV_BYTES:
            raise ApiError(413, f"KV transfer over {MAX_KV_BYTES} bytes")
        chunks.append(chunk)
    try:
        parsed = await asyncio.to_thread(parse, srv.kv_engine, b"".join(chunks), srv.kv_model)  # what never changes
    except ValueError as e:
        raise ApiError(400, str(e)) from None
    n = await srv.ae.call(lambda e: import_prefix(e, parsed))
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
    key = request.headers.get("authorization") or (f"Bearer {request.headers['x-api-key']}"
                                                    if "x-api-key" in request.headers else None)
    auth = {"authorization": key} if key else {}
    pushed = 0
    async with httpx.AsyncClient(timeout=600) as client:
        for _, req in one:
            salt = block_salt(req.lora, req.cache_salt)  # a salted or adapter request's blocks, under its hashes
            payload = await srv.ae.call(lambda engine, ids=req.prompt_token_ids, s=salt: export_prefix(engine, ids, srv.kv_model, s))
            try:
                r = await client.post(target + "/v1/internal/kv", content=payload,
                                      headers={**auth, SECRET_HEADER: srv.kv_secret,
                                               "content-type": "application/octet-stream"})
            except httpx.HTTPError as e:
                raise ApiError(502, f"the decode instance {target} could not be reached: {e}") from None
            if r.status_code != 200:
                raise ApiError(502, f"the decode instance refused the KV ({r.status_code}): {r.text[:300]}")
            pushed += r.json()["registered_blocks"]
    return JSONResponse({"object": "prefill", "pushed_blocks": pushed,
                         "prompt_tokens": [len(req.prompt_token_ids) for _, req in one]})
