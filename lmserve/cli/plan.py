"""`lmserve plan`: the planner's command line over lmserve.plan (the cost model): a model by name or
by an explicit shape, a device, dtypes, batch and length; the report as text or JSON."""

from __future__ import annotations

import argparse
import json
from typing import Any

from lmserve.plan import DEVICES, DTYPE_BYTES, KV_DTYPES, LINKS, PlanModel, model_from_name, plan, render
from lmserve.utils import above, at_least, given_flags

SHAPE_FLAGS = ("heads", "kv_heads", "head_dim", "hidden", "intermediate", "vocab", "params")


def model_from_args(a: argparse.Namespace) -> PlanModel:
    if a.layers:
        if "--model" in given_flags(getattr(a, "argv", [])):  # (it has a default: only the command line tells)
            raise ValueError("--model: an explicit shape (--layers ...) is planned instead of a model; give one of them")
        need = ["kv_heads", "head_dim"]
        missing = [n for n in need if getattr(a, n) is None]
        if missing:
            raise ValueError(f"plan: with --layers also give --{', --'.join(m.replace('_', '-') for m in missing)}")
        heads = a.heads or a.kv_heads
        if heads % a.kv_heads:
            raise ValueError(f"--heads: {heads} query heads must be a multiple of the {a.kv_heads} KV heads")
        hidden = a.hidden or heads * a.head_dim
        return PlanModel("custom", a.layers, heads, a.kv_heads, a.head_dim, hidden,
                         a.intermediate or 4 * hidden, a.vocab or 32000, params=a.params, split_embedding=a.params is None)
    given = [n for n in SHAPE_FLAGS if getattr(a, n) is not None]
    if given:  # a flag the plan would ignore is refused
        raise ValueError(f"--{given[0].replace('_', '-')}: describes an explicit shape: give it with --layers")
    return model_from_name(a.model)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("plan", help="KV-memory and roofline planner")
    add_arguments(p)
    p.set_defaults(func=cmd_plan)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The planner's options: a model (a name or an explicit shape), a device, dtypes, batch and length."""
    p.add_argument("--model", default="smollm2-135m",
                   help="a known shape (e.g. qwen3-0.6b, llama-3.1-8b, deepseek-v3), config.json, GGUF or HF folder")
    for name in ("layers", "heads", "kv_heads", "head_dim", "hidden", "intermediate", "vocab"):
        p.add_argument(f"--{name.replace('_', '-')}", dest=name, type=at_least(1), default=None)
    p.add_argument("--params", type=above(0, finite=True), default=None, help="parameter count (with explicit shape)")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPE_BYTES))
    p.add_argument("--kv-dtype", default=None, choices=sorted(KV_DTYPES),
                   help="the KV cache's (default: the weights' dtype; a quantized model's cache is bf16, fp32 on cpu)")
    p.add_argument("--device", default="h100", choices=sorted(DEVICES))
    p.add_argument("--mem-gb", type=above(0, finite=True), default=None)
    p.add_argument("--bandwidth-tbs", type=above(0, finite=True), default=None)
    p.add_argument("--tflops", type=above(0, finite=True), default=None)
    p.add_argument("--gpu-memory-utilization", type=above(0, 1), default=0.9)
    p.add_argument("--batch", type=at_least(1), default=1)
    p.add_argument("--seq-len", type=at_least(1), default=1024)
    p.add_argument("--tensor-parallel-size", type=at_least(1), default=1, help="ranks sharing every layer")
    p.add_argument("--link-gbs", type=above(0, finite=True), default=None, help="link GB/s between ranks (default: by device)")
    p.add_argument("--link-latency-us", type=at_least(0, float, finite=True), default=None,
                   help="us per small collective (default: by device)")
    p.add_argument("--json", action="store_true")


def cmd_plan(a: argparse.Namespace) -> int:
    base = DEVICES[a.device]
    dev = (a.mem_gb or base[0], a.bandwidth_tbs or base[1], a.tflops or base[2])
    if a.tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {a.tensor_parallel_size}")
    if a.tensor_parallel_size == 1 and (a.link_gbs is not None or a.link_latency_us is not None):
        raise ValueError(f"--{'link-gbs' if a.link_gbs is not None else 'link-latency-us'}: the link between "
                         f"ranks counts only with --tensor-parallel-size > 1")
    link = (a.link_gbs or LINKS[a.device][0], LINKS[a.device][1] if a.link_latency_us is None else a.link_latency_us)
    r = plan(model_from_args(a), dev, a.dtype, a.kv_dtype, a.batch, a.seq_len, a.gpu_memory_utilization,
             tp=a.tensor_parallel_size, link=link, act_bytes=4 if a.device == "cpu" else None)
    print(json.dumps(r, indent=2) if a.json else render(r))
    return 0
