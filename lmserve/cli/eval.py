"""`lmserve eval perplexity`: what a quantization (of the weights, of the KV cache) costs on real text.
On a CPU whose tile kernel takes int8 activations (VNNI, or AVX2's avx2int8 path) a quantized model's
linears also round their inputs to int8 per 32 columns: its label says `acts=int8`, and the figure is
that of weights and activations together, as the engine serves it (LMSERVE_ISA=avx2: float inputs).

Sliding-window perplexity over a fixed text through the engine's own forward (LLM.score: teacher-
forced through the paged cache), and the top-1 agreement, position by position, with a reference: the
same model unquantized unless --reference-* say otherwise. One table line per configuration, and a
JSON with every figure and the run's metadata.

The default text (tests/data/declaration_gettysburg.txt in a checkout) is the Declaration of
Independence (1776) and the Gettysburg Address (1863): public-domain English prose, 1,620 words.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path
from typing import Any

from lmserve.cli.engine_args import add_engine_args, engine_kwargs
from lmserve.config import KV_CACHE_DTYPES, QUANTIZATIONS
from lmserve.utils import at_least

DEFAULT_TEXT = Path(__file__).resolve().parents[2] / "tests" / "data" / "declaration_gettysburg.txt"


def add_parser(sub: Any) -> None:
    e = sub.add_parser("eval", help="evaluate a model: perplexity and agreement with the unquantized model")
    es = e.add_subparsers(dest="eval_cmd", required=True)
    p = es.add_parser("perplexity", help="sliding-window perplexity over a text, top-1 agreement with a reference")
    add_engine_args(p)
    p.add_argument("--text", default=None, help=f"plain-text file (default: {DEFAULT_TEXT.name} from tests/data, "
                                                "public-domain prose, when run from a checkout)")
    p.add_argument("--window", type=at_least(2), default=None, help="tokens per window (default: the model's context)")
    p.add_argument("--stride", type=at_least(1), default=None, help="tokens between window starts (default: window / 2)")
    p.add_argument("--max-tokens", type=at_least(2), default=None, help="score only the text's first N tokens")
    p.add_argument("--decode", action="store_true",
                   help="score each window's targets by one-token decode steps (the path generation takes: "
                        "decode-sized kernels) instead of one prefill")
    p.add_argument("--reference-model", default=None, help="reference model (default: --model)")
    p.add_argument("--reference-quantization", default="none",
                   choices=["none", *[q for q in QUANTIZATIONS if q]], help="reference weights (default none)")
    p.add_argument("--reference-kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="reference KV cache (default auto: the model dtype)")
    p.add_argument("--reference-dtype", default=None, help="reference dtype (default: --dtype)")
    p.add_argument("--output-json", default=None, help="where to write the figures (default bench_out/...)")
    p.add_argument("--json", action="store_true", help="print the JSON instead of the table")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_perplexity)


def _label(model: str, kw: dict[str, Any]) -> str:
    from lmserve.layers import cpu_native
    int8_acts = (kw.get("quantization") in ("int8", "int4", "gguf", "awq") and str(kw.get("device", "cpu")) == "cpu"
                 and cpu_native.isa() in ("vnni", "avx2int8"))  # the tile kernel rounds x to int8 per 32 columns
    return (f"{model} {kw.get('dtype', 'auto')} weights={kw.get('quantization') or 'none'}"
            f"{' acts=int8' if int8_acts else ''} kv={kw.get('kv_cache_dtype', 'auto')}")


def _timed(score: Any, spent: dict[str, float], name: str) -> Any:
    def fn(ids: list[int]) -> Any:
        t0 = time.perf_counter()
        out = score(ids)
        spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
        return out
    return fn


def read_text(path: str | None) -> tuple[Path, str]:
    p = Path(path) if path else DEFAULT_TEXT
    if not p.is_file():
        raise FileNotFoundError(f"text: no file {str(p)!r}" + ("" if path else " (give --text FILE)"))
    text = p.read_text(encoding="utf-8")
    if not text.strip():
        raise ValueError(f"text: {p} is empty")
    return p, text


def cmd_perplexity(a: argparse.Namespace) -> int:
    from lmserve.bench.common import output_path, run_metadata, write_json
    from lmserve.llm import LLM
    from lmserve.quant.perplexity import evaluate_perplexity

    path, text = read_text(a.text)
    kw = engine_kwargs(a)
    ref_kw = {**kw, "quantization": None if a.reference_quantization == "none" else a.reference_quantization,
              "kv_cache_dtype": a.reference_kv_cache_dtype, "dtype": a.reference_dtype or kw["dtype"]}
    if a.reference_quantization not in ("int8", "int4"):  # (the model's group size is no float reference's)
        ref_kw["quantization_group_size"] = None
    ref_model = a.reference_model or a.model
    from lmserve.config import resolve_dtype
    from lmserve.models.loader import resolve_model, resolve_quantization
    from lmserve.quant.checkpoint import read_quantization_config
    if a.reference_dtype is not None:
        try:
            resolve_dtype(a.reference_dtype, kw["device"])
        except ValueError as e:
            raise ValueError(f"reference-dtype: {str(e).partition(': ')[2]}") from None
    for m, k in ((a.model, kw), (ref_model, ref_kw)):  # `auto` as it resolves for that model: labels, sameness
        src = resolve_model(m)
        k["quantization"] = resolve_quantization(k["quantization"], src.kind, k["device"])
        if src.kind == "hf" and read_quantization_config(src.path) is not None:
            k["quantization"] = "awq"  # an AutoAWQ folder loads as awq, asked or not (loader._quantize)
    if ref_kw["quantization"] == "awq" and a.reference_quantization == "none":
        raise ValueError(f"reference-model: {ref_model!r} is an AWQ checkpoint, with no unquantized weights to compare "
                         f"with; give --reference-model (the float model it was made from)")
    t0 = time.perf_counter()
    ref = LLM(ref_model, **ref_kw)
    same = ref_model == a.model and ref_kw == kw
    llm = ref if same else LLM(a.model, **kw)
    load_s = time.perf_counter() - t0
    if llm.tokenizer is None:
        raise ValueError(f"model: {a.model!r} has no tokenizer, so it cannot read a text")
    ids = llm.engine.tokenize_prompt(text)
    if not same and ref.engine.tokenize_prompt(text) != ids:
        raise ValueError("reference-model: its tokenizer splits the text differently, so positions cannot be compared")
    if a.max_tokens is not None:
        ids = ids[:a.max_tokens]
    ctx = min(llm.engine.max_model_len, ref.engine.max_model_len)
    window = a.window or ctx
    if window > ctx:
        raise ValueError(f"window: {window} tokens is more than the model's context ({ctx})")
    stride = a.stride or max(1, window // 2)

    ref_name, name = _label(ref_model, ref_kw), _label(a.model, kw)
    spent: dict[str, float] = {}
    def scorer(m: LLM) -> Any:  # ids -> logits (T, V): one prefill, or (--decode) the scored part decoded
        if not a.decode:
            return m.score
        return lambda ids: m.score(ids, decode_from=max(1, len(ids) - stride - 1))

    models = {ref_name: _timed(scorer(ref), spent, ref_name)}
    if not same:
        models[name] = _timed(scorer(llm), spent, name)
    bar = None
    if not a.no_progress and not a.json:
        from tqdm import tqdm
        bar = tqdm(desc="windows", unit="win", leave=False, file=sys.stderr)

    def progress(done: int, total: int) -> None:
        if bar is not None:
            bar.total = total
            bar.update(done - bar.n)

    try:
        results = evaluate_perplexity(models, ids, window, stride, reference=ref_name, progress=progress)
    finally:
        if bar is not None:
            bar.close()
    rows = []
    for n, r in results.items():
        r.extra.update(score_s=round(spent.get(n, 0.0), 2), reference=n == ref_name)
        rows.append(r.as_dict())
    res = {"eval": "perplexity", "window": window, "stride": stride, "reference": ref_name, "decode": a.decode,
           "text": {"path": str(path), "sha256": hashlib.sha256(text.encode()).hexdigest(), "chars": len(text),
                    "tokens": len(ids)},
           "load_s": round(load_s, 2), "results": rows,
           "meta": run_metadata(vars(a) | {"func": None})}
    if a.json:
        import json
        print(json.dumps(res, indent=2, default=str))
    else:
        print(f"{len(ids)} tokens of {path.name}, windows of {window} every {stride} "
              f"({rows[0]['windows']} window{'s' * (rows[0]['windows'] != 1)}, {rows[0]['scored_tokens']} scored tokens)")
        width = max(len(r["name"]) for r in rows)
        print(f"{'configuration':<{width}}  {'perplexity':>10}  {'mean NLL':>8}  {'top-1 agree':>11}  {'score s':>7}")
        for r in rows:
            print(f"{r['name']:<{width}}  {r['perplexity']:>10.4f}  {r['mean_nll']:>8.4f}  "
                  f"{r['top1_agreement']:>11.2%}  {r['score_s']:>7.2f}")
    out = write_json(output_path(a.output_json, "eval-perplexity"), res)
    print(f"[figures written to {out}]", file=sys.stderr)  # (after them: a file that cannot be written loses none)
    return 0
