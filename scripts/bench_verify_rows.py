"""A verification step's cost against its rows at batch 1 (issues #15, #21): one sequence with C keys
in the cache and q new tokens through the runner's forward (the CPU decode plan), the LM head over
the q rows and the greedy verification (the runner's: the processed argmax), the row counts
interleaved round after round in one process; medians over rounds (the first 3 dropped).

    python scripts/bench_verify_rows.py [--context 200,1000] [--rows 1,2,3,4,5,6,8] [--rounds 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from lmserve import LLM, SamplingParams  # noqa: E402
from lmserve.sampling.rejection import verify_greedy  # noqa: E402
from lmserve.sampling.sampler import TokenView  # noqa: E402
from lmserve.scheduler import SchedulerOutput  # noqa: E402
from lmserve.sequence import Sequence  # noqa: E402


@torch.inference_mode()
def measure(llm: LLM, context: int, rows: list[int], rounds: int) -> None:
    eng = llm.engine
    runner, most = eng.runner, max(rows)
    seq = Sequence("rows", list(range(100, 100 + context + most)), SamplingParams(max_tokens=1, temperature=0))
    if eng.block_manager.reserve(seq.block_tables, 0, context + most) is None:
        raise SystemExit("not enough KV blocks")
    runner.forward(SchedulerOutput([(seq, context)]))  # the context's keys
    seq.num_computed_tokens = context
    times: dict[int, list[tuple[float, float, float]]] = {q: [] for q in rows}
    for rnd in range(rounds + 3):
        for q in rows:
            t0 = time.perf_counter()
            hidden = runner.forward(SchedulerOutput([(seq, q)]))  # (q, hidden); the same slots rewritten
            t1 = time.perf_counter()
            logits = eng.model.compute_logits(hidden)  # (q, V)
            t2 = time.perf_counter()
            views = [TokenView(seq, context + i) for i in range(q)]
            verify_greedy(runner.sampler.target_argmax(logits, views), seq.token_ids[context + 1:context + q])
            t3 = time.perf_counter()
            if rnd >= 3:
                times[q].append((t1 - t0, t2 - t1, t3 - t2))
    eng.block_manager.free(seq.block_tables)
    med = {q: [statistics.median(t[i] for t in times[q]) * 1e3 for i in range(3)] for q in rows}
    one = sum(med[rows[0]])
    print(f"\ncontext {context} keys, batch 1, {rounds} rounds\n")
    print("| rows | forward | LM head | greedy verification | total | vs one row |\n|---|---|---|---|---|---|")
    for q in rows:
        f, lm, v = med[q]
        print(f"| {q} | {f:.2f} ms | {lm:.2f} ms | {v:.2f} ms | {f + lm + v:.2f} ms | {(f + lm + v) / one:.2f}x |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--context", default="200,1000")
    p.add_argument("--rows", default="1,2,3,4,5,6,8")
    p.add_argument("--rounds", type=int, default=20)
    a = p.parse_args()
    llm = LLM(**({"model": a.model} if a.model else {}), kv_cache_memory="256MiB")
    for c in (int(x) for x in a.context.split(",")):
        measure(llm, c, [int(r) for r in a.rows.split(",")], a.rounds)


if __name__ == "__main__":
    main()
