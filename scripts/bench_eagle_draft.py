"""What an EAGLE head's drafting costs, both paths in one process: NativeHead (the head in C) against
the int8 module path, propose and observe per call over real chat requests (k = 3, two requests at a
time), twice each, alternated. BENCHMARKS.md, issue #21.

    python scripts/bench_eagle_draft.py HEAD
"""

from __future__ import annotations

import sys
import time

from lmserve import LLM, SamplingParams
from lmserve.bench.spec import task_prompts


def main(head: str) -> None:
    llm = LLM(speculative_method="eagle", draft_model=head, num_speculative_tokens=3, spec_min_acceptance=0.0)
    prop = llm.engine.spec.proposer
    if prop.native is None:
        raise SystemExit("the head does not run in C here (no tile kernel, or not an int8 CPU target)")
    prompts = task_prompts(llm.tokenizer, 2, "chat")
    params = SamplingParams(max_tokens=64, temperature=0)
    spent = {"propose": 0.0, "observe": 0.0, "calls": 0}

    def timed(name: str):  # type: ignore[no-untyped-def]
        real = getattr(prop, name)

        def call(*a):  # type: ignore[no-untyped-def]
            t = time.perf_counter()
            out = real(*a)
            spent[name] += time.perf_counter() - t
            spent["calls"] += name == "propose"
            return out
        setattr(prop, name, call)
    timed("propose")
    timed("observe")
    native = prop.native
    for path in ("C", "modules", "C", "modules"):
        prop.native = native if path == "C" else None
        spent.update(propose=0.0, observe=0.0, calls=0)
        llm.generate(prompts, params, use_tqdm=False)
        n = max(1, spent["calls"])
        print(f"{path:8s} propose {spent['propose'] / n * 1e3:.2f} ms a call, observe {spent['observe'] / n * 1e3:.2f} ms")
    prop.native = native


if __name__ == "__main__":
    main(sys.argv[1])
