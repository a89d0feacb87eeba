"""`lmserve bench spec`: tokens/s and acceptance with and without speculative decoding, at batch 1 and
at a larger batch, on a copy task (rewrite a given text with one change) or on held-out chat prompts
(none of them in train-draft's prompt set). Beside acceptance, what decides a speedup: the draft's cost
per drafted token and a verification step's cost, each relative to a plain decode step of the same batch
(the `none` row, which is run first when it is asked for)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from lmserve.cli.engine_args import add_engine_args, engine_kwargs
from lmserve.spec.prompts import CHAT
from lmserve.utils import at_least, given_flags

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


def by_position(before: dict, after: dict) -> list[float] | None:
    """Acceptance at each draft position between two SpecStats.as_dict snapshots (this row's runs alone;
    None when nothing was drafted)."""
    def delta(key: str) -> list[int]:
        a, b = after.get(key, []), before.get(key, [])
        return [x - (b[i] if i < len(b) else 0) for i, x in enumerate(a)]
    return [acc / prop for acc, prop in zip(delta("accepted_at"), delta("proposed_at")) if prop] or None


def task_prompts(tokenizer: Any, n: int, task: str = "copy") -> list[list[int]]:
    out = []
    for i in range(n):
        if task == "chat":
            msg = CHAT[i % len(CHAT)]
        else:
            text = TEXTS[i % len(TEXTS)]
            msg = f"Rewrite the following text exactly as it is, but replace every digit word with digits:\n\n{text}"
        out.append(tokenizer.request_ids(msg))
    return out


class _Timers:
    """Wall time of the proposer (per drafted token) and of the runner's steps with and without drafts."""

    def __init__(self, llm: Any) -> None:
        self.reset()
        eng = llm.engine
        if eng.spec is not None:
            prop = eng.spec.proposer
            prop.propose = self._drafting(prop.propose, rounds=True)
            if hasattr(prop, "observe"):  # an EAGLE head's per-step work on the target's features
                prop.observe = self._drafting(prop.observe, rounds=False)
        real_execute = eng.runner.execute

        def execute(out):  # type: ignore[no-untyped-def]
            t0 = time.perf_counter()
            res = real_execute(out)
            dt = time.perf_counter() - t0
            decode = all(s.num_computed_tokens + n == s.num_tokens for s, n in out.scheduled) and \
                all(n == 1 + s.spec.num_draft for s, n in out.scheduled)
            if decode and any(s.spec.num_draft for s, _ in out.scheduled):
                self.verify_s, self.verify_steps = self.verify_s + dt, self.verify_steps + 1
            elif decode:
                self.plain_s, self.plain_steps = self.plain_s + dt, self.plain_steps + 1
            return res
        eng.runner.execute = execute

    def _drafting(self, fn: Any, rounds: bool) -> Any:
        """fn timed into draft_s; rounds: fn is propose, whose longest proposal counts the draft rounds."""
        def wrapped(*args):  # type: ignore[no-untyped-def]
            t0 = time.perf_counter()
            out = fn(*args)
            self.draft_s += time.perf_counter() - t0
            if rounds:
                self.drafted += max((len(p.tokens) for p in out), default=0)  # sequential draft rounds
            return out
        return wrapped

    def reset(self) -> None:
        self.draft_s = self.verify_s = self.plain_s = 0.0
        self.drafted = self.verify_steps = self.plain_steps = 0


def add_parser(bs: Any) -> None:
    s = bs.add_parser("spec", help="speculative decoding: acceptance and tokens/s vs none")
    add_engine_args(s)
    s.add_argument("--methods", default="none,ngram,draft", help="comma list of none, ngram, draft, eagle")
    s.add_argument("--task", default="copy", choices=["copy", "chat"],
                   help="copy: rewrite a given text; chat: held-out chat prompts")
    s.add_argument("--eagle-head", default=None, help="the EAGLE head's folder (lmserve train-draft) for eagle")
    s.add_argument("--batch-sizes", default="1,8",
                   help="requests at a time: --num-prompts prompts run in waves of this many")
    s.add_argument("--num-prompts", type=at_least(1), default=16,
                   help="prompts per row (at least the batch size), run B at a time: a row is not one prompt's luck")
    s.add_argument("--max-tokens", type=at_least(1), default=96)
    s.add_argument("--repeats", type=at_least(1), default=1, help="timed runs per row; the median's tokens/s is reported")
    s.add_argument("--output-json", default=None)
    s.set_defaults(func=cmd_spec)


def cmd_spec(a: argparse.Namespace) -> int:
    from lmserve import LLM, SamplingParams
    from lmserve.bench.common import output_path, run_metadata, write_json
    rows: list[dict[str, Any]] = []
    given = given_flags(getattr(a, "argv", []))
    for flag in ("--speculative-method", "--speculative-config", "--spec-max-batch"):  # each row sets them
        if flag in given:
            raise ValueError(f"{flag.lstrip('-').replace('-', '_')}: bench spec sets it for each row "
                             f"(--methods, --batch-sizes)")
    try:
        sizes = [int(b) for b in a.batch_sizes.split(",")]
    except ValueError:
        raise ValueError(f"batch_sizes: a comma-separated list of integers, got {a.batch_sizes!r}") from None
    if min(sizes) < 1:
        raise ValueError(f"batch_sizes: every size must be >= 1, got {a.batch_sizes!r}")
    base = engine_kwargs(a, method_per_run=True)
    for method in a.methods.split(","):
        kw = dict(base)
        kw["speculative_method"] = None if method == "none" else method
        if method == "draft" and kw.get("draft_num_layers") is None and not kw.get("draft_model"):
            kw["draft_num_layers"] = 4  # a truncated copy of the target: its first 4 layers and its head
        if method == "eagle":
            if not a.eagle_head:
                raise ValueError("eagle_head: --methods eagle needs --eagle-head DIR")
            kw["draft_model"] = a.eagle_head
        if a.num_prompts < 1:
            raise ValueError(f"num_prompts: must be >= 1, got {a.num_prompts}")
        kw["spec_max_batch"] = max(int(b) for b in a.batch_sizes.split(","))
        llm = LLM(a.model, **kw)
        if llm.tokenizer is None:
            raise ValueError("model: bench spec writes its prompts as text; this model has no tokenizer")
        timers = _Timers(llm)
        for b in (int(x) for x in a.batch_sizes.split(",")):
            n = -(-max(a.num_prompts, b) // b) * b  # whole waves of b
            prompts = task_prompts(llm.tokenizer, n, a.task)
            params = SamplingParams(temperature=0, max_tokens=a.max_tokens)
            llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
            before = llm.stats().spec or {}
            timers.reset()
            walls = []
            for _ in range(max(1, a.repeats)):  # greedy: every run the same tokens, proposals and acceptance
                t0 = time.perf_counter()
                outs = [o for lo in range(0, n, b) for o in llm.generate(prompts[lo:lo + b], params, use_tqdm=False)]
                walls.append(time.perf_counter() - t0)
            wall = sorted(walls)[len(walls) // 2]
            after = llm.stats().spec or {}
            toks = sum(len(o.outputs[0].token_ids) for o in outs)
            runs = len(walls)  # counts per run (the runs are identical)
            prop = (after.get("proposed", 0) - before.get("proposed", 0)) / runs
            acc = (after.get("accepted", 0) - before.get("accepted", 0)) / runs
            ver = (after.get("verifications", 0) - before.get("verifications", 0)) / runs
            rows.append({"method": method, "batch": b, "prompts": len(outs), "output_tokens": toks, "wall_s": wall,
                         "walls_s": walls,
                         "tokens_per_s": toks / wall, "proposed": prop, "accepted": acc,
                         "acceptance_rate": acc / prop if prop else None,
                         "mean_accepted_length": 1 + acc / ver if ver else None,
                         "acceptance_by_position": by_position(before, after),
                         "draft_s_per_round": timers.draft_s / timers.drafted if timers.drafted else None,
                         "verify_step_s": timers.verify_s / timers.verify_steps if timers.verify_steps else None,
                         "decode_step_s": timers.plain_s / timers.plain_steps if timers.plain_steps else None})
        del llm
    for r in rows:
        ref = next(x for x in rows if x["method"] == rows[0]["method"] and x["batch"] == r["batch"])
        r["speedup_vs_first"] = r["tokens_per_s"] / ref["tokens_per_s"]
        step = ref["decode_step_s"] or r["decode_step_s"]  # a plain decode step of this batch
        r["draft_cost_vs_step"] = r["draft_s_per_round"] / step if step and r["draft_s_per_round"] else None
        r["verify_cost_vs_step"] = r["verify_step_s"] / step if step and r["verify_step_s"] else None
    print(f"task: {a.task}")
    print(f"{'method':>6} {'batch':>5} {'tok/s':>8} {'speedup':>8} {'accept':>7} {'mean len':>8} "
          f"{'draft/step':>10} {'verify/step':>11}")
    fmt = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
    for r in rows:
        print(f"{r['method']:>6} {r['batch']:>5} {r['tokens_per_s']:>8.1f} {r['speedup_vs_first']:>7.2f}x "
              f"{fmt(r['acceptance_rate'], '.1%'):>7} {fmt(r['mean_accepted_length'], '.2f'):>8} "
              f"{fmt(r['draft_cost_vs_step'], '.3f'):>10} {fmt(r['verify_cost_vs_step'], '.2f'):>11}")
    path = write_json(output_path(a.output_json, "spec"),
                      {"bench": "spec", "task": a.task, "rows": rows, "meta": run_metadata(vars(a) | {"func": None})})
    print(f"[figures written to {path}]", file=sys.stderr)
    return 0
