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
from lmserve.utils import above, at_least


def add_parser(sub: Any) -> None:
    p = sub.add_parser("router", help="one OpenAI-compatible front for several lmserve replicas")
    p.add_argument("--replica", action="append", required=True,
                   help="a replica's base URL (repeat for each); with --prefill, the decode instances")
    p.add_argument("--prefill", action="append", default=[],
                   help="a prefill instance's base URL (lmserve serve --role prefill --kv-peer <each replica>)")
    add_router_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=cmd_router)


ROUTER_DEFAULTS = {"policy": "prefix", "balance": 4, "health_interval": 1.0}  # the router's own flags


def add_router_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policy", default=ROUTER_DEFAULTS["policy"], choices=POLICIES,
                   help="prefix: the replica that saw the longest prefix of this prompt, unless busier than the "
                        "least-loaded one by more than --balance; least-load; round-robin (default prefix)")
    p.add_argument("--balance", type=at_least(0), default=ROUTER_DEFAULTS["balance"],
                   help="prefix: requests of extra load a prefix match may cost")
    p.add_argument("--health-interval", type=above(0), default=ROUTER_DEFAULTS["health_interval"],
                   help="seconds between health checks")


def serve_router(replicas: list[str], a: argparse.Namespace, prefill: list[str] = ()) -> int:  # type: ignore[assignment]
    import uvicorn

    from lmserve.router.app import build_router_app
    from lmserve.router.policy import Replica, Router
    router = Router([Replica(u.rstrip("/")) for u in replicas], a.policy, a.balance)
    pre = Router([Replica(u.rstrip("/")) for u in prefill], "least-load") if prefill else None
    app = build_router_app(router, a.health_interval, prefill=pre)
    print(f"lmserve router: {a.policy} over {', '.join(replicas)}"
          + (f", prefill on {', '.join(prefill)}" if prefill else "") + f" on http://{a.host}:{a.port}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    uvicorn.run(app, host=a.host, port=a.port, log_level=a.log_level, timeout_graceful_shutdown=30)
    return 0


def cmd_router(a: argparse.Namespace) -> int:
    return serve_router(a.replica, a, a.prefill)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def replica_argv(argv: list[str]) -> list[str]:
    """`serve`'s command line without the flags that belong to the front (--data-parallel, --host, --port,
    the router's own)."""
    drop = {"--data-parallel", "--host", "--port", "--policy", "--balance", "--health-interval"}
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in drop:
            skip = "=" not in arg
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
    try:
        rc = serve_router([f"http://127.0.0.1:{p}" for p in ports], a)
        return 1 if died else rc
    finally:
        stop.set()
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
