"""`lmserve generate`: text for one or more prompts, batched; plain text or JSON with metrics."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from lmserve.cli.engine_args import add_engine_args, engine_kwargs
from lmserve.cli.sampling_args import add_sampling_args, sampling_params
from lmserve.llm import LLM
from lmserve.outputs import RequestOutput


def add_parser(sub: Any) -> None:
    g = sub.add_parser("generate", help="generate text for one or more prompts")
    g.add_argument("prompts", nargs="*", help="prompt text(s)")
    g.add_argument("--prompts-file", help="a file with one prompt per line")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template as a user turn")
    g.add_argument("--json", action="store_true", help="print JSON (text, token ids, metrics)")
    add_engine_args(g)
    add_sampling_args(g)
    g.set_defaults(func=cmd_generate)


def _prompts(a: argparse.Namespace) -> list[str]:
    """The prompts on the command line, then the non-blank lines of --prompts-file."""
    prompts = list(a.prompts)
    if a.prompts_file:
        with open(a.prompts_file) as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    return prompts


def cmd_generate(a: argparse.Namespace) -> int:
    prompts = _prompts(a)
    if not prompts:
        print("error: give at least one prompt", file=sys.stderr)
        return 2
    params = sampling_params(a)  # bad flags (a schema file that does not parse) fail before the model loads
    t0 = time.perf_counter()
    llm = LLM(a.model, **engine_kwargs(a))
    load = time.perf_counter() - t0
    if a.chat and (llm.tokenizer is None or not llm.tokenizer.has_chat_template):
        print("error: --chat: this model has no chat template", file=sys.stderr)
        return 2
    params = sampling_params(a, llm.sampling_defaults)  # the model's generation config under the flags
    if a.chat:
        ids = [llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]),
                                    add_special_tokens=False) for p in prompts]
    t1 = time.perf_counter()
    outs = llm.generate(ids if a.chat else prompts, params, use_tqdm=len(prompts) > 1 and not a.json)
    wall = time.perf_counter() - t1
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    summary = {"num_prompts": len(prompts), "output_tokens": n_out, "wall_s": round(wall, 3),
               "output_tokens_per_s": round(n_out / wall, 2), "load_s": round(load, 2),
               "cuda_graph_capture_s": llm.engine.graph_capture_time}
    if a.json:
        _print_json(prompts, outs, summary)
    else:
        _print_text(prompts, outs, wall, load, llm.engine.graph_capture_time)
    return 0


def _print_json(prompts: list[str], outs: list[RequestOutput], summary: dict[str, Any]) -> None:
    """Each prompt's text, token ids, finish reason and metrics, and the summary, as one JSON object."""
    print(json.dumps({"outputs": [
        {"prompt": p, "text": o.outputs[0].text, "token_ids": o.outputs[0].token_ids,
         "finish_reason": o.outputs[0].finish_reason,
         "metrics": {"ttft_s": o.metrics.ttft, "tpot_s": o.metrics.tpot, "e2e_s": o.metrics.e2e,
                     "prompt_tokens": o.metrics.num_prompt_tokens, "cached_tokens": o.metrics.num_cached_tokens}}
        for p, o in zip(prompts, outs)], "summary": summary}, indent=2))


def _print_text(prompts: list[str], outs: list[RequestOutput], wall: float, load: float, cap: float | None) -> None:
    """The texts on stdout (each under its prompt when there are several), the timings on stderr."""
    for p, o in zip(prompts, outs):
        if len(prompts) > 1:
            print(f"--- {p!r}")
        print(o.outputs[0].text)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    capture = "" if cap is None else f", incl. CUDA graph capture {cap:.1f} s"
    print(f"[{n_out} tokens from {len(prompts)} prompt(s) in {wall:.2f} s: "
          f"{n_out / wall:.1f} tok/s; model loaded in {load:.1f} s{capture}]", file=sys.stderr)
