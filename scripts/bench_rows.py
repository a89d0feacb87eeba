"""Step cost against rows (issue #15): the decode step of B sequences together, for several B, in one
process, the batch sizes interleaved round after round so that a noisy machine's drift lands on all of
them alike; per B the median step time over rounds and the median of each round's ratio to one row.

    python scripts/bench_rows.py [--model smollm2-135m] [--rows 1,2,4,5,8,16] [--rounds 5] [--input-len 64]
                                 [--output-len 32] [--kv-cache-dtype auto]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lmserve import LLM  # noqa: E402
from lmserve.bench.offline import run_latency  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--rows", default="1,2,4,5,8,16")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--kv-cache-dtype", default="auto")
    a = p.parse_args()
    rows = [int(r) for r in a.rows.split(",")]
    kw = {"model": a.model} if a.model else {}
    llm = LLM(**kw, kv_cache_memory="512MiB", kv_cache_dtype=a.kv_cache_dtype)
    steps: dict[int, list[float]] = {r: [] for r in rows}
    ratios: dict[int, list[float]] = {r: [] for r in rows}
    for rnd in range(a.rounds):
        got = {r: run_latency(llm, r, a.input_len, a.output_len, repeats=1, peak_bandwidth=1.0, seed=rnd)
               ["decode_step_s"]["p50"] for r in rows}
        for r in rows:
            steps[r].append(got[r])
            ratios[r].append(got[r] / got[rows[0]])
        print(f"round {rnd + 1}: " + ", ".join(f"{r}: {got[r] * 1e3:.2f} ms" for r in rows), flush=True)
    print(f"\n| rows | {' | '.join(str(r) for r in rows)} |")
    print("|---|" + "---|" * len(rows))
    print("| step p50 | " + " | ".join(f"{statistics.median(steps[r]) * 1e3:.2f} ms" for r in rows) + " |")
    print(f"| vs {rows[0]} row | " + " | ".join(f"{statistics.median(ratios[r]):.2f}x" for r in rows) + " |")
    print("| decode tok/s | " + " | ".join(f"{r / statistics.median(steps[r]):.0f}" for r in rows) + " |")


if __name__ == "__main__":
    main()
