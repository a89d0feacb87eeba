"""The server as users run it: `lmserve serve` in its own process; SIGTERM; a dead engine loop."""

from __future__ import annotations

import json
import os
import shutil
import signal
import ssl
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


def test_a_port_in_use_is_said_before_the_model_loads(tmp_path):  # type: ignore[no-untyped-def]
    """The socket is bound before the engine is built: a busy port is the first error (it came after a
    whole model load), named by its flag. The model here does not exist, so a load first would fail on it."""
    import socket
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    try:
        proc = subprocess.run([sys.executable, "-m", "lmserve.cli", "serve", "--port", str(busy.getsockname()[1]),
                               "--model", str(tmp_path / "no-such-model")], capture_output=True, text=True, timeout=120)
    finally:
        busy.close()
    assert proc.returncode == 2 and "--port" in proc.stderr and "no-such-model" not in proc.stderr, proc.stderr


def _certificate(tmp_path, name: str) -> tuple[str, str]:  # type: ignore[no-untyped-def]
    """A self-signed certificate for 127.0.0.1 and its key (PEM files), made by the openssl command."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("no openssl command to make a test certificate with")
    key, cert = str(tmp_path / f"{name}.key"), str(tmp_path / f"{name}.pem")
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert, "-days",
                    "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"], check=True,
                   capture_output=True)
    return key, cert


def test_https_with_the_servers_certificate(tiny_models, tmp_path):  # type: ignore[no-untyped-def]
    """--ssl-certfile / --ssl-keyfile (vLLM's flags): the API over HTTPS to a client that trusts the
    certificate; a client that does not, or one speaking plain HTTP, gets nothing. A missing half or a key
    that is not the certificate's is said, naming the flags, before the model loads (the model here does
    not exist)."""
    key, cert = _certificate(tmp_path, "a")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "lmserve.cli", "serve", "--model", str(tiny_models["llama"][0]),
                             "--port", str(port), "--ssl-keyfile", key, "--ssl-certfile", cert, "--no-web-ui"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url, trust = f"https://127.0.0.1:{port}", ssl.create_default_context(cafile=cert)
    try:
        wait_healthy(url, proc, verify=trust)
        r = httpx.post(url + "/v1/completions", json={"prompt": [5, 17, 33], "max_tokens": 3, "ignore_eos": True},
                       verify=trust, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(url + "/health", timeout=5)  # (the system's CAs do not vouch for it)
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
    finally:
        proc.terminate()
        out = proc.communicate(timeout=60)[0]
    assert f"on https://127.0.0.1:{port}" in out, out
    other_key, _ = _certificate(tmp_path, "b")
    import argparse

    from lmserve.server.tls import add_tls_args, tls_from_args
    parser = argparse.ArgumentParser()
    add_tls_args(parser)
    both = tmp_path / "both.pem"  # a certificate file holding its key too (uvicorn's and vLLM's form)
    both.write_text(open(cert).read() + open(key).read())
    assert tls_from_args(parser.parse_args(["--ssl-certfile", str(both)]))["ssl_certfile"] == str(both)
    for flags, said in ((["--ssl-keyfile", key], "ssl_certfile: --ssl-keyfile needs the certificate"),
                        (["--ssl-certfile", cert], "ssl_certfile / ssl_keyfile: cannot load"),
                        (["--ssl-keyfile", key, "--ssl-certfile", cert, "--ssl-cert-reqs", "2"], "ssl_ca_certs: "),
                        (["--ssl-ca-certs", cert], "ssl_ca_certs: needs HTTPS"),
                        (["--ssl-keyfile", key, "--ssl-certfile", key], "ssl_certfile / ssl_keyfile: cannot load")):
        with pytest.raises(ValueError, match=said):
            tls_from_args(parser.parse_args(flags))
    from lmserve.router.cli import replica_argv  # --data-parallel: the front serves HTTPS, its replicas plain HTTP
    assert replica_argv(["--ssl-keyfile", key, "--model", "m", "--ssl-certfile=" + cert, "--ssl-cert-reqs", "0"]) \
        == ["--model", "m"]
    port = free_port()
    front = subprocess.Popen([sys.executable, "-m", "lmserve.cli", "router", "--replica",
                              f"http://127.0.0.1:{free_port()}", "--port", str(port), "--ssl-keyfile", key,
                              "--ssl-certfile", cert],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:  # (its replica is not there: its /health says so, over HTTPS)
        for _ in range(300):
            try:
                r = httpx.get(f"https://127.0.0.1:{port}/health", verify=trust, timeout=1)
                break
            except httpx.ConnectError:
                assert front.poll() is None, front.communicate()[0]
                time.sleep(0.1)
        else:
            raise AssertionError("the router did not come up")
        assert r.status_code == 503
    finally:
        front.terminate()
        front.communicate(timeout=60)
    # the command checks them first: no model load, no replica started, on a key that is not the certificate's
    p = subprocess.run([sys.executable, "-m", "lmserve.cli", "serve", "--model", str(tmp_path / "no-such-model"),
                        "--port", str(free_port()), "--ssl-keyfile", other_key, "--ssl-certfile", cert,
                        "--data-parallel", "2"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "ssl_certfile / ssl_keyfile: cannot load" in p.stderr, p.stderr
    assert "no-such-model" not in p.stderr and "replica" not in p.stderr, p.stderr


def test_sigterm_past_the_shutdown_timeout_ends_streams_with_an_error_and_views_at_once(tiny_models):  # type: ignore[no-untyped-def]
    """SIGTERM with a stream still running (32 prompts of 2,000 tokens) under --shutdown-timeout 0 and a
    web console view open: the view ends at once with its error event (an open view held every shutdown
    for the whole 30 s), the stream ends after the timeout with an error event and [DONE] (uvicorn cut
    it off mid-body at 30 s), and the process exits 0 soon after."""
    path, _ = tiny_models["llama"]
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "lmserve.cli", "serve", "--port", str(port), "--model", str(path),
                             "--shutdown-timeout", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    lines: dict[str, list[str]] = {"stream": [], "view": []}
    try:
        wait_healthy(url, proc)

        def read(name: str, method: str, path: str, **kw) -> None:  # type: ignore[no-untyped-def]
            with httpx.stream(method, url + path, timeout=60, **kw) as r:
                for line in r.iter_lines():
                    lines[name].append(line)

        ths = [threading.Thread(target=read, args=("stream", "POST", "/v1/completions"), kwargs={"json": {
                   "prompt": [[5, 6, i] for i in range(32)], "max_tokens": 2000, "ignore_eos": True, "stream": True}}),
               threading.Thread(target=read, args=("view", "GET", "/v1/engine/stream"))]
        def running() -> bool:  # the view shows the requests under way (the tiny model has no tokenizer:
            return any(x.startswith("data: {") and json.loads(x[6:])["num_running"] > 0  # no text chunks)
                       for x in lines["view"])
        ths[1].start()
        ths[0].start()
        for _ in range(600):
            if running():
                break
            time.sleep(0.05)
        assert running() and ths[0].is_alive()
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        ths[1].join(10)
        assert not ths[1].is_alive() and "event: error" in lines["view"], lines["view"][-3:]
        ths[0].join(30)
        assert proc.wait(30) == 0
        assert time.monotonic() - t0 < 15
        data = [x for x in lines["stream"] if x.startswith("data: ")]
        assert data[-1] == "data: [DONE]" and "shutting down" in data[-2], data[-3:]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_an_offload_folder_outlives_the_server(tiny_models, tmp_path):  # type: ignore[no-untyped-def]
    """--kv-offloading-dir: SIGTERM writes the pool's cached blocks; the next server reads them back, so its
    first request with that prompt computes only the last token (the prefix-cache and offload metrics)."""
    prompt = [(7 * i) % 120 + 4 for i in range(41)]
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "logprobs": 2}
    outs = []
    for _ in range(2):
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "lmserve.cli", "serve", "--model", str(tiny_models["llama"][0]),
                                 "--port", str(port), "--no-web-ui", "--block-size", "4", "--kv-offloading-size",
                                 "16MiB", "--kv-offloading-dir", str(tmp_path)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, proc)
            metrics = httpx.get(url + "/metrics", timeout=10).text  # before: no hit yet
            r = httpx.post(url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            if not outs:  # the first server: the prompt again, a hit in its own pool (what a hit gives)
                r = httpx.post(url + "/v1/completions", json=body, timeout=60)
            else:
                metrics = httpx.get(url + "/metrics", timeout=10).text
            outs.append((r.json(), metrics))
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
            out = proc.stdout.read() if proc.stdout else ""
        assert "Traceback" not in out, out
    (first, before), (second, metrics) = outs  # first: the first server's pool hit
    assert "lmserve_prefix_cache_hit_tokens_total 0.0" in before
    assert "lmserve_prefix_cache_hit_tokens_total 40.0" in metrics and "lmserve_kv_offload_hit_tokens_total 40.0" in metrics
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    assert second["choices"][0]["logprobs"] == first["choices"][0]["logprobs"]
