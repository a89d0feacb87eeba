"""`lmserve bench parallel`: n continuations of one prompt with shared copy-on-write blocks, against the
same n requests sent separately (prefix caching off): throughput and peak KV blocks."""

from __future__ import annotations

import argparse
import random
import sys
import time
from typing import Any

from lmserve.cli.engine_args import add_engine_args, engine_kwargs
from lmserve.utils import at_least


def add_parser(bs: Any) -> None:
    p = bs.add_parser("parallel", help="n-way parallel sampling: shared blocks vs separate requests")
    add_engine_args(p)
    p.add_argument("--n", type=at_least(1), default=8)
    p.add_argument("--prompt-len", type=at_least(1), default=1024)
    p.add_argument("--max-tokens", type=at_least(1), default=256)
    p.add_argument("--output-json", default=None)
    p.set_defaults(func=cmd_parallel)


def cmd_parallel(a: argparse.Namespace) -> int:
    from lmserve import LLM, SamplingParams
    from lmserve.bench.common import output_path, run_metadata, write_json
    kw = engine_kwargs(a) | {"enable_prefix_caching": False}
    rows = []
    for mode in ("shared", "separate"):
        llm = LLM(a.model, **kw)
        rng = random.Random(a.seed)
        prompt = [rng.randrange(10, llm.engine.vocab_size) for _ in range(a.prompt_len)]
        llm.generate([prompt[:8]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        warm = llm.stats().computed_tokens  # (not the timed run's)
        t0 = time.perf_counter()
        if mode == "shared":
            outs = llm.generate([prompt], SamplingParams(n=a.n, temperature=1.0, seed=1, max_tokens=a.max_tokens,
                                                         ignore_eos=True), use_tqdm=False)
            toks = sum(len(o.token_ids) for o in outs[0].outputs)
        else:
            outs = llm.generate([prompt] * a.n, [SamplingParams(temperature=1.0, seed=1 + i, max_tokens=a.max_tokens,
                                                                ignore_eos=True) for i in range(a.n)], use_tqdm=False)
            toks = sum(len(o.outputs[0].token_ids) for o in outs)
        wall = time.perf_counter() - t0
        st = llm.stats()
        rows.append({"mode": mode, "output_tokens": toks, "wall_s": wall, "output_tokens_per_s": toks / wall,
                     "peak_kv_blocks": st.peak_used_blocks, "prompt_tokens_computed": st.computed_tokens - warm - (toks - a.n)})  # (a sequence's last token is never fed)
        del llm
    saving = 1 - rows[0]["peak_kv_blocks"] / rows[1]["peak_kv_blocks"]
    speed = rows[0]["output_tokens_per_s"] / rows[1]["output_tokens_per_s"]
    for r in rows:
        print(f"{r['mode']:>8}: {r['output_tokens_per_s']:.1f} output tok/s, peak KV blocks {r['peak_kv_blocks']}, "
              f"{r['wall_s']:.1f} s")
    print(f"sharing saves {saving:.1%} of peak KV blocks and runs {speed:.2f}x the throughput")
    path = write_json(output_path(a.output_json, "parallel"),
                      {"bench": "parallel", "rows": rows, "block_saving": saving, "speedup": speed,
                       "meta": run_metadata(vars(a) | {"func": None})})
    print(f"[figures written to {path}]", file=sys.stderr)
    return 0
