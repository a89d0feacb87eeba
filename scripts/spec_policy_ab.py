"""In-process A/B of the speculation policies (`--spec-policy fixed|goodput`) against plain decoding on
the speculation benchmark's 16 prompts (chat or copy), 96 greedy tokens each, at batch 1 (one request at
a time) and batch 8 (waves of 8), the three engines in one process taking turns wave by wave, each
ratio against the same round's plain run (this machine's speed swings ~15% between minutes).
BENCHMARKS.md, issue #21.

    python scripts/spec_policy_ab.py --method eagle --head DIR --task chat --k 2 --rounds 2
    python scripts/spec_policy_ab.py --method ngram --task copy --k 5
"""

from __future__ import annotations

import argparse
import statistics
import time

from lmserve import LLM, SamplingParams
from lmserve.bench.spec import task_prompts


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--method", default="eagle", choices=["eagle", "ngram"])
    p.add_argument("--head", default=None, help="the EAGLE head's folder (--method eagle)")
    p.add_argument("--task", default="chat", choices=["chat", "copy"])
    p.add_argument("--k", type=int, default=2, help="num_speculative_tokens (goodput: the most)")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    spec = dict(speculative_method=a.method, num_speculative_tokens=a.k, spec_max_batch=8)
    if a.method == "eagle":
        spec["draft_model"] = a.head
    engines = {"none": LLM(), "fixed": LLM(**spec), "goodput": LLM(**spec, spec_policy="goodput")}
    prompts = task_prompts(engines["none"].tokenizer, 16, a.task)
    params = SamplingParams(max_tokens=96, temperature=0)

    def wave(llm: LLM, batch: list) -> tuple[int, float]:  # (tokens, seconds) of one wave
        t0 = time.perf_counter()
        n = sum(len(o.outputs[0].token_ids) for o in llm.generate(batch, params, use_tqdm=False))
        return n, time.perf_counter() - t0
    sizes = [int(b) for b in a.batch_sizes.split(",")]
    for llm in engines.values():  # warm-up (the goodput engine measures its costs here too)
        for b in sizes:
            for lo in range(0, len(prompts), b):
                wave(llm, prompts[lo:lo + b])
    ratios: dict[tuple[str, int], list[float]] = {}
    for r in range(a.rounds):
        for b in sizes:
            got = {name: [0, 0.0] for name in engines}
            s0 = {name: dict(llm.stats().spec or {}) for name, llm in engines.items()}
            for lo in range(0, len(prompts), b):  # the engines in turn, wave by wave: drift cancels
                for name, llm in engines.items():
                    n, t = wave(llm, prompts[lo:lo + b])
                    got[name][0] += n
                    got[name][1] += t
            tps = {name: n / t for name, (n, t) in got.items()}
            line = f"round {r} batch {b}: none {tps['none']:.1f} tok/s"
            for name in ("fixed", "goodput"):
                s1 = engines[name].stats().spec
                prop, acc, ver = (s1[x] - s0[name][x] for x in ("proposed", "accepted", "verifications"))
                ratios.setdefault((name, b), []).append(tps[name] / tps["none"])
                line += (f"; {name} {tps[name]:.1f} ({tps[name] / tps['none']:.2f}x, {ver} verifications, "
                         f"{prop / max(ver, 1):.2f} drafts and {1 + acc / max(ver, 1):.2f} tokens each)")
            print(line, flush=True)
    for (name, b), v in ratios.items():
        print(f"{a.method} {a.task} batch {b} {name}: median {statistics.median(v):.2f}x "
              f"({', '.join(f'{x:.2f}' for x in v)})")


if __name__ == "__main__":
    main()
