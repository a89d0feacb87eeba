"""Command line: `lmserve generate | chat | serve | bench | plan`. A thin layer over the library."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from lmserve.config import DEFAULT_MODEL


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine options, named as vLLM names its flags."""
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=DEFAULT_MODEL, help="HF folder, .gguf file, or a known name (default %(default)s)")
    g.add_argument("--tokenizer", default=None, help="tokenizer folder, if not beside the model")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-num-seqs", type=int, default=None, help="default 64 on CPU, 256 on CUDA")
    g.add_argument("--max-num-batched-tokens", type=int, default=None, help="default 512 on CPU, 8192 on CUDA")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--kv-cache-memory", default=None,
                   help="KV cache budget, e.g. 2GiB, 512MiB (default: 1GiB on CPU; on CUDA what "
                        "--gpu-memory-utilization leaves after a profiled step)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16, float16")
    g.add_argument("--device", default="cpu")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--attention-backend", choices=["auto", "torch", "triton"], default="auto")
    g.add_argument("--enforce-eager", action="store_true", help="CUDA: no CUDA graphs for decode steps")
    g.add_argument("--cuda-graph-sizes", type=int, nargs="+", default=None,
                   help="decode batch sizes to capture (default 1 2 4 8 16 ... max-num-seqs)")
    g.add_argument("--speculative-method", choices=["ngram", "draft"], default=None)
    g.add_argument("--num-speculative-tokens", type=int, default=3)
    g.add_argument("--draft-model", default=None, help="draft model (default: the target itself, truncated)")
    g.add_argument("--draft-num-layers", type=int, default=None, help="keep only the draft's first N layers")
    g.add_argument("--ngram-min", type=int, default=1)
    g.add_argument("--ngram-max", type=int, default=3)
    g.add_argument("--spec-max-batch", type=int, default=8, help="no speculation above this many running seqs")


def engine_kwargs(a: argparse.Namespace) -> dict[str, Any]:
    return dict(tokenizer=a.tokenizer, block_size=a.block_size, max_num_seqs=a.max_num_seqs,
                max_num_batched_tokens=a.max_num_batched_tokens, enable_prefix_caching=a.enable_prefix_caching,
                kv_cache_memory=a.kv_cache_memory, gpu_memory_utilization=a.gpu_memory_utilization, dtype=a.dtype, device=a.device, seed=a.seed,
                max_model_len=a.max_model_len, attention_backend=a.attention_backend, speculative_method=a.speculative_method,
                num_speculative_tokens=a.num_speculative_tokens, draft_model=a.draft_model,
                draft_num_layers=a.draft_num_layers, ngram_min=a.ngram_min, ngram_max=a.ngram_max,
                spec_max_batch=a.spec_max_batch, enforce_eager=a.enforce_eager, cuda_graph_sizes=a.cuda_graph_sizes)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--sampling-seed", "--request-seed", dest="request_seed", type=int, default=None,
                   help="per-request seed (same text whatever else runs)")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def sampling_params(a: argparse.Namespace):  # type: ignore[no-untyped-def]
    from lmserve import SamplingParams
    return SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                          min_p=a.min_p, repetition_penalty=a.repetition_penalty, seed=a.request_seed,
                          stop=a.stop, ignore_eos=a.ignore_eos)


def cmd_generate(a: argparse.Namespace) -> int:
    from lmserve import LLM
    prompts = list(a.prompts)
    if a.prompts_file:
        with open(a.prompts_file) as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        print("error: give at least one prompt", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    llm = LLM(a.model, **engine_kwargs(a))
    load = time.perf_counter() - t0
    params = sampling_params(a)
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
    cap = llm.engine.graph_capture_time
    capture = "" if cap is None else f", incl. CUDA graph capture {cap:.1f} s"
    if a.json:
        print(json.dumps({"outputs": [
            {"prompt": p, "text": o.outputs[0].text, "token_ids": o.outputs[0].token_ids,
             "finish_reason": o.outputs[0].finish_reason,
             "metrics": {"ttft_s": o.metrics.ttft, "tpot_s": o.metrics.tpot, "e2e_s": o.metrics.e2e,
                         "prompt_tokens": o.metrics.num_prompt_tokens, "cached_tokens": o.metrics.num_cached_tokens}}
            for p, o in zip(prompts, outs)], "summary": summary}, indent=2))
    else:
        for p, o in zip(prompts, outs):
            if len(prompts) > 1:
                print(f"--- {p!r}")
            print(o.outputs[0].text)
        print(f"[{n_out} tokens from {len(prompts)} prompt(s) in {wall:.2f} s: "
              f"{n_out / wall:.1f} tok/s; model loaded in {load:.1f} s{capture}]", file=sys.stderr)
    return 0


def cmd_chat(a: argparse.Namespace) -> int:
    from lmserve import LLM
    llm = LLM(a.model, **engine_kwargs(a))
    if llm.tokenizer is None or not llm.tokenizer.has_chat_template:
        print("error: this model has no chat template", file=sys.stderr)
        return 2
    params = sampling_params(a)
    history: list[dict[str, str]] = [{"role": "system", "content": a.system}] if a.system else []
    eng = llm.engine
    turn = 0
    print("lmserve chat: type a message, /reset to clear history, /exit or Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            history = history[:1] if a.system else []
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        prompt = llm.tokenizer.apply_chat_template(history)
        rid = f"chat-{turn}"
        turn += 1
        try:
            eng.add_request(rid, llm.tokenizer.encode(prompt, add_special_tokens=False), params)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            history.pop()
            continue
        text = ""
        while eng.has_unfinished_requests():
            for out in eng.step():
                delta = out.outputs[0].delta_text
                text += delta
                print(delta, end="", flush=True)
        print()
        history.append({"role": "assistant", "content": text})


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lmserve", description="LLM inference and serving engine")
    sub = p.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate text for one or more prompts")
    g.add_argument("prompts", nargs="*", help="prompt text(s)")
    g.add_argument("--prompts-file", help="a file with one prompt per line")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template as a user turn")
    g.add_argument("--json", action="store_true", help="print JSON (text, token ids, metrics)")
    add_engine_args(g)
    add_sampling_args(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat, streaming tokens as they come")
    c.add_argument("--system", default=None, help="system message")
    add_engine_args(c)
    add_sampling_args(c)
    c.set_defaults(func=cmd_chat, max_tokens=256, temperature=0.7)

    _add_optional_commands(sub)
    return p


def _add_optional_commands(sub: Any) -> None:
    """serve / bench / plan register themselves from their modules (kept out of the core import path)."""
    from lmserve import plan
    plan.add_parser(sub)
    try:
        from lmserve.server import cli as server_cli
        server_cli.add_parser(sub)
    except ImportError:
        pass
    from lmserve.bench import cli as bench_cli
    bench_cli.add_parser(sub)


def main(argv: list[str] | None = None) -> int:
    import logging
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
