"""LoRA adapters over HTTP, as vLLM serves them: `--lora-modules name=path` makes each adapter a model a
request may name (`"model": "name"`), listed in /v1/models with the base model as its parent; with
`--allow-runtime-lora-updating`, POST /v1/load_lora_adapter and /v1/unload_lora_adapter add and remove
them while the server runs (vLLM's routes and bodies; vLLM gates them by an environment variable)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import PlainTextResponse

from lmserve.lora import LoRARequest
from lmserve.server.errors import ApiError


def parse_lora_modules(values: list[str] | None) -> list[tuple[str, str, str | None]]:
    """--lora-modules values (NAME=PATH, or vLLM's JSON form {"name": ..., "path": ..., "base_model_name":
    ...}) -> [(name, path, base model name or None: the /v1/models parent)]; ValueError naming the flag."""
    out: list[tuple[str, str, str | None]] = []
    for v in values or []:
        base = None
        if v.lstrip().startswith("{"):
            try:
                d = json.loads(v)
            except ValueError as e:
                raise ValueError(f"lora_modules: {v!r} is not JSON ({e})") from None
            if not isinstance(d, dict) or not isinstance(d.get("name"), str) or not isinstance(d.get("path"), str):
                raise ValueError(f"lora_modules: {v!r} needs string 'name' and 'path'")
            if not isinstance(d.get("base_model_name"), (str, type(None))):
                raise ValueError(f"lora_modules: {v!r}: base_model_name must be a string")
            name, path, base = d["name"], d["path"], d.get("base_model_name") or None
        else:
            name, sep, path = v.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"lora_modules: {v!r} is not NAME=PATH")
        if any(name == n for n, *_ in out):
            raise ValueError(f"lora_modules: the name {name!r} is given twice")
        out.append((name, path, base))
    return out


class LoRAModules:
    """The server's adapters by name, each a LoRARequest with its own id (the engine loads it on use).
    Read by the request handlers; changed only by the runtime routes (under a lock)."""

    def __init__(self, ae: Any, modules: list[tuple], base_names: tuple[str, ...]) -> None:
        self.ae, self.base_names = ae, base_names
        self.requests: dict[str, LoRARequest] = {}
        self.parents: dict[str, str] = {}  # name -> the base model name --lora-modules gave it (vLLM's)
        self._next_id = 1
        self._loading: set[str] = set()  # names whose files are being read
        self._lock = threading.Lock()
        for name, path, *base in modules:  # (name, path[, base model name])
            self.add(name, path)
            if base and base[0]:
                self.parents[name] = base[0]

    def add(self, name: str, path: str) -> LoRARequest:
        """Load an adapter under `name` (its files are read now, outside the lock, so a bad one is refused
        here); ValueError."""
        with self._lock:
            if name in self.requests or name in self.base_names or name in self._loading:
                raise ValueError(f"lora_name: the name {name!r} is already in use")
            req = LoRARequest(name, self._next_id, path)
            self._next_id += 1
            self._loading.add(name)
        try:
            self.ae.load_lora(req)
            with self._lock:
                self.requests[name] = req
        finally:
            with self._lock:
                self._loading.discard(name)
        return req

    def remove(self, name: str) -> LoRARequest:
        with self._lock:
            req = self.requests.pop(name, None)
            if req is None:
                raise ValueError(f"lora_name: no adapter {name!r} is loaded")
            self.parents.pop(name, None)  # (a runtime load under the name is the served model's)
            self.ae.unload_lora(req.lora_int_id)
            return req

    def get(self, name: str | None) -> LoRARequest | None:
        return self.requests.get(name) if name is not None else None

    def cards(self, root_parent: str, max_model_len: int) -> list[dict[str, Any]]:
        """The adapters' /v1/models entries (vLLM's: root is the adapter's path, parent the base model:
        the one --lora-modules named, else the served model)."""
        return [model_card(name, req.lora_path, self.parents.get(name, root_parent), max_model_len)
                for name, req in list(self.requests.items())]


def model_card(name: str, root: str, parent: str | None, max_model_len: int) -> dict[str, Any]:
    """A /v1/models entry, as vLLM's ModelCard (parent: the base model of an adapter, else None)."""
    now = int(time.time())
    return {"id": name, "object": "model", "created": now, "owned_by": "lmserve", "root": root, "parent": parent,
            "max_model_len": max_model_len, "permission": [{
                "id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission", "created": now,
                "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False, "organization": "*",
                "group": None, "is_blocking": False}]}


def register(app: Any, srv: Any) -> None:
    """The runtime routes, when the server allows them."""
    def field(data: dict[str, Any], name: str) -> str:
        v = data.get(name)
        if not isinstance(v, str) or not v:
            raise ApiError(400, f"{name}: must be a non-empty string", param=name)
        return v

    async def load(request: Request) -> Any:
        data = await srv.read_json(request)
        name, path = field(data, "lora_name"), field(data, "lora_path")
        if not Path(path).is_dir():  # as vLLM answers "No adapter found": a 404 (a bad adapter is a 400)
            raise ApiError(404, f"lora_path: no adapter found at {path!r}", "NotFoundError", param="lora_path")
        try:
            await asyncio.to_thread(srv.loras.add, name, path)
        except ValueError as e:
            raise ApiError.invalid(e) from None
        app.openapi_schema = None  # (the document's model names)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(request: Request) -> Any:
        data = await srv.read_json(request)
        name = field(data, "lora_name")
        try:
            await asyncio.to_thread(srv.loras.remove, name)
        except ValueError as e:
            raise ApiError(404, str(e), param="lora_name", code="model_not_found") from None
        app.openapi_schema = None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    body = {"requestBody": {"required": True, "content": {"application/json": {"schema": {"type": "object"}}}}}
    text = {200: {"content": {"text/plain": {}}, "description": "done"}}
    app.add_api_route("/v1/load_lora_adapter", load, methods=["POST"], openapi_extra=body, responses=text)
    app.add_api_route("/v1/unload_lora_adapter", unload, methods=["POST"], openapi_extra=body, responses=text)
