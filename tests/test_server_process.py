"""The server as users run it: `lmserve serve` in its own process; SIGTERM; a dead engine loop."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

pytest.importorskip("uvicorn")

from tests.test_server import free_port, wait_healthy  # noqa: E402


def test_sigterm_finishes_running_requests_and_exits_cleanly():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "lmserve.cli", "serve", "--port", str(port),
                             "--max-header-bytes", "4096", "--max-n", "2", "--no-web-ui"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        # --no-web-ui: no console page, no engine stream
        assert httpx.get(url + "/", timeout=5).status_code == 404
        assert httpx.get(url + "/v1/engine/stream", timeout=5).status_code == 404
        # the limits' flags are in force: a header block past 4 KiB is refused before any routing, n past 2 too
        big = httpx.get(url + "/health", headers={"x-pad": "a" * 8192}, timeout=5)
        assert big.status_code == 431 and "--max-header-bytes" in big.json()["error"]["message"], big.text
        assert httpx.get(url + "/health", headers={"x-pad": "a" * 1024}, timeout=5).status_code == 200
        r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "n": 3}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "n" and "--max-n" in r.json()["error"]["message"]
        chunks: list[dict] = []

        def stream() -> None:
            with httpx.stream("POST", url + "/v1/completions", timeout=60,
                              json={"prompt": "Once upon a time", "max_tokens": 30, "temperature": 0,
                                    "ignore_eos": True, "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunks.append(json.loads(line[6:]))

        th = threading.Thread(target=stream)
        th.start()
        while not chunks:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        th.join(60)
        assert proc.wait(60) == 0
        # the request in flight was finished, not cut off
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert len("".join(c["choices"][0]["text"] for c in chunks)) > 0
        with pytest.raises(httpx.HTTPError):
            httpx.get(url + "/health", timeout=1)
    finally:
        if proc.poll() is None:
            proc.kill()
        out = proc.stdout.read() if proc.stdout else ""
        assert "Traceback" not in out, out


def test_health_503_when_engine_loop_dies(tiny_models, monkeypatch):  # type: ignore[no-untyped-def]
    from starlette.testclient import TestClient

    from lmserve.config import EngineConfig
    from lmserve.engine import Engine
    from lmserve.server.app import build_app
    from lmserve.server.async_engine import AsyncEngine
    path, _ = tiny_models["llama"]
    ae = AsyncEngine(Engine(EngineConfig(model=str(path), kv_cache_memory="32MiB")))
    app = build_app(ae, "tiny")
    with TestClient(app) as c:
        assert c.get("/health").status_code == 200
        r = c.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3

        def die() -> None:
            raise SystemExit("simulated fatal error in the engine loop")

        monkeypatch.setattr(ae, "_drain", die)
        ae._wake.set()
        for _ in range(100):
            if not ae.alive:
                break
            time.sleep(0.05)
        h = c.get("/health")
        assert h.status_code == 503 and h.json()["error"]["type"] == "server_error"
        r = c.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3})
        assert r.status_code == 503
    os.environ.pop("LMSERVE_API_KEY", None)
