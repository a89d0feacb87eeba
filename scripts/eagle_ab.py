"""In-process A/B at batch 1 on the speculation benchmark's 16 held-out chat prompts (one request at a
time, 96 greedy tokens each): plain decoding against an EAGLE head at several (k, spec_min_draft_prob)
settings, alternated round after round in one process, each ratio against the same round's plain run
(this machine's speed swings ~15% from minute to minute; runs minutes apart do not compare).
BENCHMARKS.md, issue #21.

    python scripts/eagle_ab.py HEAD [ROUNDS]
"""

from __future__ import annotations

import statistics
import sys
import time

from lmserve import LLM, SamplingParams
from lmserve.bench.spec import task_prompts

CONFIGS = [(2, 0.0), (3, 0.3), (4, 0.4), (3, 0.0)]  # (k, spec_min_draft_prob)


def main(head: str, rounds: int) -> None:
    plain = LLM()
    spec = LLM(speculative_method="eagle", draft_model=head, num_speculative_tokens=2, spec_min_acceptance=0.0)
    prompts = task_prompts(plain.tokenizer, 16, "chat")
    params = SamplingParams(max_tokens=96, temperature=0)

    def run(llm: LLM) -> float:  # tokens/s, one request at a time
        t0, n = time.perf_counter(), 0
        for p in prompts:
            n += len(llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids)
        return n / (time.perf_counter() - t0)
    run(plain), run(spec)  # warm-up
    ratios: dict[tuple[int, float], list[float]] = {c: [] for c in CONFIGS}
    for r in range(rounds):
        base = run(plain)
        for k, mp in CONFIGS:
            object.__setattr__(spec.engine.config, "num_speculative_tokens", k)
            spec.engine.spec.proposer.min_prob = mp
            s0 = dict(spec.stats().spec)
            tps = run(spec)
            s1 = spec.stats().spec
            prop, acc, ver = (s1[x] - s0[x] for x in ("proposed", "accepted", "verifications"))
            ratios[(k, mp)].append(tps / base)
            print(f"round {r}: plain {base:.1f} tok/s; k={k} min_prob={mp}: {tps:.1f} tok/s ({tps / base:.2f}x), "
                  f"{acc / max(prop, 1):.1%} of drafts accepted, {1 + acc / max(ver, 1):.2f} tokens a verification, "
                  f"{prop / max(ver, 1):.2f} drafts a verification", flush=True)
    for c, v in ratios.items():
        print(f"k={c[0]} min_prob={c[1]}: median {statistics.median(v):.2f}x ({', '.join(f'{x:.2f}' for x in v)})")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 3)
