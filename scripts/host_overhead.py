"""Host-side cost of a step at a large batch: where a GPU engine loses time to Python.

Runs 256 requests on a 2-layer random model (the forward is cheap, so what remains is scheduling,
input building, sampling decisions and output processing) and splits the wall time into the model
forward (incl. building its inputs), the sampler, and everything else.

    python scripts/host_overhead.py [--requests 256] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from lmserve import LLM, SamplingParams
from lmserve.bench.common import random_workload


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--profile", action="store_true", help="print the top of a cProfile of the run")
    a = ap.parse_args()
    torch.set_num_threads(1)
    llm = LLM("shape:debug-tiny", max_num_seqs=a.requests, max_num_batched_tokens=8192)
    reqs = random_workload(num_requests=a.requests, input_len=(16, 64), output_len=(64, 128),
                           vocab_size=llm.engine.vocab_size, seed=0)
    params = [SamplingParams(temperature=0.6, max_tokens=r.max_tokens, ignore_eos=True, seed=i)
              for i, r in enumerate(reqs)]
    runner = llm.engine.runner
    spent = {"forward": 0.0, "sampler": 0.0, "steps": 0}
    forward, sampler = runner.forward, runner.sampler.__call__

    def timed_forward(out):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        h = forward(out)
        spent["forward"] += time.perf_counter() - t
        spent["steps"] += 1
        return h

    class TimedSampler(type(runner.sampler)):  # type: ignore[misc]
        def __call__(self, logits, seqs):  # type: ignore[no-untyped-def]
            t = time.perf_counter()
            o = sampler(logits, seqs)
            spent["sampler"] += time.perf_counter() - t
            return o

    runner.forward = timed_forward  # type: ignore[method-assign]
    runner.sampler.__class__ = TimedSampler
    prof = cProfile.Profile() if a.profile else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    outs = llm.generate([r.prompt for r in reqs], params, use_tqdm=False)
    if prof:
        prof.disable()
    wall = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    steps = spent["steps"]
    other = wall - spent["forward"] - spent["sampler"]
    print(f"{a.requests} requests, {n} output tokens, {steps} steps, {wall:.2f} s ({n / wall:.0f} tok/s)")
    print(f"per step: forward {spent['forward'] / steps * 1e3:.2f} ms, sampler {spent['sampler'] / steps * 1e3:.2f} ms,"
          f" everything else (scheduling, output processing) {other / steps * 1e3:.2f} ms")
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
