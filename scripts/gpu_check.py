"""The GPU check of issue #5, in one script: the attention and fused kernels compiled for the device
against float64 / their torch code; the fast path (Triton, fused ops, CUDA-graph decode) against the
torch reference (teacher-forced logits); batch-1 decode with and without CUDA graphs against the
bandwidth bound from `lmserve plan`; the 256-request throughput workload beside HF transformers.
Each part that fails is reported in the table and the next still runs; results are written to
$OUT/gpu_check.json after every part. Prints a short table last; exits 1 if any check failed.

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
import traceback
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
    payload: dict = {"device": a.device, "shape": a.shape, "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    kv = "1GiB" if a.small else None  # on CUDA: sized by the memory profile (gpu_memory_utilization)
    failed: list[str] = []
    t_start = time.perf_counter()

    def section(name: str, fn) -> None:  # type: ignore[no-untyped-def]
        """Run one part; a failure is reported in the table and the next part still runs."""
        print(f"[{time.perf_counter() - t_start:6.1f} s] {name} ...", flush=True)
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the report must survive any one part
            traceback.print_exc()
            failed.append(name)
            rows.append((f"{name}: FAILED", f"{type(e).__name__}: {str(e)[:80]}"))
        (out / "gpu_check.json").write_text(json.dumps(payload, indent=2, default=str))
        if a.device.startswith("cuda"):
            torch.cuda.empty_cache()

    # 0. the kernels themselves on the device, against float64 (the cases the CPU tests run under the
    # interpreter, here compiled): attention (prefill, split-KV decode, padded static decode batch), fused ops
    def kernels() -> None:
        from lmserve.attention.testing import check_kernels
        dtypes = [("fp32", torch.float32, 5e-3), ("bf16", torch.bfloat16, 3e-2)]
        if a.device == "cpu":  # the interpreter's tl.dot is wrong for bf16 (a plain 16x16 dot is off by 1e10)
            dtypes = dtypes[:1]
        for name, dt, tol in dtypes:
            krows = check_kernels(a.device, dt)
            errs = [r[k] for r in krows for k in ("triton_err", "static_err") if k in r]
            ok = sum(e < tol for e in errs) + sum(r["store_equal"] and r.get("static_store_equal", True)
                                                     and r.get("static_pad_zero", True) for r in krows)
            payload.setdefault("kernels", {})[name] = krows
            rows.append((f"attention kernels {name}: checks passed", f"{ok} of {len(errs) + len(krows)} "
                                                                      f"(max err {max(errs):.1e}, tol {tol:g})"))
            if ok != len(errs) + len(krows):
                failed.append(f"kernels {name}")
        pval, power = gumbel_check(a.device, draws=1000 if a.device == "cpu" else 20000)
        payload["gumbel_chi2_p"], payload["gumbel_chi2_p_wrong_T"] = pval, power
        rows.append(("Gumbel sampler: chi2 p vs softmax(l/T) / vs T=1", f"{pval:.3f} / {power:.1e}"))
        if pval < 1e-3 or power > 1e-3:
            failed.append("gumbel sampler")
        err = fused_check(a.device)
        payload["fused_max_err"] = err
        rows.append(("fused kernels bf16: max err vs torch", f"{err:.1e}"))
        if err > 6e-2:
            failed.append("fused kernels")

    # 1. correctness: fast path (Triton kernels, fused ops, CUDA-graph decode) vs the torch reference
    # path, same weights; teacher-forced: the first quarter as one prefill, then one decode step per token
    rng = random.Random(0)
    n_pos = 48 if a.small else 384

    def correctness() -> None:
        fast = LLM(model, device=a.device, attention_backend="triton", kv_cache_memory=kv)
        capture_s = fast.engine.graph_capture_time
        toks = [rng.randrange(10, fast.engine.vocab_size) for _ in range(n_pos)]
        lf = fast.engine.score(toks, decode_from=n_pos // 4).float()
        replays = fast.engine.runner.graphs.replays if fast.engine.runner.graphs else 0
        del fast
        ref = LLM(model, device=a.device, attention_backend="torch", enforce_eager=True, kv_cache_memory=kv)
        lr = ref.engine.score(toks).float()
        del ref
        diff = (lf - lr).abs().max().item()
        agree = (lf.argmax(-1) == lr.argmax(-1)).float().mean().item()
        payload.update(logit_max_diff=diff, argmax_agreement=agree, graph_capture_s=capture_s, graph_replays=replays)
        rows.extend([("max |logit diff| fast vs reference", f"{diff:.4f}"), ("argmax agreement", f"{agree:.2%}"),
                     ("decode steps replayed from graphs", f"{replays} of {n_pos - n_pos // 4}"),
                     ("CUDA graph capture s", "-" if capture_s is None else f"{capture_s:.1f}")])
        if agree < 0.99:
            failed.append("argmax agreement")

    # 2. batch-1 decode vs the bandwidth bound (with CUDA graphs, and eager for comparison)
    out_len = 16 if a.small else 256
    in_len = 32 if a.small else 128

    def batch1() -> None:
        dev_name = "cpu" if a.device == "cpu" else "h200"
        bound = plan(model_from_name(a.shape), DEVICES[dev_name], "bf16", batch=1, seq_len=in_len + out_len)["decode"]
        payload["plan_bound"] = bound
        rows.append(("plan bound tok/s (bf16)", f"{bound['tokens_per_s']:.0f}"))
        for label, eager in (("graphs", False), ("eager", True)):
            llm = LLM(model, device=a.device, kv_cache_memory=kv, enforce_eager=eager)
            lat = run_latency(llm, 1, in_len, out_len, repeats=1 if a.small else 3)
            del llm
            payload[f"latency_{label}"] = lat
            rows.append((f"batch-1 decode tok/s ({label})",
                         f"{lat['decode_tokens_per_s']:.1f} = {lat['decode_tokens_per_s'] / bound['tokens_per_s']:.1%}"
                         " of bound"))

    # 3. the throughput workload, beside HF transformers in the same run
    def throughput() -> None:
        llm = LLM(model, device=a.device, kv_cache_memory=kv)
        preset = dict(PRESETS["tiny" if a.small else "gpu"])
        reqs = random_workload(vocab_size=llm.engine.vocab_size, seed=0, **preset)
        tp = run_throughput(llm, reqs, progress=False)
        dtype = llm.engine.config.torch_dtype
        vocab = llm.engine.vocab_size
        del llm
        payload["throughput"] = tp
        rows.append(("throughput output tok/s (lmserve)", f"{tp['output_tokens_per_s']:.1f}"))
        if a.device.startswith("cuda"):
            torch.cuda.empty_cache()
        hf = load_hf_model(model, dtype, a.device)
        hft = hf_generate(hf, reqs, 4 if a.small else 64, a.device)
        payload["hf_throughput"] = hft
        rows.append(("throughput output tok/s (HF generate)", f"{hft['output_tokens_per_s']:.1f}"))
        hfl = hf_latency(hf, [rng.randrange(10, vocab) for _ in range(in_len)], 1, out_len, a.device)
        payload["hf_latency"] = hfl
        rows.append(("HF batch-1 decode tok/s", f"{hfl['decode_tokens_per_s']:.1f}"))

    def fusions() -> None:
        if not a.device.startswith("cuda"):
            rows.append(("fusion timings", "CUDA only"))
            return
        timings = fusion_timings(a.device)
        payload["fusion_timings_us"] = timings
        for op, (fused_us, torch_us) in timings.items():
            rows.append((f"fused {op}: us fused / torch", f"{fused_us:.1f} / {torch_us:.1f}"))

    for name, fn in (("kernels", kernels), ("correctness", correctness), ("batch-1 decode", batch1),
                     ("throughput", throughput), ("fusions", fusions)):
        section(name, fn)
    payload["failed"] = failed
    (out / "gpu_check.json").write_text(json.dumps(payload, indent=2, default=str))
    width = max(len(k) for k, _ in rows)
    print(f"\n[{time.perf_counter() - t_start:.0f} s in all]\n" + "\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    return 1 if failed else 0


def fusion_timings(device: str) -> dict:
    """The profile behind the fusions: each fused kernel against the torch ops it replaces, on
    qwen3-0.6b widths, at a decode batch (256 rows) and a prefill chunk (8192 rows); microseconds per
    call, CUDA events over 50 calls after 5 warm-up calls."""
    import torch

    from lmserve.layers import dispatch
    from lmserve.layers.fused import add_rmsnorm, rotary_, silu_and_mul
    from lmserve.layers.norm import RMSNorm
    from lmserve.layers.rotary import RotaryEmbedding

    def time_us(fn) -> float:  # type: ignore[no-untyped-def]
        for _ in range(5):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(50):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1e3 / 50

    bf = torch.bfloat16
    norm = RMSNorm(1024).to(device, bf)
    rot = RotaryEmbedding(128, 40960, 1e6).to(device)
    out: dict = {}
    real = dispatch.fused_ops
    try:
        for n in (256, 8192):
            x, r = torch.randn(n, 1024, device=device, dtype=bf), torch.randn(n, 1024, device=device, dtype=bf)
            gu = torch.randn(n, 2 * 3072, device=device, dtype=bf)
            q = torch.randn(n, 16, 128, device=device, dtype=bf)
            k = torch.randn(n, 8, 128, device=device, dtype=bf)
            pos = torch.randint(0, 4096, (n,), device=device)
            cos, sin = rot.cos[pos], rot.sin[pos]
            dispatch.fused_ops = lambda t: None  # type: ignore[assignment]  # the torch path, on CUDA tensors
            torch_us = {"add+rmsnorm": time_us(lambda: norm(x, r)),
                        "silu*mul": time_us(lambda: torch.nn.functional.silu(gu[:, :3072]) * gu[:, 3072:]),
                        "rotary q+k": time_us(lambda: rot(pos, q, k, (cos.unsqueeze(1), sin.unsqueeze(1))))}
            dispatch.fused_ops = real
            fused_us = {"add+rmsnorm": time_us(lambda: add_rmsnorm(x, r, norm.weight, norm.eps)),
                        "silu*mul": time_us(lambda: silu_and_mul(gu)),
                        "rotary q+k": time_us(lambda: (rotary_(q, cos, sin), rotary_(k, cos, sin)))}
            for op in torch_us:
                out[f"{op} N={n}"] = (fused_us[op], torch_us[op])
    finally:
        dispatch.fused_ops = real
    return out


def gumbel_check(device: str, draws: int) -> tuple[float, float]:
    """The Gumbel-max sampling kernel on the device: chi-square p-value of `draws` samples against
    softmax(l / T) (should be large) and against softmax(l) (should be tiny: the test has power)."""
    import torch

    from lmserve.sampling.gumbel import gumbel_sample
    g = torch.Generator().manual_seed(0)
    V, T = 12, 0.7
    logits = torch.randn(V, generator=g, dtype=torch.float64) * 2
    seeds = torch.randint(0, 2**40, (draws,), generator=g)
    toks = gumbel_sample(logits.float().expand(draws, V).contiguous().to(device),
                         torch.full((draws,), T, device=device), seeds.to(device))
    counts = torch.bincount(toks.cpu(), minlength=V).double()

    def pvalue(probs: torch.Tensor) -> float:
        exp = probs * draws
        stat = ((counts - exp) ** 2 / exp).sum()
        return float(torch.special.gammaincc(torch.tensor((V - 1) / 2, dtype=torch.float64), stat / 2))
    return pvalue(torch.softmax(logits / T, -1)), pvalue(torch.softmax(logits, -1))


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
