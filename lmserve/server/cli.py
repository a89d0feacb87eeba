"""`lmserve serve`: load the engine, then run the OpenAI-compatible app under uvicorn."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
from typing import Any

from lmserve.cli.engine_args import add_engine_args, engine_kwargs
from lmserve.server.cors import cors_from_args
from lmserve.server.tls import scheme, tls_from_args
from lmserve.utils import above, at_least, given_flags, port_number


def add_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server", allow_abbrev=False)  # (--data-parallel
    # passes the flags on to its replicas but the router's, which it knows by their whole names)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: local only)")
    p.add_argument("--port", type=port_number, default=8000)
    p.add_argument("--api-key", default=os.environ.get("LMSERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every route but /health, /ping, /version, /metrics, "
                        "the API documents and the console's page (or set LMSERVE_API_KEY)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="model id(s) clients send; with several, any of them (responses carry the first; "
                        "default: --model)")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters (PEFT folders) requests may name as their model (vLLM's flag; also its JSON "
                        "form {\"name\": ..., \"path\": ...}); implies --enable-lora")
    p.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="add POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's routes; its "
                        "VLLM_ALLOW_RUNTIME_LORA_UPDATING); implies --enable-lora")
    p.add_argument("--max-queue", type=at_least(1), default=256, help="waiting requests before answering 429")
    from lmserve.server.limits import ServerLimits  # (pydantic-free: the CLI loads without the server extras)
    for flag, dest, kind, default, text in ServerLimits.flags():
        p.add_argument(flag, dest=dest, type=kind, default=default, help=text)
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="let a chat request bring its own chat_template (rendered in the same sandbox and limits)")
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="usage carries prompt_tokens_details.cached_tokens: prompt tokens served from the prefix cache")
    p.add_argument("--request-timeout", type=above(0), default=None, help="abort requests running longer (s)")
    p.add_argument("--shutdown-timeout", type=at_least(0, float), default=30.0,
                   help="on SIGTERM / SIGINT, seconds requests in flight get to finish; then they end with an "
                        "error (a stream's error event, a JSON 503) and the process exits (default 30)")
    p.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json"],
                   help="how tool calls are read from the output (default: from the model: hermes for Qwen "
                        "and <tool_call> templates, llama3_json for Llama 3)")
    p.add_argument("--enable-auto-tool-choice", action=argparse.BooleanOptionalAction, default=True,
                   help="let the model choose to call tools (tool_choice auto, the default with tools; vLLM's flag, "
                        "on here by default); --no-enable-auto-tool-choice: such requests get a 400")
    p.add_argument("--log-level", default="info")
    p.add_argument("--no-web-ui", dest="web_ui", action="store_false",
                   help="no web console at / (chat playground and the live engine view, /v1/engine/stream)")
    p.add_argument("--role", default="both", choices=["both", "prefill", "decode"],
                   help="prefill / decode disaggregation: a prefill instance runs prompts and pushes their KV "
                        "to a --kv-peer; a decode instance takes KV and generates (lmserve router --prefill)")
    p.add_argument("--kv-peer", action="append", default=[], help="prefill: a decode instance's URL it may push to")
    p.add_argument("--kv-secret", default=os.environ.get("LMSERVE_KV_SECRET"),
                   help="prefill / decode: the secret both instances share for KV transfers (or LMSERVE_KV_SECRET)")
    p.add_argument("--data-parallel", type=at_least(1), default=1,
                   help="N engine processes on local ports behind a router on --host / --port (lmserve router)")
    from lmserve.router.cli import add_router_args
    add_router_args(p)
    add_engine_args(p)
    p.set_defaults(func=cmd_serve)


def cmd_serve(a: argparse.Namespace) -> int:
    tls = tls_from_args(a)  # (a missing or mismatched certificate is said before anything starts)
    kw = engine_kwargs(a)  # (an engine flag that would do nothing, too)
    if a.data_parallel > 1:
        from lmserve.router.cli import run_data_parallel
        return run_data_parallel(a, a.argv)
    from lmserve.router.cli import ROUTER_DEFAULTS
    given = given_flags(a.argv)
    idle = [k for k, d in ROUTER_DEFAULTS.items() if getattr(a, k) != d or "--" + k.replace("_", "-") in given]
    if idle:  # (the replicas of --data-parallel get 1 and no router flags)
        raise ValueError(f"{idle[0]}: a router flag; it needs --data-parallel > 1")
    if a.kv_peer and a.role != "prefill":
        raise ValueError("kv_peer: only a prefill instance (--role prefill) pushes KV to peers")
    cors = cors_from_args(a)  # (a bad list is said before the model loads)
    from lmserve.server.lora_api import parse_lora_modules
    loras = parse_lora_modules(a.lora_modules)
    import uvicorn

    from lmserve.config import EngineConfig
    from lmserve.engine import Engine
    from lmserve.server import disagg
    from lmserve.server.app import build_app
    from lmserve.server.async_engine import AsyncEngine
    from lmserve.server.limits import ServerLimits

    logging.getLogger("lmserve").setLevel(a.log_level.upper())
    limits = ServerLimits(**{f.name: getattr(a, f.name) for f in dataclasses.fields(ServerLimits)})  # (before the model)
    sock = listen_socket(a.host, a.port)  # a port in use is said before the model loads, not after
    lora_on = {"enable_lora": True} if loras or a.allow_runtime_lora_updating else {}
    engine = Engine(EngineConfig(model=a.model, **{**kw, **lora_on}))
    ae = AsyncEngine(engine, max_queue=a.max_queue)
    ae.on_fatal = exit_soon
    if hasattr(engine.model, "on_lost"):  # tensor parallel: a rank lost while idle is fatal too
        engine.model.on_lost = ae.die
    names = a.served_model_name or [a.model]
    app = build_app(ae, names, a.api_key, request_timeout=a.request_timeout,
                    tool_call_parser=a.tool_call_parser, limits=limits, cors=cors,
                    auto_tool_choice=a.enable_auto_tool_choice, lora_modules=loras,
                    allow_runtime_lora=a.allow_runtime_lora_updating)
    disagg.register(app, app.state.server, a.role, tuple(a.kv_peer), a.kv_secret, engine)
    if a.web_ui:
        from lmserve.server import web
        web.register(app, ae, names[0])
    print(f"lmserve: {engine.info()} - serving {', '.join(map(repr, names))} on {scheme(tls)}://{a.host}:"
          f"{a.port}", flush=True)
    # uvicorn finishes in-flight requests on SIGTERM/SIGINT, then re-raises the signal under the handler
    # that was installed before it started: make that a clean exit.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    config = uvicorn.Config(app, log_level=a.log_level, timeout_graceful_shutdown=a.shutdown_timeout + 5,
                            # the parser's own cap stays above ours, so that our 431 (with its JSON body) answers
                            h11_max_incomplete_event_size=max(4 * limits.max_header_bytes, 64 * 1024), **tls)
    try:
        draining_server(uvicorn.Server, ae, a.shutdown_timeout)(config).run(sockets=[sock])
    finally:  # (SIGTERM ends the run above with SystemExit) the loop stops, then the engine closes: a
        ae.shutdown(timeout=60)  # directory offload tier writes its last files, its pool's only once no step runs
        engine.close(save_offload=not ae.thread_alive)
    return 0


def listen_socket(host: str, port: int) -> Any:
    """The server's socket, bound now (OSError naming --port if it cannot be)."""
    import socket
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        raise OSError(f"--host / --port: cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def draining_server(base: type, ae: Any, timeout_s: float) -> type:
    """uvicorn's Server that, on SIGTERM / SIGINT, ends the web console's engine views at once (they would
    hold the drain to its end) and, timeout_s later, stops the engine loop: the requests still in flight
    end with an error (a stream's error event and [DONE], a JSON 503) before uvicorn would cut them off."""
    import threading

    class DrainingServer(base):  # type: ignore[misc, valid-type]
        def handle_exit(self, sig: int, frame: Any) -> None:
            if not ae.draining:
                ae.draining = True
                timer = threading.Timer(timeout_s, ae.shutdown, kwargs={"timeout": 0})
                timer.daemon = True
                timer.start()
            super().handle_exit(sig, frame)
    return DrainingServer


def exit_soon(error: BaseException, grace_s: float = 2.0) -> None:
    """The engine cannot go on (a tensor-parallel rank lost): /health answers 503 for grace_s, then the
    process exits with status 1, from whichever thread noticed (uvicorn holds the main one)."""
    import threading
    import time

    def stop() -> None:
        print(f"error: the engine stopped: {error}", file=sys.stderr, flush=True)
        time.sleep(grace_s)
        os._exit(1)
    threading.Thread(target=stop, daemon=True).start()
