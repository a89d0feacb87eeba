"""The quantization table of BENCHMARKS.md: for each weight scheme, with the float and the int8 KV
cache, perplexity and top-1 agreement with the fp32 model on the eval text, weight memory, and
batch-1 decode speed on this CPU. Every figure comes from the project's own commands, run here one
after another (`lmserve quantize`, `lmserve eval perplexity`, `lmserve bench latency`).

    python scripts/bench_quant.py [--model smollm2-135m] [--tokens 1024] [--out bench_out/quant]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

# (label, engine flags); the AWQ row's model is the checkpoint `lmserve quantize` writes first
SCHEMES = [("fp32", ["--dtype", "float32"]), ("bf16", ["--dtype", "bfloat16"]),
           ("int8", ["--quantization", "int8"]), ("int4 RTN (g64)", ["--quantization", "int4"]),
           ("AWQ int4 (g64)", ["--quantization", "awq"]), ("GGUF-native (Q4_1)", ["--quantization", "gguf"])]


def lmserve(*args: str) -> None:
    cmd = [sys.executable, "-m", "lmserve.cli", *args]
    print("+ lmserve", " ".join(args), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--tokens", type=int, default=1024, help="eval text tokens scored")
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--calib", default="docs/architecture.md", help="AWQ calibration text (not the eval text)")
    p.add_argument("--out", default="bench_out/quant")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    awq = out / "awq-model"
    if not (awq / "config.json").is_file():
        lmserve("quantize", "--method", "awq", "--model", a.model, "--calib", a.calib, "--out", str(awq),
                "--calib-samples", "16", "--calib-seq-len", "512")
    rows = []
    for label, flags in SCHEMES:
        model = str(awq) if "awq" in flags else a.model
        for kv in ("auto", "int8"):
            tag = f"{label.split()[0].lower()}-{kv}"
            ev, lat = out / f"eval-{tag}.json", out / f"latency-{tag}.json"
            common = ["--model", model, *flags, "--kv-cache-dtype", kv]
            lmserve("eval", "perplexity", *common, "--window", str(a.window), "--stride", str(a.window // 2),
                    "--max-tokens", str(a.tokens), "--reference-model", a.model, "--reference-quantization", "none", "--reference-dtype", "float32",
                    "--no-progress", "--output-json", str(ev))
            lmserve("bench", "latency", *common, "--batch-size", "1", "--input-len", "128", "--output-len", "64",
                    "--repeats", "2", "--no-progress", "--output-json", str(lat))
            results = json.loads(ev.read_text())["results"]  # [reference, this] (one row when they are the same)
            ref, r = results[0], results[-1]
            lt = json.loads(lat.read_text())["lmserve"]
            rows.append((label, kv, r["perplexity"], r["perplexity"] / ref["perplexity"] - 1, r["top1_agreement"],
                         lt["weight_bytes"] / 2**20, lt["decode_tokens_per_s"], lt["tpot_s"]["p50"] * 1e3))
    print("| weights | KV | perplexity | vs fp32 | top-1 agreement | weight MiB | batch-1 decode tok/s | TPOT p50 ms |")
    print("|---|---|---|---|---|---|---|---|")
    for label, kv, ppl, rel, agree, mib, tps, tpot in rows:
        print(f"| {label} | {kv} | {ppl:.3f} | {rel:+.2%} | {agree:.2%} | {mib:.1f} | {tps:.1f} | {tpot:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
