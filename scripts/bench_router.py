"""Router and disaggregation figures for BENCHMARKS.md (issue #20), the default model on this machine:

  1. the shared-system-prompt workload over 2 replicas (`lmserve serve --data-parallel 2`): prefix
     routing against round-robin: the replicas' prefix-cache hit rate, the router's as-routed hit rate,
     TTFT p50 / p99;
  2. a mixed long-prompt workload: colocated (2 replicas, least-load) against disaggregated (one
     prefill instance, one decode instance, `lmserve router --prefill`): TTFT and TPOT p50 / p99.

    python scripts/bench_router.py [--num-requests 64] [--parts 1,2]
Each configuration is started fresh, measured with `lmserve bench serve`'s client (streaming), stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import socket
import subprocess
import sys
import time

import httpx

from lmserve.bench.serve import make_requests, run_serve, summarize


def port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(*args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "lmserve.cli", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=env)


def wait_up(url: str, replicas: int = 0) -> None:
    """Until url answers /health (and, for a router, `replicas` of its replicas are up)."""
    for _ in range(1800):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                text = httpx.get(url + "/metrics", timeout=2).text if replicas else ""
                if len(re.findall(r'lmserve_router_replica_up\{replica="[^"]+"\} 1\.0', text)) >= replicas:
                    return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not come up")


def metric(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def run(url: str, reqs: list, rate: float) -> dict:
    results, wall = asyncio.run(run_serve(url, "smollm2-135m", reqs, rate, 0, None, None, progress=False))
    return summarize(results, wall, None, None)


def replicas_of(router: str) -> list[str]:
    return re.findall(r'lmserve_router_replica_up\{replica="([^"]+)"\}', httpx.get(router + "/metrics").text)


def part1(n: int) -> None:
    reqs = make_requests(n, (16, 64), (16, 32), 32000, 1.0, 16, 384, 0.0, 1, 0)
    print("| policy | replicas' prefix-cache hit rate | as routed | TTFT p50 | TTFT p99 | TPOT p50 | output tok/s |")
    print("|---|---|---|---|---|---|---|")
    for policy in ("prefix", "round-robin"):
        p = port()
        url = f"http://127.0.0.1:{p}"
        proc = start("serve", "--data-parallel", "2", "--policy", policy, "--port", str(p))
        try:
            wait_up(url, 2)
            s = run(url, reqs, 4.0)
            reps = [httpx.get(u + "/metrics").text for u in replicas_of(url)]
            hit = sum(metric(t, "lmserve_prefix_cache_hit_tokens") for t in reps) / max(
                1, sum(metric(t, "lmserve_prompt_tokens_total") for t in reps))
            routed = metric(httpx.get(url + "/metrics").text, "lmserve_router_prefix_hit_rate")
        finally:
            proc.terminate()
            proc.wait(60)
        print(f"| {policy} | {hit:.1%} | {routed:.1%} | {s['ttft_s']['p50'] * 1e3:.0f} ms | "
              f"{s['ttft_s']['p99'] * 1e3:.0f} ms | {s['tpot_s']['p50'] * 1e3:.1f} ms | {s['output_tokens_per_s']:.1f} |",
              flush=True)


def part2(n: int) -> None:
    reqs = make_requests(n, (256, 1024), (32, 64), 32000, 0.0, 1, 1, 0.0, 1, 1)
    print("| setup | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | output tok/s |")
    print("|---|---|---|---|---|---|")
    for setup in ("colocated (2 replicas, least-load)", "disaggregated (1 prefill + 1 decode)"):
        procs = []
        try:
            if setup.startswith("colocated"):
                p = port()
                url = f"http://127.0.0.1:{p}"
                procs.append(start("serve", "--data-parallel", "2", "--policy", "least-load", "--port", str(p)))
                wait_up(url, 2)
            else:
                import os
                env = {**os.environ, "OMP_NUM_THREADS": "1"}  # one core each, as the two replicas get
                pd, pp, pr = port(), port(), port()
                dec, pre, url = (f"http://127.0.0.1:{x}" for x in (pd, pp, pr))
                procs.append(start("serve", "--role", "decode", "--port", str(pd), env=env))
                procs.append(start("serve", "--role", "prefill", "--kv-peer", dec, "--port", str(pp), env=env))
                procs.append(start("router", "--replica", dec, "--prefill", pre, "--port", str(pr)))
                wait_up(dec)
                wait_up(pre)
                wait_up(url, 2)
            s = run(url, reqs, 0.5)
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(60)
        print(f"| {setup} | {s['ttft_s']['p50'] * 1e3:.0f} ms | {s['ttft_s']['p99'] * 1e3:.0f} ms | "
              f"{s['tpot_s']['p50'] * 1e3:.1f} ms | {s['tpot_s']['p99'] * 1e3:.1f} ms | {s['output_tokens_per_s']:.1f} |",
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--parts", default="1,2")
    a = ap.parse_args()
    if "1" in a.parts.split(","):
        part1(a.num_requests)
    if "2" in a.parts.split(","):
        part2(max(8, a.num_requests // 4))


if __name__ == "__main__":
    main()
