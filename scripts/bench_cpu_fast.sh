#!/usr/bin/env bash
# The CPU fast-path figures of BENCHMARKS.md (issue #15): lmserve's default configuration (auto: the
# GGUF's own blocks through our CPU kernels) and the float reference (--quantization none
# --attention-backend torch) beside HF transformers and llama.cpp (when llama-cpp-python is
# installed) in the same run, on the default model. Run on a quiet machine: nothing else busy.
set -euo pipefail
cd "$(dirname "$0")/.."
B=.venv/bin/lmserve
out=${OUT_DIR:-bench_out/cpu-fast}
mkdir -p "$out"
LC=()
.venv/bin/python -c "import llama_cpp" 2>/dev/null && LC=(--compare llamacpp)
# batch 1, prompt 128 + 128: default, float reference, HF, llama.cpp
$B bench latency --batch-size 1 --input-len 128 --output-len 128 --repeats 2 --compare hf "${LC[@]}" \
  --no-progress --output-json "$out/latency-b1.json"
for dt in float32 bfloat16; do  # the float weights (the dtype policy's inputs)
  $B bench latency --batch-size 1 --input-len 128 --output-len 128 --repeats 2 --quantization none --dtype $dt \
    --no-progress --output-json "$out/latency-b1-none-$dt.json"
done
LMSERVE_ISA=avx512 $B bench latency --batch-size 1 --input-len 128 --output-len 128 --repeats 2 \
  --no-progress --output-json "$out/latency-b1-avx512.json"  # our kernels with float x (no VNNI)
# TTFT of a 1,024-token prompt
$B bench latency --batch-size 1 --input-len 1024 --output-len 8 --repeats 1 --compare hf "${LC[@]}" \
  --no-progress --output-json "$out/latency-ttft1024.json"
# step cost against rows: B sequences decoding together = B rows a step
for b in 1 2 4 5 8 16; do
  $B bench latency --batch-size $b --input-len 64 --output-len 64 --repeats 3 --no-progress \
    --output-json "$out/rows-$b.json"
done
# cold start: process start to first token
/usr/bin/time -f "cold start %e s" $B generate "Hi" --max-tokens 1 > /dev/null
# 32 ragged requests (the CPU preset)
$B bench throughput --preset cpu --compare hf --hf-batch-size 8 "${LC[@]}" --no-progress \
  --output-json "$out/throughput.json"
# speculation at batch 1 on the fast path
$B bench spec --methods none,ngram,draft --batch-sizes 1 --max-tokens 96 --repeats 5 --output-json "$out/spec.json"
