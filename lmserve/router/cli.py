"""`lmserve router`: the router in front of running replicas; and `run_data_parallel`, behind
`lmserve serve --data-parallel N`: N engine processes on local ports and the router in front of them."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
from typing import Any

from lmserve.router.policy import POLICIES
from lmserve.server.cors import FLAGS as CORS_FLAGS, add_cors_args, cors_from_args
from lmserve.server.tls import FLAGS as TLS_FLAGS, add_tls_args, scheme, tls_from_args
from lmserve.utils import above, at_least, port_number


def add_parser(sub: Any) -> None:
    p = sub.add_parser("router", help="one OpenAI-compatible front for several lmserve replicas")
    p.add_argument("--replica", action="append", required=True,
                   help="a replica's base URL (repeat for each); with --prefill, the decode instances")
    p.add_argument("--prefill", action="append", default=[],
                   help="a prefill instance's base URL (lmserve serve --role prefill --kv-peer <each replica>)")
    add_router_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port_number, default=8000)
    p.add_argument("--max-body-bytes", type=at_least(1), default=4 << 20, help="request bodies above this get 413 "
                   "(default 4 MiB, as a replica's)")
    p.add_argument("--shutdown-timeout", type=at_least(0, float), default=30.0,
                   help="on SIGTERM, seconds the replicas' drain may take (the router waits 10 s more for their "
                        "last bytes, then cuts what is open)")
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=cmd_router)


# the router's own flags (serve takes them for --data-parallel)
ROUTER_DEFAULTS = {"policy": "prefix", "balance": 4, "health_interval": 1.0, "upstream_timeout": 600.0,
                   "max_connections": 1024}


def add_router_args(p: argparse.ArgumentParser) -> None:
    add_cors_args(p)  # (the front's: replicas behind a router run without CORS, and without TLS)
    add_tls_args(p)
    p.add_argument("--policy", default=ROUTER_DEFAULTS["policy"], choices=POLICIES,
                   help="prefix: the replica that saw the longest prefix of this prompt, unless busier than the "
                        "least-loaded one by more than --balance; least-load; round-robin (default prefix)")
    p.add_argument("--balance", type=at_least(0), default=ROUTER_DEFAULTS["balance"],
                   help="prefix: requests of extra load a prefix match may cost")
    p.add_argument("--health-interval", type=above(0), default=ROUTER_DEFAULTS["health_interval"],
                   help="seconds between health checks")
    p.add_argument("--upstream-timeout", type=at_least(0, float), default=ROUTER_DEFAULTS["upstream_timeout"],
                   help="seconds a replica may send nothing (an unstreamed reply: all of its generation) before "
                        "the client gets a 504; 0: no limit (default 600)")
    p.add_argument("--max-connections", type=at_least(1), default=ROUTER_DEFAULTS["max_connections"],
                   help="open connections to each replica (a stream holds one); past them a 503 (default 1024)")


def check_url(url: str, flag: str) -> str:
    """An http(s)://host[:port] base URL without its trailing slash; ValueError naming the flag otherwise
    (one without a scheme was taken and never became healthy)."""
    from urllib.parse import urlsplit
    u = urlsplit(url)
    if u.scheme not in ("http", "https") or not u.hostname or u.query or u.fragment:
        raise ValueError(f"{flag}: {url!r} is not an http(s)://host:port URL")
    return url.rstrip("/")


def serve_router(replicas: list[str], a: argparse.Namespace, prefill: list[str] = (),  # type: ignore[assignment]
                 on_exit: Any = None) -> int:
    """The router on --host / --port until SIGTERM / SIGINT; on_exit() runs as the shutdown starts (the
    data-parallel front stops its replicas then, so their drain's last events reach the clients)."""
    import uvicorn

    tls = tls_from_args(a)
    from lmserve.router.app import build_router_app
    from lmserve.router.policy import Replica, Router
    router = Router([Replica(check_url(u, "--replica")) for u in replicas], a.policy, a.balance)
    pre = Router([Replica(check_url(u, "--prefill")) for u in prefill], "least-load") if prefill else None
    app = build_router_app(router, a.health_interval, a.max_body_bytes, a.upstream_timeout or None, pre,
                           a.max_connections)
    cors_from_args(a).install(app)
    print(f"lmserve router: {a.policy} over {', '.join(replicas)}"
          + (f", prefill on {', '.join(prefill)}" if prefill else "") + f" on {scheme(tls)}://{a.host}:{a.port}",
          flush=True)

    class Front(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            if on_exit is not None:
                on_exit()
            super().handle_exit(sig, frame)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # (uvicorn raises it again once it has shut down)
    # the replicas drain within --shutdown-timeout; the router waits for their last bytes
    server = Front(uvicorn.Config(app, host=a.host, port=a.port, log_level=a.log_level,
                                  timeout_graceful_shutdown=a.shutdown_timeout + 10, **tls))
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn raises the SIGINT it shut down on again (as uvicorn.run swallows it)
        pass
    return 0 if server.started else 3  # 3: it never started (uvicorn.run's STARTUP_FAILURE)


def cmd_router(a: argparse.Namespace) -> int:
    return serve_router(a.replica, a, a.prefill)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


VALUELESS = {"--allow-credentials"}  # front flags that take no value


def replica_argv(argv: list[str]) -> list[str]:
    """`serve`'s command line without the flags that belong to the front (--data-parallel, --host, --port,
    the router's own)."""
    drop = {"--data-parallel", "--host", "--port",
            *("--" + k.replace("_", "-") for k in (*ROUTER_DEFAULTS, *CORS_FLAGS, *TLS_FLAGS))}
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in drop:
            skip = "=" not in arg and name not in VALUELESS
            continue
        out.append(arg)
    return out


def _die_with_parent() -> None:
    """In a replica, before it runs: SIGTERM when the front exits, however it exits (Linux's
    PR_SET_PDEATHSIG; elsewhere nothing)."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def run_data_parallel(a: argparse.Namespace, argv: list[str]) -> int:
    """N `lmserve serve` processes on free local ports (the host's CPU threads split between them), then
    the router on --host / --port until it stops; the replicas stop with it."""
    n = a.data_parallel
    threads = max(1, (os.cpu_count() or 1) // n)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    ports = [_free_port() for _ in range(n)]
    procs = [subprocess.Popen([sys.executable, "-m", "lmserve.cli", *replica_argv(argv), "--host", "127.0.0.1",
                               "--port", str(p), "--data-parallel", "1"], env=env,  # last wins
                              start_new_session=True,  # a terminal's Ctrl-C reaches the front only,
                              preexec_fn=_die_with_parent) for p in ports]  # and a killed front takes them along
    stop, died = threading.Event(), []

    def watch() -> None:  # a replica that exits (a bad model, a crash) stops the whole front, non-zero
        while not stop.wait(0.5):
            gone = [p for p in procs if p.poll() is not None]
            if gone:
                died.extend(gone)
                print(f"lmserve serve: replica process {gone[0].pid} exited with {gone[0].returncode}; stopping",
                      file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGINT)  # uvicorn shuts down gracefully and returns
                return

    threading.Thread(target=watch, daemon=True).start()

    def stop_replicas() -> None:  # at SIGTERM / SIGINT: they drain, and the front relays their last events
        stop.set()
        for p in procs:
            p.terminate()
    try:
        try:
            rc = serve_router([f"http://127.0.0.1:{p}" for p in ports], a, on_exit=stop_replicas)
        except KeyboardInterrupt:  # the watcher's SIGINT before the router's server took over the signals
            rc = 130
        return 1 if died else rc
    finally:
        if not stop.is_set():  # (stop_replicas sent them SIGTERM already: a second one, landing while a
            stop.set()  # replica's uvicorn had given its handlers back, raised SystemExit mid-exit: a traceback)
            for p in procs:
                p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
