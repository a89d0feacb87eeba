#!/usr/bin/env bash
# The CPU figures of BENCHMARKS.md, on the default model, each beside HF transformers in the same run.
set -euo pipefail
cd "$(dirname "$0")/.."
B=.venv/bin/lmserve
out=${OUT_DIR:-bench_out/cpu}
mkdir -p "$out"
$B bench latency --batch-size 1 --input-len 128 --output-len 128 --repeats 3 --compare hf --compare naive \
  --naive-max-len 512 --plot --no-progress --output-json "$out/latency-b1.json"
$B bench latency --batch-size 32 --input-len 128 --output-len 128 --repeats 1 --compare hf --hf-batch-size 32 \
  --no-progress --output-json "$out/latency-b32.json"
$B bench throughput --preset cpu --compare hf --hf-batch-size 8 --plot --no-progress --output-json "$out/throughput.json"
$B bench spec --methods none,ngram,draft --batch-sizes 1,8 --max-tokens 96 --output-json "$out/spec.json"
$B bench parallel --n 8 --prompt-len 1024 --max-tokens 256 --output-json "$out/parallel.json"
