"""What the web console's engine view costs: the CPU throughput workload over HTTP (lmserve bench serve:
32 requests at once, prompts 16..256 random tokens, 16..256 new tokens, temperature 0.6) against one
`lmserve serve`, with no viewer and with a viewer reading /v1/engine/stream (as the page does: every
snapshot parsed), alternated `--rounds` times in the same run. Prints a markdown table.

    python scripts/bench_web.py [--rounds 2] [--num-requests 32] [--model M] [-- extra serve flags]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading

import httpx

from lmserve.bench.serve import launch_server


def bench(url: str, n: int, seed: int) -> float:
    out = tempfile.mktemp(suffix=".json")
    subprocess.run([sys.executable, "-m", "lmserve.cli", "bench", "serve", "--url", url, "--num-requests", str(n),
                    "--request-rate", "inf", "--input-len", "16", "256", "--output-len", "16", "256",
                    "--shared-prefix-fraction", "0", "--n-fraction", "0", "--seed", str(seed), "--no-progress",
                    "--vocab-size", "49152", "--output-json", out], check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        res = json.load(f)["results"]
    os.unlink(out)
    assert res["failed"] == 0, res["errors"]
    return res["output_tokens_per_s"]


def viewer(url: str, stop: threading.Event, seen: list[int]) -> None:
    with httpx.stream("GET", url + "/v1/engine/stream", timeout=None) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                json.loads(line[5:])
                seen.append(1)
            if stop.is_set():
                return


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--model", default="smollm2-135m")
    a, extra = p.parse_known_args()
    proc, url = launch_server(a.model, " ".join(["--log-level", "warning", *[x for x in extra if x != "--"]]))
    try:
        bench(url, 4, 99)  # warm-up
        closed, opened, events = [], [], []
        for r in range(a.rounds):
            closed.append(bench(url, a.num_requests, r))
            stop, seen = threading.Event(), []
            th = threading.Thread(target=viewer, args=(url, stop, seen), daemon=True)
            th.start()
            opened.append(bench(url, a.num_requests, r))
            stop.set()
            events.append(len(seen))
    finally:
        proc.terminate()
        proc.wait(60)
    c, o = statistics.mean(closed), statistics.mean(opened)
    print("| engine view | output tok/s per round | mean | vs closed |")
    print("|---|---|---|---|")
    print(f"| closed | {', '.join(f'{x:.1f}' for x in closed)} | {c:.1f} | |")
    print(f"| open (snapshots read: {', '.join(map(str, events))}) | {', '.join(f'{x:.1f}' for x in opened)} | "
          f"{o:.1f} | {100 * (o / c - 1):+.1f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
