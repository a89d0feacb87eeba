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
    eng, runner = llm.engine, llm.engine.runner
    spent = {"schedule": 0.0, "forward": 0.0, "sampler": 0.0, "update": 0.0, "step": 0.0}
    steps = [0]

    def timed(name: str, fn):  # type: ignore[no-untyped-def]
        def run(*args, **kw):  # type: ignore[no-untyped-def]
            t = time.perf_counter()
            r = fn(*args, **kw)
            spent[name] += time.perf_counter() - t
            return r
        return run

    class Sampler:  # the runner calls self.sampler(logits, sampling inputs, bitmask)
        def __init__(self, real) -> None:  # type: ignore[no-untyped-def]
            self.real, self.call = real, timed("sampler", real)

        def __call__(self, *args, **kw):  # type: ignore[no-untyped-def]
            return self.call(*args, **kw)

        def __getattr__(self, k: str):  # type: ignore[no-untyped-def]
            return getattr(self.real, k)

    step = eng.step

    def stepped():  # type: ignore[no-untyped-def]
        steps[0] += 1
        return timed("step", step)()

    eng.scheduler.schedule = timed("schedule", eng.scheduler.schedule)  # type: ignore[method-assign]
    eng.scheduler.update_from_output = timed("update", eng.scheduler.update_from_output)  # type: ignore[method-assign]
    runner.forward = timed("forward", runner.forward)  # type: ignore[method-assign]
    runner.sampler = Sampler(runner.sampler)  # type: ignore[assignment]
    eng.step = stepped  # type: ignore[method-assign]
    prof = cProfile.Profile() if a.profile else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    outs = llm.generate([r.prompt for r in reqs], params, use_tqdm=False)
    if prof:
        prof.disable()
    wall = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    ms = {k: v / steps[0] * 1e3 for k, v in spent.items()}
    rest = ms["step"] - ms["schedule"] - ms["forward"] - ms["sampler"] - ms["update"]
    print(f"{a.requests} requests, {n} output tokens, {steps[0]} steps, {wall:.2f} s ({n / wall:.0f} tok/s)")
    print(f"per step: forward {ms['forward']:.2f} ms (incl. building its inputs), sampler {ms['sampler']:.2f} ms; "
          f"host work around them {ms['step'] - ms['forward'] - ms['sampler']:.2f} ms = schedule "
          f"{ms['schedule']:.2f} + update {ms['update']:.2f} + rest of the step {rest:.2f} (outputs, "
          f"detokenizing, ...); outside Engine.step (adding the requests, generate's loop) {(wall - spent['step']) / steps[0] * 1e3:.2f} ms")
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
