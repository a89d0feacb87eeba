"""The GPU check of issue #5, in one script: correctness of the fast path against the torch reference
(teacher-forced logits), batch-1 decode against the bandwidth bound from `lmserve plan`, and the
256-request throughput workload beside HF transformers. Prints a short table last.

    python scripts/gpu_check.py                      # on a CUDA machine: qwen3-0.6b shape, bf16
    python scripts/gpu_check.py --device cpu --small # a dry run of the same logic on a CPU
                                                     # (triton under TRITON_INTERPRET=1, tiny sizes)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default=None, help="model shape (default qwen3-0.6b; debug-tiny with --small)")
    ap.add_argument("--small", action="store_true", help="tiny sizes (CPU dry run)")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out/gpu"))
    a = ap.parse_args()
    if a.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    from lmserve import LLM
    from lmserve.bench.common import PRESETS, random_workload
    from lmserve.bench.hf import hf_generate, hf_latency, load_hf_model
    from lmserve.bench.offline import run_latency, run_throughput
    from lmserve.plan import DEVICES, model_from_name, plan

    a.shape = a.shape or ("debug-tiny" if a.small else "qwen3-0.6b")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model = f"shape:{a.shape}"
    rows: list[tuple[str, str]] = []
    kv = "1GiB" if a.small else None  # on CUDA: sized by the memory profile (gpu_memory_utilization)

    # 1. correctness: fast path (Triton kernels, fused ops, CUDA-graph decode) vs the torch reference
    # path, same weights; teacher-forced: the first quarter as one prefill, then one decode step per token
    n_pos = 48 if a.small else 384
    fast = LLM(model, device=a.device, attention_backend="triton", kv_cache_memory=kv)
    capture_s = fast.engine.graph_capture_time
    vocab = fast.engine.vocab_size
    rng = random.Random(0)
    toks = [rng.randrange(10, vocab) for _ in range(n_pos)]
    lf = fast.engine.score(toks, decode_from=n_pos // 4).float()
    replays = fast.engine.runner.graphs.replays if fast.engine.runner.graphs else 0
    del fast
    ref = LLM(model, device=a.device, attention_backend="torch", enforce_eager=True, kv_cache_memory=kv)
    lr = ref.engine.score(toks).float()
    del ref
    diff = (lf - lr).abs().max().item()
    agree = (lf.argmax(-1) == lr.argmax(-1)).float().mean().item()
    rows += [("max |logit diff| fast vs reference", f"{diff:.4f}"), ("argmax agreement", f"{agree:.2%}"),
             ("decode steps replayed from graphs", f"{replays} of {n_pos - n_pos // 4}"),
             ("CUDA graph capture s", "-" if capture_s is None else f"{capture_s:.1f}")]

    # 2. batch-1 decode vs the bandwidth bound
    llm = LLM(model, device=a.device, kv_cache_memory=kv)
    out_len = 16 if a.small else 256
    lat = run_latency(llm, 1, 32 if a.small else 128, out_len, repeats=1 if a.small else 3)
    dev_name = "cpu" if a.device == "cpu" else "h200"
    bound = plan(model_from_name(a.shape), DEVICES[dev_name], "bf16", batch=1, seq_len=128 + out_len)["decode"]
    rows += [("batch-1 decode tok/s", f"{lat['decode_tokens_per_s']:.1f}"),
             ("plan bound tok/s (bf16)", f"{bound['tokens_per_s']:.0f}"),
             ("fraction of bound", f"{lat['decode_tokens_per_s'] / bound['tokens_per_s']:.1%}")]

    # 3. the throughput workload, beside HF transformers in the same run
    preset = dict(PRESETS["tiny" if a.small else "gpu"])
    reqs = random_workload(vocab_size=vocab, seed=0, **preset)
    tp = run_throughput(llm, reqs, progress=False)
    dtype = llm.engine.config.torch_dtype
    del llm
    torch.cuda.empty_cache() if a.device.startswith("cuda") else None
    hf = load_hf_model(model, dtype, a.device)
    hft = hf_generate(hf, reqs, 4 if a.small else 64, a.device)
    hfl = hf_latency(hf, [rng.randrange(10, vocab) for _ in range(32 if a.small else 128)], 1, out_len, a.device)
    rows += [("throughput output tok/s (lmserve)", f"{tp['output_tokens_per_s']:.1f}"),
             ("throughput output tok/s (HF generate)", f"{hft['output_tokens_per_s']:.1f}"),
             ("HF batch-1 decode tok/s", f"{hfl['decode_tokens_per_s']:.1f}")]

    payload = {"device": a.device, "shape": a.shape, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
               "latency": lat, "throughput": tp, "hf_throughput": hft, "hf_latency": hfl,
               "logit_max_diff": diff, "argmax_agreement": agree, "plan_bound": bound,
               "graph_capture_s": capture_s, "graph_replays": replays}
    (out / "gpu_check.json").write_text(json.dumps(payload, indent=2, default=str))
    width = max(len(k) for k, _ in rows)
    print("\n" + "\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    return 0 if agree >= 0.99 else 1


if __name__ == "__main__":
    sys.exit(main())
