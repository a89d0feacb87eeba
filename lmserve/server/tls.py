"""HTTPS: the server's certificate and key (uvicorn's TLS), vLLM's flags. Off unless --ssl-certfile
names the certificate (its key in --ssl-keyfile, or in the same file); --ssl-ca-certs with
--ssl-cert-reqs 2 asks clients for their own certificate (mutual TLS). With --data-parallel (or `lmserve
router`) the front terminates TLS; its replicas listen on loopback in plain HTTP.

No web framework at import: the CLI reads these flags without the server extras."""

from __future__ import annotations

import argparse
import ssl
from typing import Any

FLAGS = ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "ssl_cert_reqs")


def add_tls_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ssl-certfile", default=None,
                   help="serve HTTPS with this certificate (PEM; its key in --ssl-keyfile or in this file)")
    p.add_argument("--ssl-keyfile", default=None, help="the certificate's private key (PEM)")
    p.add_argument("--ssl-ca-certs", default=None, help="CA certificates that client certificates are checked against")
    p.add_argument("--ssl-cert-reqs", type=int, default=int(ssl.CERT_NONE), choices=[0, 1, 2],
                   help="client certificates: 0 not asked (default), 1 optional, 2 required (mutual TLS; needs "
                        "--ssl-ca-certs), as Python's ssl.CERT_* and vLLM's flag")


def tls_from_args(a: argparse.Namespace) -> dict[str, Any]:
    """uvicorn.Config's TLS options from the flags ({} for plain HTTP), the files loaded once here, so
    that a missing file or a key that does not match its certificate is said (a ValueError naming the
    flag) before the model loads, not when uvicorn starts."""
    if a.ssl_certfile is None and a.ssl_keyfile is None:
        for name in ("ssl_ca_certs", "ssl_cert_reqs"):
            if getattr(a, name) not in (None, int(ssl.CERT_NONE)):
                raise ValueError(f"{name}: needs HTTPS (--ssl-certfile)")
        return {}
    if a.ssl_certfile is None:  # (a certfile alone may hold the key too, as uvicorn takes it)
        raise ValueError("ssl_certfile: --ssl-keyfile needs the certificate it is the key of")
    if a.ssl_cert_reqs == ssl.CERT_REQUIRED and a.ssl_ca_certs is None:
        raise ValueError("ssl_ca_certs: --ssl-cert-reqs 2 (client certificates required) needs the CAs to check them")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(a.ssl_certfile, a.ssl_keyfile)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"ssl_certfile / ssl_keyfile: cannot load {a.ssl_certfile!r} with key "
                         f"{a.ssl_keyfile or '(in the same file)'!r}: {e.strerror or e}") from None
    if a.ssl_ca_certs is not None:
        try:
            ctx.load_verify_locations(a.ssl_ca_certs)
        except (OSError, ssl.SSLError) as e:
            raise ValueError(f"ssl_ca_certs: cannot load {a.ssl_ca_certs!r}: {e.strerror or e}") from None
    return {"ssl_certfile": a.ssl_certfile, "ssl_keyfile": a.ssl_keyfile, "ssl_ca_certs": a.ssl_ca_certs,
            "ssl_cert_reqs": a.ssl_cert_reqs}


def scheme(tls: dict[str, Any]) -> str:
    return "https" if tls else "http"
