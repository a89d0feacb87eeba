"""`lmserve bench spec`: tokens/s and acceptance with and without speculative decoding, on a
repetitive task (rewrite a given text with one change), at batch 1 and at a larger batch."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from lmserve.cli.engine_args import add_engine_args, engine_kwargs

TEXTS = [
    "The library opens at nine in the morning and closes at six in the evening. Visitors may borrow up to "
    "five books at a time for three weeks. Books can be renewed once online. Late returns cost ten cents "
    "per day. The reading room on the second floor is quiet and has free wireless internet.",
    "To make the bread, mix the flour, water, salt and yeast in a large bowl. Knead the dough for ten "
    "minutes until it is smooth. Let it rise for one hour in a warm place. Shape the loaf, let it rise "
    "again for thirty minutes, and bake it at two hundred degrees for forty minutes.",
    "Our team meeting is moved from Monday to Tuesday at ten o'clock. Please bring the quarterly report, "
    "the budget numbers and your list of open questions. The meeting will take about one hour. Lunch "
    "will be served afterwards in the small conference room next to the kitchen.",
    "The train leaves the central station every twenty minutes. The journey to the airport takes about "
    "thirty five minutes. Tickets can be bought from the machines on the platform or from the app. "
    "Children under six travel for free, and bicycles are allowed outside rush hours.",
]


def task_prompts(tokenizer: Any, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        text = TEXTS[i % len(TEXTS)]
        msg = f"Rewrite the following text exactly as it is, but replace every digit word with digits:\n\n{text}"
        out.append(tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": msg}]),
                                    add_special_tokens=False))
    return out


def add_parser(bs: Any) -> None:
    s = bs.add_parser("spec", help="speculative decoding: acceptance and tokens/s vs none")
    add_engine_args(s)
    s.add_argument("--methods", default="none,ngram,draft", help="comma list of none, ngram, draft")
    s.add_argument("--batch-sizes", default="1,8")
    s.add_argument("--max-tokens", type=int, default=96)
    s.add_argument("--repeats", type=int, default=1, help="timed runs per row; the median's tokens/s is reported")
    s.add_argument("--output-json", default=None)
    s.set_defaults(func=cmd_spec)


def cmd_spec(a: argparse.Namespace) -> int:
    from pathlib import Path

    from lmserve import LLM, SamplingParams
    from lmserve.bench.common import run_metadata, write_json
    rows: list[dict[str, Any]] = []
    base = engine_kwargs(a)
    for method in a.methods.split(","):
        kw = dict(base)
        kw["speculative_method"] = None if method == "none" else method
        if method == "draft" and kw.get("draft_num_layers") is None and not kw.get("draft_model"):
            kw["draft_num_layers"] = 4  # a truncated copy of the target: its first 4 layers and its head
        kw["spec_max_batch"] = max(int(b) for b in a.batch_sizes.split(","))
        llm = LLM(a.model, **kw)
        for b in (int(x) for x in a.batch_sizes.split(",")):
            prompts = task_prompts(llm.tokenizer, b)
            params = SamplingParams(temperature=0, max_tokens=a.max_tokens)
            llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
            before = llm.stats().spec or {}
            walls = []
            for _ in range(max(1, a.repeats)):  # greedy: every run the same tokens, proposals and acceptance
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                walls.append(time.perf_counter() - t0)
            wall = sorted(walls)[len(walls) // 2]
            after = llm.stats().spec or {}
            toks = sum(len(o.outputs[0].token_ids) for o in outs)
            runs = len(walls)  # counts per run (the runs are identical)
            prop = (after.get("proposed", 0) - before.get("proposed", 0)) / runs
            acc = (after.get("accepted", 0) - before.get("accepted", 0)) / runs
            ver = (after.get("verifications", 0) - before.get("verifications", 0)) / runs
            rows.append({"method": method, "batch": b, "output_tokens": toks, "wall_s": wall, "walls_s": walls,
                         "tokens_per_s": toks / wall, "proposed": prop, "accepted": acc,
                         "acceptance_rate": acc / prop if prop else None,
                         "mean_accepted_length": 1 + acc / ver if ver else None,
                         "acceptance_by_position": after.get("acceptance_by_position")})
        del llm
    for r in rows:
        ref = next(x for x in rows if x["method"] == rows[0]["method"] and x["batch"] == r["batch"])
        r["speedup_vs_first"] = r["tokens_per_s"] / ref["tokens_per_s"]
    print(f"{'method':>6} {'batch':>5} {'tok/s':>8} {'speedup':>8} {'accept':>7} {'mean len':>8}")
    for r in rows:
        acc = f"{r['acceptance_rate']:.1%}" if r["acceptance_rate"] is not None else "-"
        ml = f"{r['mean_accepted_length']:.2f}" if r["mean_accepted_length"] is not None else "-"
        print(f"{r['method']:>6} {r['batch']:>5} {r['tokens_per_s']:>8.1f} {r['speedup_vs_first']:>7.2f}x {acc:>7} {ml:>8}")
    path = write_json(Path(a.output_json or f"bench_out/spec-{time.strftime('%Y%m%d-%H%M%S')}.json"),
                      {"bench": "spec", "rows": rows, "meta": run_metadata(vars(a) | {"func": None})})
    print(f"[figures written to {path}]", file=sys.stderr)
    return 0
