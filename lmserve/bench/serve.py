"""`lmserve bench serve`: online serving benchmark over the public OpenAI HTTP API only, so it works
against any OpenAI-compatible server (ours, vLLM, SGLang, ...).

Requests arrive as a Poisson process at --request-rate; prompts are random token ids with lengths
drawn as in the throughput workload; a share of them start with one of a few long shared system
prefixes (what prefix caching is for), and a share ask for n > 1. Every request streams.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from lmserve.bench.common import output_path, percentiles, run_metadata, write_json
from lmserve.utils import above, at_least


@dataclass
class ServeRequest:
    prompt: list[int]
    max_tokens: int
    n: int = 1
    shared_prefix: int | None = None


@dataclass
class ServeResult:
    ok: bool
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    prompt_tokens: int = 0
    n: int = 1
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        per_choice = self.completion_tokens / max(1, self.n)
        if self.ttft is None or self.e2e is None or per_choice < 2:
            return None
        return (self.e2e - self.ttft) / (per_choice - 1)


def make_requests(num: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab: int,
                  shared_fraction: float, num_prefixes: int, prefix_len: int, n_fraction: float, n: int,
                  seed: int) -> list[ServeRequest]:
    rng = random.Random(seed)
    tok = lambda: rng.randrange(10, vocab)  # noqa: E731
    prefixes = [[tok() for _ in range(prefix_len)] for _ in range(num_prefixes)]
    out = []
    for _ in range(num):
        body = [tok() for _ in range(rng.randint(*input_len))]
        shared = rng.randrange(num_prefixes) if rng.random() < shared_fraction else None
        prompt = (prefixes[shared] + body) if shared is not None else body
        out.append(ServeRequest(prompt, rng.randint(*output_len), n if rng.random() < n_fraction else 1, shared))
    return out


async def _one(client: Any, url: str, model: str, req: ServeRequest, headers: dict[str, str]) -> ServeResult:
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens, "n": req.n, "temperature": 0.6,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    res = ServeResult(ok=False, n=req.n)
    last: dict[int, float] = {}  # each choice's last chunk: ITL is per choice (n > 1 interleave theirs)
    try:
        async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = str(chunk["error"])
                    return res
                now = time.perf_counter()
                if chunk.get("usage"):
                    res.completion_tokens = chunk["usage"]["completion_tokens"]
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                for c in chunk.get("choices", []):  # a chunk is a step's tokens, text or not (a special
                    # token's is empty; vLLM's benchmark times every one)
                    if res.ttft is None:
                        res.ttft = now - t0
                    if c.get("index", 0) in last:
                        res.itl.append(now - last[c.get("index", 0)])
                    last[c.get("index", 0)] = now
        res.e2e = time.perf_counter() - t0
        res.ok = res.ttft is not None
        if not res.ok:
            res.error = "no tokens streamed"
    except Exception as e:  # a benchmark reports failures, it does not stop on them
        res.error = f"{type(e).__name__}: {e}"
    return res


def _scrape_prefix_counts(url: str, headers: dict[str, str]) -> tuple[float, float] | None:
    """The server's prefix-cache (hit tokens, queried tokens) counters (lmserve's or vLLM's), or None."""
    import httpx
    try:
        text = httpx.get(url + "/metrics", headers=headers, timeout=5).text
    except Exception:
        return None
    found: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        name = name.split("{")[0]
        for key, names in (("hits", ("lmserve_prefix_cache_hit_tokens_total", "vllm:prefix_cache_hits_total")),
                           ("queries", ("lmserve_prefix_cache_queries_total", "vllm:prefix_cache_queries_total"))):
            if name in names and key not in found:
                found[key] = float(value.split()[0])
    return (found["hits"], found["queries"]) if len(found) == 2 else None


def prefix_hit_rate(before: tuple[float, float] | None, after: tuple[float, float] | None) -> float | None:
    """The run's own prefix-cache hit rate, from the counters scraped before and after it (the server's
    lifetime rate counted earlier runs too)."""
    if before is None or after is None:
        return None
    queried = after[1] - before[1]
    return (after[0] - before[0]) / queried if queried > 0 else 0.0


async def run_serve(url: str, model: str, reqs: list[ServeRequest], rate: float, seed: int,
                    api_key: str | None = None, max_concurrency: int | None = None,
                    progress: bool = True) -> tuple[list[ServeResult], float]:
    import httpx
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    rng = random.Random(seed + 1)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(reqs), desc="bench serve", unit="req", leave=False)

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=1000)) as client:
        async def fire(req: ServeRequest) -> ServeResult:
            if sem is None:
                r = await _one(client, url, model, req, headers)
            else:
                async with sem:
                    r = await _one(client, url, model, req, headers)
            if bar is not None:
                bar.update(1)
            return r

        tasks = []
        t0 = time.perf_counter()
        for i, req in enumerate(reqs):
            tasks.append(asyncio.ensure_future(fire(req)))
            if rate != float("inf") and i < len(reqs) - 1:  # no gap after the last: it is no part of the run
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    return list(results), wall


def summarize(results: list[ServeResult], wall: float, slo_ttft: float | None, slo_tpot: float | None
              ) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.completion_tokens for r in ok)
    good = [r for r in ok if (slo_ttft is None or r.ttft <= slo_ttft)
            and (slo_tpot is None or r.tpot is None or r.tpot <= slo_tpot)]
    return {
        "num_requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "wall_s": wall, "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / wall, "requests_per_s": len(ok) / wall,
        "goodput_requests_per_s": len(good) / wall, "slo": {"ttft_s": slo_ttft, "tpot_s": slo_tpot},
        "ttft_s": percentiles([r.ttft for r in ok]),
        "tpot_s": percentiles([r.tpot for r in ok if r.tpot is not None]),
        "itl_s": percentiles([x for r in ok for x in r.itl]),
        "e2e_s": percentiles([r.e2e for r in ok]),
    }


def add_parser(bs: Any) -> None:
    s = bs.add_parser("serve", help="online benchmark against an OpenAI-compatible server")
    s.add_argument("--url", default=None, help="server base URL (default: start `lmserve serve` locally)")
    s.add_argument("--model", default="smollm2-135m", help="model name sent in requests (and served, if launched)")
    s.add_argument("--api-key", default=None)
    s.add_argument("--vocab-size", type=int, default=32000,
                   help="prompt token ids are drawn from [10, vocab-size) (32000 fits every common model)")
    s.add_argument("--num-requests", type=at_least(1), default=64)
    s.add_argument("--request-rate", type=above(0), default=4.0, help="Poisson arrival rate (req/s); inf = all at once")
    s.add_argument("--max-concurrency", type=int, default=None)
    s.add_argument("--input-len", type=at_least(1), nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    s.add_argument("--output-len", type=at_least(1), nargs=2, default=(16, 128), metavar=("MIN", "MAX"))
    s.add_argument("--shared-prefix-fraction", type=float, default=0.3)
    s.add_argument("--num-prefixes", type=int, default=3)
    s.add_argument("--prefix-len", type=int, default=512)
    s.add_argument("--n-fraction", type=float, default=0.1, help="share of requests with n > 1")
    s.add_argument("--n", type=at_least(1), default=2)
    s.add_argument("--slo-ttft-ms", type=float, default=None)
    s.add_argument("--slo-tpot-ms", type=float, default=None)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--output-json", default=None)
    s.add_argument("--plot", action="store_true")
    s.add_argument("--no-progress", action="store_true")
    s.add_argument("--launch-args", default="", help="extra flags for the launched `lmserve serve`")
    s.set_defaults(func=cmd_serve_bench)


def launch_server(model: str, extra: str) -> tuple[subprocess.Popen, str]:
    """`lmserve serve --model MODEL EXTRA...` on a free loopback port, once healthy: (process, base URL)."""
    import socket

    import httpx
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    try:
        args = shlex.split(extra)  # as a shell splits: a quoted value keeps its spaces
    except ValueError as e:
        raise ValueError(f"launch_args: {e} in {extra!r}") from None
    cmd = [sys.executable, "-m", "lmserve.cli", "serve", "--model", model, "--port", str(port), *args]
    log = tempfile.TemporaryFile()  # the server's stderr: its reason, should it not come up
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
    url = f"http://127.0.0.1:{port}"
    for _ in range(1200):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    proc.wait()
    log.seek(0)
    tail = log.read().decode(errors="replace").strip().splitlines()[-5:]
    why = f"exited with status {proc.returncode}" if proc.returncode != -9 else "did not become healthy in 120 s"
    raise ValueError(f"launch_args: the launched `lmserve serve{' ' + extra if extra else ''}` {why}"
                     + (":\n  " + "\n  ".join(tail) if tail else ""))


def cmd_serve_bench(a: argparse.Namespace) -> int:
    proc = None
    url = a.url
    if url is None:
        proc, url = launch_server(a.model, a.launch_args)
    try:
        headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
        reqs = make_requests(a.num_requests, tuple(a.input_len), tuple(a.output_len), a.vocab_size,
                             a.shared_prefix_fraction, a.num_prefixes, a.prefix_len, a.n_fraction, a.n, a.seed)
        before = _scrape_prefix_counts(url, headers)
        results, wall = asyncio.run(run_serve(url, a.model, reqs, a.request_rate, a.seed, a.api_key,
                                              a.max_concurrency, progress=not a.no_progress))
        summary = summarize(results, wall, a.slo_ttft_ms / 1e3 if a.slo_ttft_ms else None,
                            a.slo_tpot_ms / 1e3 if a.slo_tpot_ms else None)
        summary["prefix_cache_hit_rate"] = prefix_hit_rate(before, _scrape_prefix_counts(url, headers))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    res = {"bench": "serve", "url": url, "request_rate": a.request_rate, "results": summary,
           "meta": run_metadata(vars(a) | {"func": None})}
    s = summary
    print(f"{s['completed']}/{s['num_requests']} ok in {s['wall_s']:.1f} s: {s['output_tokens_per_s']:.1f} output tok/s, "
          f"{s['requests_per_s']:.2f} req/s (goodput {s['goodput_requests_per_s']:.2f}); "
          f"TTFT p50/p90/p99 {s['ttft_s'].get('p50', 0) * 1e3:.0f}/{s['ttft_s'].get('p90', 0) * 1e3:.0f}/"
          f"{s['ttft_s'].get('p99', 0) * 1e3:.0f} ms; TPOT p50 {s['tpot_s'].get('p50', 0) * 1e3:.1f} ms; "
          f"ITL p50 {s['itl_s'].get('p50', 0) * 1e3:.1f} ms; e2e p50 {s['e2e_s'].get('p50', 0):.2f} s; "
          f"prefix-cache hit rate {s['prefix_cache_hit_rate']}")
    path = write_json(output_path(a.output_json, "serve"), res)
    if a.plot:
        from lmserve.bench.plots import cdfs
        ok = [r for r in results if r.ok]
        cdfs({"TTFT (s)": [r.ttft for r in ok], "e2e (s)": [r.e2e for r in ok],
              "TPOT (s)": [r.tpot for r in ok if r.tpot is not None]}, "seconds", path.with_suffix(".png"))
    print(f"[figures written to {path}]", file=sys.stderr)
    return 0 if s["failed"] == 0 else 1
