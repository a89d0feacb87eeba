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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's lmserve, installed or not


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

    # 0. the kernels themselves on the device, against float64 (the cases the CPU tests run under the
    # interpreter, here compiled): attention (prefill, split-KV decode, padded static decode batch), fused ops
    from lmserve.attention.testing import check_kernels
    kernel_rows = {}
    kernels_ok = True
    dtypes = [("fp32", torch.float32, 5e-3), ("bf16", torch.bfloat16, 3e-2)]
    if a.device == "cpu":  # the interpreter's tl.dot is wrong for bf16 (a plain 16x16 dot is off by 1e10)
        dtypes = dtypes[:1]
    for name, dt, tol in dtypes:
        krows = check_kernels(a.device, dt)
        errs = [r[k] for r in krows for k in ("triton_err", "static_err") if k in r]
        ok = sum(e < tol for e in errs) + sum(r["store_equal"] and r.get("static_store_equal", True)
                                                 and r.get("static_pad_zero", True) for r in krows)
        kernel_rows[name] = krows
        kernels_ok &= ok == len(errs) + len(krows)
        rows.append((f"attention kernels {name}: checks passed", f"{ok} of {len(errs) + len(krows)} "
                                                                  f"(max err {max(errs):.1e}, tol {tol:g})"))
    rows.append(("fused kernels bf16: max err vs torch", f"{fused_check(a.device):.1e}"))

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
               "graph_capture_s": capture_s, "graph_replays": replays, "kernels": kernel_rows}
    (out / "gpu_check.json").write_text(json.dumps(payload, indent=2, default=str))
    width = max(len(k) for k, _ in rows)
    print("\n" + "\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    return 0 if agree >= 0.99 and kernels_ok else 1


def fused_check(device: str) -> float:
    """Fused add+RMSNorm, SiLU-and-mul and in-place rotary on the device against the torch code they
    replace (run on CPU copies, where nothing is fused), bf16. Returns the largest difference."""
    import torch

    from lmserve.layers.fused import add_rmsnorm, rotary_, silu_and_mul
    from lmserve.layers.norm import RMSNorm
    from lmserve.layers.rotary import RotaryEmbedding
    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(37, 1024, generator=g).to(torch.bfloat16) for _ in range(2))
    norm = RMSNorm(1024).to(torch.bfloat16)
    ref_out, ref_res = norm(x, r)  # the torch path (CPU tensors)
    out, res = add_rmsnorm(x.to(device), r.to(device), norm.weight.to(device), norm.eps)
    errs = [(out.cpu().float() - ref_out.float()).abs().max().item(),
            (res.cpu().float() - ref_res.float()).abs().max().item()]
    gu = torch.randn(37, 2 * 3072, generator=g).to(torch.bfloat16)
    gate, up = gu.float().chunk(2, dim=-1)
    errs.append((silu_and_mul(gu.to(device)).cpu().float() - torch.nn.functional.silu(gate) * up).abs().max().item())
    rot = RotaryEmbedding(128, 4096, 1e6)
    pos = torch.randint(0, 4096, (37,), generator=g)
    for heads in (16, 8):
        q = torch.randn(37, heads, 128, generator=g).to(torch.bfloat16)
        ref, _ = rot(pos, q, q)
        got = rotary_(q.to(device), rot.cos[pos].to(device), rot.sin[pos].to(device))
        errs.append((got.cpu().float() - ref.float()).abs().max().item())
    return max(errs)


if __name__ == "__main__":
    sys.exit(main())
