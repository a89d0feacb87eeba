"""`lmserve quantize --method awq --calib FILE --out DIR`: AWQ int4 by our own calibration.

Loads the model in float (our model code, the engine's forward), runs the calibration text through it
with hooks on the decoder linears, searches and folds the per-channel scales (lmserve/quant/awq.py),
quantizes group-wise to int4 and writes an HF folder in AutoAWQ's GEMM format that `LLM(DIR)` loads
(lmserve/quant/checkpoint.py). Prints one line per layer (alpha chosen, output error against plain
round to nearest) and writes them to DIR/awq_search.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from lmserve.cli.engine_args import add_engine_args, engine_kwargs
from lmserve.utils import at_least


def add_parser(sub: Any) -> None:
    q = sub.add_parser("quantize", help="quantize a model's weights by calibration (AWQ int4) into an HF folder")
    q.add_argument("--method", choices=["awq"], default="awq")
    q.add_argument("--calib", required=True, help="calibration text file (plain text)")
    q.add_argument("--out", required=True, help="output folder (config.json, model.safetensors, tokenizer)")
    q.add_argument("--group-size", type=at_least(1), default=None,
                   help="input channels per scale (default 128, halved until it divides every layer's input)")
    q.add_argument("--calib-seq-len", type=int, default=512, help="tokens per calibration sequence")
    q.add_argument("--calib-samples", type=int, default=64, help="most calibration sequences")
    q.add_argument("--search-rows", type=int, default=4096, help="sampled tokens per layer for the scale search")
    q.add_argument("--n-grid", type=at_least(1), default=20, help="alpha grid: 0, 1/n, ..., (n-1)/n")
    add_engine_args(q)
    q.set_defaults(func=cmd_quantize)


def calibration_sequences(ids: list[int], seq_len: int, samples: int) -> list[list[int]]:
    """The token stream cut into consecutive sequences of seq_len (a shorter tail kept if >= 2 tokens)."""
    if seq_len < 2 or samples < 1:
        raise ValueError("calib-seq-len must be >= 2 and calib-samples >= 1")
    seqs = [ids[i:i + seq_len] for i in range(0, len(ids), seq_len)]
    return [s for s in seqs if len(s) >= 2][:samples]


def cmd_quantize(a: argparse.Namespace) -> int:
    from lmserve.llm import LLM
    from lmserve.models.loader import resolve_model
    from lmserve.quant.awq import awq_calibrate, default_group_size
    from lmserve.quant.checkpoint import save_awq_checkpoint

    kw = engine_kwargs(a)
    if kw.get("tensor_parallel_size", 1) > 1:
        raise ValueError("tensor_parallel_size: calibration reads the whole model: use 1")
    if kw.get("quantization") not in (None, "none", "auto"):
        raise ValueError("quantization: calibration runs on the float model; leave --quantization off")
    kw["quantization"] = None  # calibrate on the float weights (a GGUF's blocks dequantized)
    calib = Path(a.calib)
    if not calib.is_file():
        raise FileNotFoundError(f"calib: no file {str(calib)!r}")
    t0 = time.perf_counter()
    llm = LLM(a.model, **kw)
    if llm.tokenizer is None:
        raise ValueError(f"model: {a.model!r} has no tokenizer, so it cannot read calibration text")
    model, cfg = llm.engine.model, llm.engine.model_config
    ids = llm.engine.tokenize_prompt(calib.read_text(encoding="utf-8"))
    seq_len = min(a.calib_seq_len, llm.engine.max_model_len)
    seqs = calibration_sequences(ids, seq_len, a.calib_samples)
    if not seqs:
        raise ValueError(f"calib: {calib} has too little text")
    group = a.group_size or default_group_size(model)
    result = awq_calibrate(model, lambda s: llm.score(s, last_only=True), seqs, group, a.n_grid, a.search_rows,
                           a.seed)
    source = resolve_model(a.model)
    save_awq_checkpoint(model, cfg, a.out, group, source=source.path if source.kind == "hf" else None,
                        tokenizer=llm.tokenizer)
    rows = result.summary()
    Path(a.out, "awq_search.json").write_text(json.dumps(
        {"model": a.model, "calib": str(calib), "calib_tokens": sum(map(len, seqs)), "sequences": len(seqs),
         "group_size": group, "n_grid": a.n_grid, "layers": rows}, indent=2))
    width = max(len(str(r["linears"])) for r in rows)
    print(f"AWQ int4, group {group}: {len(seqs)} calibration sequences, {sum(map(len, seqs))} tokens")
    print(f"{'input of':<{width}}  {'alpha':>5}  {'AWQ MSE':>10}  {'RTN MSE':>10}  {'ratio':>6}")
    for r in rows:
        ratio = r["mse"] / r["rtn_mse"] if r["rtn_mse"] else 1.0  # type: ignore[operator]
        print(f"{r['linears']:<{width}}  {r['alpha']:>5.2f}  {r['mse']:>10.3e}  {r['rtn_mse']:>10.3e}  {ratio:>6.3f}")
    print(f"wrote {a.out} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0
