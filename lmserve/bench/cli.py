"""`lmserve bench throughput | latency | serve | spec | parallel`: throughput and latency here, the other
three in their own modules (bench/serve.py, bench/spec.py, bench/parallel.py)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from lmserve.cli.engine_args import add_engine_args, engine_kwargs
from lmserve.utils import at_least


def _common(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument("--model-shape", default=None,
                   help="random-weight model of a named real shape (e.g. qwen3-0.6b), instead of --model")
    p.add_argument("--compare", action="append", choices=["hf", "naive", "llamacpp"], default=[],
                   help="also run a baseline in the same process (repeatable); llamacpp: llama-cpp-python "
                        "(optional) on the same GGUF file")
    p.add_argument("--hf-batch-size", type=int, default=None, help="static batch size of the HF baseline")
    p.add_argument("--threads", type=at_least(1), default=None,
                   help="CPU threads for lmserve (torch.set_num_threads) and llama.cpp (default: torch's)")
    p.add_argument("--output-json", default=None, help="where to write all figures (default bench_out/...)")
    p.add_argument("--plot", action="store_true", help="also write a PNG next to the JSON")
    p.add_argument("--no-progress", action="store_true")


def add_parser(sub: Any) -> None:
    b = sub.add_parser("bench", help="benchmarks: throughput, latency, serve, spec, parallel")
    bs = b.add_subparsers(dest="bench_cmd", required=True)

    t = bs.add_parser("throughput", help="offline throughput on the guide's workload")
    _common(t)
    t.add_argument("--preset", choices=["gpu", "cpu", "tiny"], default=None,
                   help="workload size (default: gpu on CUDA, cpu otherwise)")
    t.add_argument("--num-requests", type=at_least(1), default=None)
    t.add_argument("--input-len", type=at_least(1), nargs=2, default=None, metavar=("MIN", "MAX"))
    t.add_argument("--output-len", type=at_least(1), nargs=2, default=None, metavar=("MIN", "MAX"))
    t.add_argument("--temperature", type=float, default=0.6)
    t.add_argument("--json-schema", default=None, metavar="FILE",
                   help="also run the workload with every output held to this JSON schema (same run), and time "
                        "its compile")
    t.set_defaults(func=cmd_throughput)

    lat = bs.add_parser("latency", help="fixed-length latency: TTFT, TPOT, achieved bandwidth")
    _common(lat)
    lat.add_argument("--batch-size", type=at_least(1), default=1)
    lat.add_argument("--input-len", type=at_least(1), default=128)
    lat.add_argument("--output-len", type=at_least(1), default=128)
    lat.add_argument("--repeats", type=at_least(1), default=3)
    lat.add_argument("--peak-bandwidth-tbs", type=float, default=None,
                     help="peak memory bandwidth (default: measured with a large device copy)")
    lat.add_argument("--naive-max-len", type=int, default=256, help="longest context for --compare naive")
    lat.set_defaults(func=cmd_latency)

    from lmserve.bench import parallel as parallel_bench
    from lmserve.bench import serve as serve_bench
    from lmserve.bench import spec as spec_bench
    serve_bench.add_parser(bs)
    spec_bench.add_parser(bs)
    parallel_bench.add_parser(bs)


def _llm(a: argparse.Namespace):  # type: ignore[no-untyped-def]
    from lmserve import LLM
    if a.model_shape:
        a.model = f"shape:{a.model_shape}"
    if a.threads:
        import torch
        torch.set_num_threads(a.threads)
    return LLM(a.model, **engine_kwargs(a))


def _llamacpp(a: argparse.Namespace) -> tuple[Any, Path] | None:
    """--compare llamacpp: (llama_cpp, GGUF path), checked before our engine loads; a clear error if the
    model is not a GGUF file or the optional package is missing."""
    if "llamacpp" not in a.compare:
        return None
    from lmserve.bench.llamacpp import check
    return check(f"shape:{a.model_shape}" if a.model_shape else a.model)


def _threads(a: argparse.Namespace) -> int:
    import torch
    return a.threads or torch.get_num_threads()


def _constrained(a: argparse.Namespace, llm, reqs, res: dict[str, Any]) -> str:  # type: ignore[no-untyped-def]
    """The same workload with every output held to --json-schema: its throughput against the free run's,
    and the compile times (the tokenizer's vocabulary processed once per engine, then the schema)."""
    import json as json_lib

    from lmserve.bench.offline import run_throughput
    from lmserve.sequence import StructuredOutputsParams
    spec = StructuredOutputsParams(json=json_lib.loads(Path(a.json_schema).read_text()))
    s = llm.engine.structured
    t0 = time.perf_counter()
    s._get_compiler()
    t1 = time.perf_counter()
    s.compile(spec)
    t2 = time.perf_counter()
    r = res["constrained"] = run_throughput(llm, reqs, a.temperature, a.seed, progress=not a.no_progress,
                                            structured=spec)
    # the free workload again, after: the first run also paid one-time costs (the KV pool's pages touched
    # for the first time), so the constrained run is compared with the free run on either side of it
    again = res["lmserve_again"] = run_throughput(llm, reqs, a.temperature, a.seed, progress=not a.no_progress)
    free = max(res["lmserve"]["output_tokens_per_s"], again["output_tokens_per_s"])
    r["tokenizer_info_s"], r["schema_compile_s"] = t1 - t0, t2 - t1
    r["vs_unconstrained"] = r["output_tokens_per_s"] / free
    return (f"lmserve, every output held to {a.json_schema}: {r['output_tokens_per_s']:,.1f} output tok/s "
            f"({r['output_tokens']} tokens) = {r['vs_unconstrained']:.1%} of unconstrained (the better of the free "
            f"runs before and after: {res['lmserve']['output_tokens_per_s']:,.1f} / {again['output_tokens_per_s']:,.1f}"
            f"); grammar compile {r['schema_compile_s'] * 1e3:.1f} ms (the vocabulary, once per engine: "
            f"{r['tokenizer_info_s']:.2f} s)")


def _llamacpp_line(x: dict[str, Any], a: argparse.Namespace) -> str:
    """The llama.cpp row's head; records in x which weight scheme our engine ran (llama.cpp always reads
    the GGUF file's own blocks)."""
    from lmserve.models.loader import resolve_quantization
    ours = x["lmserve_quantization"] = resolve_quantization(a.quantization, "gguf", a.device)
    q = a.quantization if a.quantization == ours else f"{a.quantization} (= {ours or 'float'})"
    return (f"llama.cpp (llama-cpp-python {x['llama_cpp_version']}, {x['n_threads']} threads, the same GGUF on its "
            f"own kernels; lmserve ran --quantization {q}; {x['note']})")


def _hf_model(a: argparse.Namespace, llm):  # type: ignore[no-untyped-def]
    from lmserve.bench.hf import load_hf_model
    return load_hf_model(a.model, llm.engine.config.torch_dtype, a.device, a.seed)


def cmd_throughput(a: argparse.Namespace) -> int:
    from lmserve.bench.common import PRESETS, output_path, random_workload, run_metadata, write_json
    from lmserve.bench.offline import run_throughput
    lc = _llamacpp(a)
    llm = _llm(a)
    preset = dict(PRESETS[a.preset or ("gpu" if a.device.startswith("cuda") else "cpu")])
    if a.num_requests:
        preset["num_requests"] = a.num_requests
    if a.input_len:
        preset["input_len"] = tuple(a.input_len)
    if a.output_len:
        preset["output_len"] = tuple(a.output_len)
    reqs = random_workload(vocab_size=llm.engine.vocab_size, seed=a.seed, **preset)
    warm = random_workload(2, (8, 16), (2, 4), llm.engine.vocab_size, seed=a.seed + 1)
    run_throughput(llm, warm, progress=False)
    res: dict[str, Any] = {"bench": "throughput", "workload": preset, "lmserve": None, "baselines": {}}
    res["lmserve"] = run_throughput(llm, reqs, a.temperature, a.seed, progress=not a.no_progress)
    ours = res["lmserve"]["output_tokens_per_s"]
    lines = [f"lmserve: {ours:,.1f} output tok/s, {res['lmserve']['total_tokens_per_s']:,.1f} total tok/s, "
             f"{res['lmserve']['requests_per_s']:.2f} req/s, peak KV blocks {res['lmserve']['peak_kv_blocks_used']}"
             f"/{res['lmserve']['kv_blocks_total']}, prefix hit rate {res['lmserve']['prefix_cache_hit_rate']:.1%}, "
             f"preemptions {res['lmserve']['preemptions']}"]
    if a.json_schema:
        lines.append(_constrained(a, llm, reqs, res))
    if "hf" in a.compare:
        from lmserve.bench.hf import hf_generate
        hf = _hf_model(a, llm)
        bsz = a.hf_batch_size or (64 if a.device.startswith("cuda") else 8)
        res["baselines"]["hf"] = hf_generate(hf, reqs, bsz, a.device, progress=not a.no_progress)
        theirs = res["baselines"]["hf"]["output_tokens_per_s"]
        res["baselines"]["hf"]["lmserve_speedup"] = ours / theirs
        lines.append(f"HF transformers generate (static batches of {bsz}): {theirs:,.1f} output tok/s "
                     f"-> lmserve is {ours / theirs:.2f}x")
        del hf
    if lc:
        from lmserve.bench.llamacpp import throughput
        x = res["baselines"]["llamacpp"] = throughput(*lc, reqs, a.temperature, _threads(a), a.seed,
                                                      progress=not a.no_progress)
        x["lmserve_speedup"] = ours / x["output_tokens_per_s"]
        lines.append(f"{_llamacpp_line(x, a)}: {x['output_tokens_per_s']:,.1f} output tok/s, "
                     f"{x['total_tokens_per_s']:,.1f} total tok/s -> lmserve is {x['lmserve_speedup']:.2f}x")
    res["meta"] = run_metadata(vars(a) | {"func": None})
    print("\n".join(lines))  # (first: a file that cannot be written does not lose them)
    path = write_json(output_path(a.output_json, "throughput"), res)
    if a.plot:
        from lmserve.bench.plots import bars
        vals = {"lmserve": ours} | {label: res["baselines"][k]["output_tokens_per_s"] for k, label in
                                    (("hf", "HF generate"), ("llamacpp", "llama.cpp")) if k in res["baselines"]}
        bars(f"Output tokens/s ({a.model}, {a.device})", vals, "output tokens / s", path.with_suffix(".png"))
    print(f"[figures written to {path}]", file=sys.stderr)
    return 0


def cmd_latency(a: argparse.Namespace) -> int:
    from lmserve.bench.common import output_path, run_metadata, write_json
    from lmserve.bench.offline import run_latency, run_naive_vs_cached
    lc = _llamacpp(a)
    llm = _llm(a)
    peak = a.peak_bandwidth_tbs * 1e12 if a.peak_bandwidth_tbs else None
    res: dict[str, Any] = {"bench": "latency", "baselines": {}}
    r = res["lmserve"] = run_latency(llm, a.batch_size, a.input_len, a.output_len, a.repeats, peak, a.seed)
    r["load_time_s"] = llm.engine.load_time  # cold start: model load + KV cache (+ graph capture)
    lines = [f"lmserve engine load {r['load_time_s']:.1f} s; batch {a.batch_size}, {a.input_len} in / {a.output_len} out: TTFT p50 "
             f"{r['ttft_s']['p50'] * 1e3:.1f} ms, TPOT p50 {r['tpot_s']['p50'] * 1e3:.2f} ms "
             f"(p90 {r['tpot_s']['p90'] * 1e3:.2f}, p99 {r['tpot_s']['p99'] * 1e3:.2f}), "
             f"{r['tokens_per_s']:,.1f} tok/s end to end, {r['decode_tokens_per_s']:,.1f} tok/s decode; "
             f"bandwidth {r['achieved_bandwidth_gbs']:.1f} GB/s = {r['bandwidth_fraction']:.1%} of "
             f"{r['peak_bandwidth_gbs']:.1f} GB/s"]
    if "hf" in a.compare:
        from lmserve.bench.hf import hf_latency
        hf = _hf_model(a, llm)
        import random
        rng = random.Random(a.seed)
        prompt = [rng.randrange(10, llm.engine.vocab_size) for _ in range(a.input_len)]
        h = res["baselines"]["hf"] = hf_latency(hf, prompt, a.batch_size, a.output_len, a.device)
        h["lmserve_speedup_tokens_per_s"] = r["tokens_per_s"] / h["tokens_per_s"]
        lines.append(f"HF transformers generate: TTFT {h['ttft_s'] * 1e3:.1f} ms, TPOT {h['tpot_s'] * 1e3:.2f} ms, "
                     f"{h['tokens_per_s']:,.1f} tok/s -> lmserve is {r['tokens_per_s'] / h['tokens_per_s']:.2f}x")
        del hf
    if lc:
        from lmserve.bench.common import latency_prompts
        from lmserve.bench.llamacpp import latency
        rounds = latency_prompts(llm.engine.vocab_size, a.batch_size, a.input_len, a.repeats, a.seed)
        x = res["baselines"]["llamacpp"] = latency(*lc, rounds, a.output_len, _threads(a), a.seed)
        x["lmserve_speedup_tokens_per_s"] = r["tokens_per_s"] / x["tokens_per_s"]
        lines.append(f"{_llamacpp_line(x, a)}: load {x['load_time_s']:.1f} s; TTFT p50 "
                     f"{x['ttft_s'] * 1e3:.1f} ms, TPOT p50 {x['tpot_s'] * 1e3:.2f} ms "
                     f"(p90 {x['tpot_percentiles_s']['p90'] * 1e3:.2f}, "
                     f"p99 {x['tpot_percentiles_s']['p99'] * 1e3:.2f}), "
                     f"{x['tokens_per_s']:,.1f} tok/s end to end, {x['decode_tokens_per_s']:,.1f} tok/s decode "
                     f"-> lmserve is {x['lmserve_speedup_tokens_per_s']:.2f}x")
    if "naive" in a.compare:
        n = res["baselines"]["naive"] = run_naive_vs_cached(llm, a.naive_max_len)
        lines.append("time per token vs length (ms), naive | cached: " + ", ".join(
            f"{L}: {x * 1e3:.1f} | {y * 1e3:.1f}" for L, x, y in
            zip(n["lengths"], n["naive_s_per_token"], n["cached_s_per_token"])))
    res["meta"] = run_metadata(vars(a) | {"func": None})
    print("\n".join(lines))  # (first: a file that cannot be written does not lose them)
    path = write_json(output_path(a.output_json, "latency"), res)
    if a.plot:
        from lmserve.bench.plots import bars, naive_curve
        if "naive" in res["baselines"]:
            naive_curve(res["baselines"]["naive"], path.with_name(path.stem + "-naive.png"))
        vals = {"lmserve": r["tokens_per_s"]} | {label: res["baselines"][k]["tokens_per_s"] for k, label in
                                                 (("hf", "HF generate"), ("llamacpp", "llama.cpp"))
                                                 if k in res["baselines"]}
        bars(f"Batch-{a.batch_size} tokens/s ({a.model}, {a.device})", vals, "tokens / s", path.with_suffix(".png"))
    print(f"[figures written to {path}]", file=sys.stderr)
    return 0
