"""The GPU check (issues #5 and #12): everything a short device session must measure, in one script.

    timeout 540 python scripts/gpu_check.py                        # CUDA: qwen3-0.6b shape, bf16, --budget 480
    python scripts/gpu_check.py --device cpu --small --budget 90   # a dry run of the same logic on a CPU
                                                                   # (Triton under TRITON_INTERPRET=1, tiny sizes)

Parts, cheapest first (PARTS): preflight (one Triton launch: Triton builds its launcher with the
system C compiler and Python.h, and every CUDA model goes through Triton), fusions (the fused
kernels against their torch code, and the profile behind them), kernels (attention kernels against
float64, with a float and an int8 / fp8 KV cache; MLA's latent decode; the Gumbel sampler), correctness (fast path against the torch reference, teacher-forced,
margin-aware argmax gate), host overhead (host work per decode step at batch 256), batch-1 decode
(against the `lmserve plan` bound, with and without CUDA graphs), quant matmul (the Triton
dequantize-in-matmul kernels against float64, and batch-1 decode's linears of a Llama-3.1-8B shape
with bf16 / int8 / int4 / fp8 weights), throughput (the 256-request workload), hf baseline (HF
transformers at batch 1, and beside lmserve on a 64-request slice of the workload), deterministic (the batch-invariant attention
kernels, and the needle test: a prompt alone against the same among 64 others, bit for bit), swap
and offload (preempted KV to pinned host memory and back; the prefix cache's offload tier against a
pool hit), quant sweep (the GEMV kernel's block choices for batch-1 decode: each checked against
float64 on one layer, then timed on the quant matmul part's Llama-3.1-8B step).

Each part runs in its own process (forked from a server that imported torch once), so a crash or a
sticky CUDA error ends that part only; it writes $OUT/parts/<part>.json after every result, so a
part killed midway keeps what it had. The parent merges them into $OUT/gpu_check.json after every
part, skips a part whose estimate no longer fits --budget, kills one that runs past the budget (or
3x its estimate), and prints the table last. If the preflight fails, the parts that need Triton are
skipped and the rest run on torch ops, said loudly. Exit status 1 if a part failed, raised, crashed
or timed out.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import multiprocessing
import os
import random
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's lmserve, installed or not

DONE = ("ok", "failed", "error", "crashed", "timeout", "skipped", "interrupted")  # a part's final status
BAD = ("failed", "error", "crashed", "timeout", "interrupted")  # what makes the exit status 1
OVERRUN = 3.0  # a part is killed after this many times its estimate (a hang must not eat the budget)
RESERVE_S = 1.0  # kept back from the budget for the parent's last writes


class Part:
    """One part's results, in its own process: table rows, JSON data and failed checks, written to
    its file (atomically) after every change, so a part killed midway keeps what it had."""

    def __init__(self, name: str, path: Path) -> None:
        self.name = name
        self.path = path
        self.rows: list[list[str]] = []
        self.data: dict[str, Any] = {}
        self.failures: list[str] = []
        self.t0 = time.perf_counter()
        self.save("running")

    def row(self, label: str, value: str) -> None:
        """A line of the final table (printed now too)."""
        self.rows.append([label, value])
        print(f"    {label}: {value}", flush=True)
        self.save("running")

    def put(self, **data: Any) -> None:
        """Raw results for the JSON."""
        self.data.update(data)
        self.save("running")

    def fail(self, check: str) -> None:
        """A check that did not pass (the part goes on; it ends 'failed')."""
        self.failures.append(check)
        self.save("running")

    def save(self, status: str, error: str | None = None, tb: str | None = None) -> None:
        record = {"name": self.name, "status": status, "seconds": round(time.perf_counter() - self.t0, 2),
                  "rows": self.rows, "failures": self.failures, "error": error, "traceback": tb, "data": self.data}
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(record, indent=1, default=str))
        os.replace(tmp, self.path)


PartFn = Callable[[Part, dict], None]


def _child(name: str, fn: PartFn, settings: dict, path: str) -> None:
    """A part in its own process: run it; its file ends 'ok', 'failed' (a check) or 'error' (raised)."""
    part_path = Path(path)
    log = open(part_path.with_suffix(".log"), "w")  # noqa: SIM115 - open for the life of the process
    faulthandler.enable(log)  # a hard crash (segfault, abort) leaves its Python stack here
    if settings.get("device") == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if settings.get("no_triton"):  # the preflight could not launch a Triton kernel: hide it
        sys.modules["triton"] = None  # type: ignore[assignment]  # every 'is Triton there?' check says no
    p = Part(name, part_path)
    try:
        fn(p, settings)
    except Exception as e:  # noqa: BLE001 - recorded, and the parent goes on with the next part
        traceback.print_exc()
        p.save("error", f"{type(e).__name__}: {e}"[:600], traceback.format_exc()[-6000:])
        return
    p.save("failed" if p.failures else "ok")


def _slug(name: str) -> str:
    return name.replace(" ", "_").replace("-", "_")


def run_parts(parts: list[tuple[str, float, PartFn]], settings: dict, out: Path, budget: float,
              preload: tuple[str, ...] = ("torch",), before: Callable[[str, dict], str | None] | None = None,
              after: Callable[[str, dict], None] | None = None) -> dict:
    """Run `parts` (name, estimated seconds, function(part, settings)) in order, each in its own
    process, within `budget` seconds from now, and return the report, which is also rewritten to
    out/gpu_check.json after every part. A part is skipped when its estimate exceeds the time left
    (or `before(name, settings)` gives a reason), killed at the budget's end or OVERRUN x its
    estimate ('timeout'), and 'crashed' if its process died without a final status; a killed or
    crashed part keeps the rows it had written. `after(name, result)` may update the settings the
    next parts get."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload))
    parts_dir = out / "parts"
    parts_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    deadline = t0 + budget
    report: dict[str, Any] = {"settings": settings, "budget_s": budget, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                              "order": [n for n, _, _ in parts],
                              "parts": {n: {"status": "pending"} for n, _, _ in parts}}

    def write() -> None:
        report["elapsed_s"] = round(time.monotonic() - t0, 1)
        report["failed"] = [n for n, r in report["parts"].items() if r["status"] in BAD]
        tmp = out / "gpu_check.json.tmp"
        tmp.write_text(json.dumps(report, indent=2, default=str))
        os.replace(tmp, out / "gpu_check.json")

    write()
    proc = None
    name = ""
    try:
        for name, est, fn in parts:
            path = parts_dir / f"{_slug(name)}.json"
            for stale in (path, path.with_suffix(".log")):
                stale.unlink(missing_ok=True)
            left = deadline - time.monotonic() - RESERVE_S
            reason = before(name, settings) if before else None
            if reason is None and est > left:
                reason = f"needs ~{est:.0f} s, {max(left, 0):.0f} s left of --budget {budget:.0f}"
            if reason is not None:
                report["parts"][name] = {"status": "skipped", "error": reason, "rows": []}
                print(f"[{time.monotonic() - t0:6.1f} s] {name}: skipped ({reason})", flush=True)
                write()
                continue
            limit = min(left, OVERRUN * est)
            print(f"[{time.monotonic() - t0:6.1f} s] {name} ...", flush=True)
            started = time.monotonic()
            proc = ctx.Process(target=_child, args=(name, fn, dict(settings), str(path)), name=f"gpu_check {name}")
            proc.start()
            proc.join(limit)
            killed = proc.is_alive()
            if killed:
                proc.kill()
                proc.join()
            res = _read_part(path)
            if killed:
                res.update(status="timeout", error=f"killed after {limit:.0f} s ("
                           + ("the budget's end" if limit < OVERRUN * est else f"{OVERRUN:g}x its estimate") + ")")
            elif res.get("status") not in DONE:
                res.update(status="crashed", error=f"process ended with exit code {proc.exitcode} and no result"
                           + _log_tail(path.with_suffix(".log")))
            res["seconds"] = round(time.monotonic() - started, 1)
            report["parts"][name] = res
            proc = None
            if after:
                after(name, res)
            write()
    finally:
        if proc is not None:  # interrupted (Ctrl-C, SIGTERM from `timeout`) while a part ran
            proc.kill()
            proc.join()
            report["parts"][name] = {**_read_part(parts_dir / f"{_slug(name)}.json"), "status": "interrupted",
                                     "error": "the run was interrupted"}
        write()
    return report


def _read_part(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {"rows": []}


def _log_tail(path: Path) -> str:
    try:
        tail = path.read_text().strip().splitlines()[-6:]
    except OSError:
        return ""
    return ("; log: " + " | ".join(tail)) if tail else ""


def format_table(report: dict) -> str:
    """The table printed at the end: every part with its status and seconds, then its rows."""
    rows: list[tuple[str, str]] = []
    for name in report["order"]:
        r = report["parts"][name]
        st = r["status"]
        head = f"== {name}: {st.upper() if st in BAD or st == 'skipped' else st}"
        if r.get("seconds") is not None:
            head += f" ({r['seconds']:.0f} s)"
        if r.get("failures"):
            head += f"; failed checks: {', '.join(r['failures'])}"
        if r.get("error"):
            head += f"; {r['error']}"
        rows.append((head, ""))
        rows.extend((f"   {k}", v) for k, v in r.get("rows", []))
    width = max((len(k) for k, v in rows if v), default=0)
    lines = [k if not v else f"{k:<{width}}  {v}" for k, v in rows]
    m = report.get("settings", {}).get("machine")
    if m:
        lines.insert(0, f"machine: {m['gpu']}; commit {m['commit']}; Python {m['python']}; {m['date']}")
    if report.get("banner"):
        lines = [report["banner"], *lines, report["banner"]]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# the parts (each runs in its own process; `s` is the settings dict built in main)

def _engine_opts(s: dict, **kw: Any) -> dict:
    """LLM options for the engine parts: the default backend (Triton on CUDA, the torch reference on
    the CPU), torch when the preflight failed."""
    return {"device": s["device"], "attention_backend": "torch" if s["no_triton"] else "auto", **kw}


def _free(device: str) -> None:
    """Give a dropped LLM's memory back before the next one."""
    import gc

    import torch
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def compiled_variants() -> dict[str, int] | None:
    """Kernel variants Triton has compiled in this process, per lmserve kernel (None under the
    interpreter, or before any kernel module is imported). A count that grows during a timed run
    means a compile (0.5-2 s) inside the measurement."""
    out: dict[str, int] = {}
    for mod in ("lmserve.attention.triton_attn", "lmserve.layers.fused", "lmserve.sampling.gumbel",
                "lmserve.layers.triton_quant"):
        m = sys.modules.get(mod)
        for name, obj in (vars(m) if m else {}).items():
            caches = getattr(obj, "device_caches", None)
            if isinstance(caches, dict):  # device -> (kernel cache, ...): the first entry across Triton 3.x
                out[name] = sum(len(c[0]) for c in caches.values() if isinstance(c, tuple) and isinstance(c[0], dict))
    return out or None


def _compiles(before: dict[str, int] | None, after: dict[str, int] | None) -> str:
    if before is None or after is None:
        return "- (interpreter: nothing is compiled)"
    grew = {k: v - before.get(k, 0) for k, v in after.items() if v > before.get(k, 0)}
    return "0" if not grew else ", ".join(f"{k} +{v}" for k, v in grew.items())


def part_preflight(p: Part, s: dict) -> None:
    """One single-program launch of a real lmserve kernel (fused SiLU-and-mul). On CUDA, Triton builds its
    launcher with the system C compiler and Python.h at the first launch (in a fresh cache directory
    here, so the build really happens); every CUDA model goes through Triton, so without them every
    later part would fail. Reports the compiler and header the build used."""
    import shutil
    import subprocess
    import sysconfig
    import tempfile
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    if not interp:
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="gpu_check_triton_")
    import torch
    import triton
    scheme = sysconfig.get_default_scheme()
    header = Path(sysconfig.get_paths(scheme="posix_prefix" if scheme == "posix_local" else scheme)["include"])
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")
    p.put(triton=triton.__version__, torch=torch.__version__, python=sys.version.split()[0], compiler=cc,
          python_h=str(header / "Python.h"), python_h_exists=(header / "Python.h").exists(), interpreter=interp)
    p.row("torch / Triton / Python", f"{torch.__version__} / {triton.__version__} / {sys.version.split()[0]}")
    if not interp:
        p.row("C compiler / Python.h (as Triton finds them)",
              f"{cc or 'NONE'} / {header / 'Python.h'}{'' if (header / 'Python.h').exists() else ' MISSING'}")
    builds: list[list[str]] = []
    real = subprocess.check_call

    def spy(cmd, *a, **kw):  # type: ignore[no-untyped-def]
        builds.append([str(c) for c in cmd])
        return real(cmd, *a, **kw)

    from lmserve.layers.fused import silu_and_mul
    x = torch.ones(1, 2 * 16, device=s["device"])  # (1, 2 x 16): gate | up; one row, one program
    subprocess.check_call = spy  # type: ignore[assignment]  # Triton's build calls it with the compiler line
    try:
        got = silu_and_mul(x).cpu()  # (1, 16)
    finally:
        subprocess.check_call = real  # type: ignore[assignment]
        p.put(launcher_builds=builds)  # also when the build failed: the command lines say with what
    err = (got - torch.nn.functional.silu(torch.ones(1, 16))).abs().max().item()
    used = sorted({b[0] for b in builds})
    inc = next((a[2:] for b in builds for a in b if a.startswith("-I") and Path(a[2:], "Python.h").exists()), None)
    how = ("interpreter (TRITON_INTERPRET=1): no launcher, no compiler" if interp else
           f"built {len(builds)} module(s) with {', '.join(used) or '?'} and {inc or '?'}/Python.h")
    p.row("one-program Triton launch", f"{'ok' if err < 1e-5 else f'WRONG (max err {err:.1e})'}; {how}")
    if err >= 1e-5:
        p.fail("one-program launch result")


def part_fusions(p: Part, s: dict) -> None:
    """The fused kernels against the torch code they replace (bf16), and on CUDA the profile behind
    the fusions."""
    err = fused_check(s["device"], 4 if s["small"] else 37)
    p.put(fused_max_err=err)
    p.row("fused kernels bf16: max err vs torch", f"{err:.1e}")
    if err > 6e-2:
        p.fail("fused kernels")
    if not s["device"].startswith("cuda"):
        p.row("fusion timings", "CUDA only")
        return
    timings = fusion_timings(s["device"])
    p.put(fusion_timings_us=timings)
    for op, (fused_us, torch_us) in timings.items():
        p.row(f"fused {op}: us fused / torch", f"{fused_us:.1f} / {torch_us:.1f}")


def part_kernels(p: Part, s: dict) -> None:
    """The attention kernels compiled for the device against float64 (the cases the CPU tests run
    under the interpreter): prefill, split-KV decode, padded static decode batch; fp32 with IEEE
    dots (Triton's default on Hopper is TF32, ~3e-3 of error on its own), and bf16. Then the Gumbel
    sampling kernel against softmax(l / T)."""
    import torch

    from lmserve.attention.testing import check_kernels
    dtypes = [("fp32", torch.float32, 2e-4), ("bf16", torch.bfloat16, 3e-2)]
    if s["device"] == "cpu":  # the interpreter's tl.dot is wrong for bf16 (a plain 16x16 dot is off by 1e10)
        dtypes = dtypes[:1]
    for name, dt, tol in dtypes:
        krows = check_kernels(s["device"], dt, **({"d": 32, "cases": [1, 2]} if s["small"] else {}))
        kernel_rows(p, f"kernels {name}", f"attention kernels {name}", krows, tol)
    p.row("prefill tl.dot precision", "checks: ieee for fp32; fast path: bf16 inputs (exact products, fp32 "
                                      "accumulation); an fp32 model would use tf32")
    for name, dt, tol in dtypes:  # MLA's latent decode (DeepSeek), a padding row included
        err, pad_zero = mla_kernel_check(s["device"], dt, s["small"])
        p.put(**{f"mla_decode_{name}_err": err, f"mla_decode_{name}_pad_zero": pad_zero})
        p.row(f"MLA latent decode kernel {name}: max err vs float64", f"{err:.1e} (tol {tol:g})"
              + ("" if pad_zero else "; padding row NOT zero"))
        if not (err < tol and pad_zero):
            p.fail(f"mla decode {name}")
    quant_kernel_checks(p, s, dtypes)
    pval, power = gumbel_check(s["device"], draws=300 if s["device"] == "cpu" else 20000)
    p.put(gumbel_chi2_p=pval, gumbel_chi2_p_wrong_T=power)
    p.row("Gumbel sampler: chi2 p vs softmax(l/T) / vs T=1", f"{pval:.3f} / {power:.1e}")
    if pval < 1e-3 or power > 1e-3:
        p.fail("gumbel sampler")


def kernel_rows(p: Part, key: str, label: str, krows: list[dict], tol: float) -> None:
    """check_kernels' rows as a part's result: every error within tol, every store and padding check true
    (a failed check named `key`; the raw rows under it, spaces as underscores)."""
    errs = [r[k] for r in krows for k in ("triton_err", "static_err") if k in r]
    ok = sum(e < tol for e in errs) + sum(r["store_equal"] and r.get("static_store_equal", True)
                                          and r.get("static_pad_zero", True) for r in krows)
    p.put(**{key.replace(" ", "_"): krows})
    p.row(f"{label}: checks passed", f"{ok} of {len(errs) + len(krows)} (max err {max(errs):.1e}, tol {tol:g})")
    if ok != len(errs) + len(krows):
        p.fail(key.replace("_", " "))


def quant_kernel_checks(p: Part, s: dict, dtypes: list) -> None:
    """The same cases with a quantized KV cache (kv_cache_dtype int8, and fp8 in bf16): Triton's
    quantizing store against the reference's bytes and scales, the kernels against float64 over the
    dequantized cache (tolerance as for the float cache), and against float64 over the float cache
    (QUANT_ATTN_BOUND, plus that tolerance). The CPU dry run: int8, one decode case."""
    from lmserve.attention.testing import QUANT_ATTN_BOUND, check_quant_kernels
    runs = [("int8", name, dt, tol) for name, dt, tol in dtypes] + [("fp8", n, dt, tol) for n, dt, tol in dtypes
                                                                      if n == "bf16"]
    for kv, name, dt, tol in runs:
        opts = {"d": 32, "cases": [1], "target_programs": 16} if s["small"] else {}
        rows = check_quant_kernels(s["device"], dt, kv, **opts)
        errs = [r[k] for r in rows for k in ("triton_err", "static_err") if k in r]
        qerrs = [r["triton_quant_err"] for r in rows]
        checks = [e < tol for e in errs] + [e < QUANT_ATTN_BOUND[kv] + tol for e in qerrs] + [
            r["store_equal"] and r.get("static_store_equal", True) and r.get("static_pad_zero", True) for r in rows]
        p.put(**{f"kernels_{kv}_kv_{name}": rows})
        p.row(f"attention kernels, {kv} KV cache, {name}: checks passed",
              f"{sum(checks)} of {len(checks)} (max err {max(errs):.1e}, tol {tol:g}; vs float cache "
              f"{max(qerrs):.1e}, bound {QUANT_ATTN_BOUND[kv] + tol:g})")
        if not all(checks):
            p.fail(f"kernels {kv} KV {name}")


def argmax_gate(fast: Any, ref: Any, top: int = 5, noise_factor: float = 2.0, min_agree: float = 0.99,
                min_confident: float = 0.1) -> dict[str, Any]:
    """Whether the fast path's logits (P, V) pick the reference's tokens (P, V), allowing for rounding.

    Raw argmax agreement is no gate: with random weights the median gap between the top two logits
    is ~0.08, and attention arithmetic alone (or bf16 against fp32) flips 6% of the argmaxes. So:
    the noise is the median over positions of the largest |logit difference| at a position (a
    median, so that a few broken positions cannot raise the bar for themselves); at a confident
    position, where the reference's top-two gap exceeds noise_factor x noise, rounding cannot flip
    the argmax, and at least min_agree of them must agree; at least a min_confident share of the
    positions must be confident (a path so noisy that few are leaves nothing to check); and
    everywhere the fast argmax must be among the reference's top `top`. The raw agreement is
    reported beside it. (On the CPU, qwen3-0.6b random weights, bf16 against fp32 over 128
    positions: raw 91.4%, noise 0.044, 69 confident positions, all agreeing, worst rank 1.)"""
    diff = (fast - ref).abs()  # (P, V)
    noise = diff.amax(-1).median().item()
    top2 = ref.topk(2, dim=-1).values  # (P, 2)
    gap = top2[:, 0] - top2[:, 1]  # (P,)
    fa = fast.argmax(-1)  # (P,)
    agree = fa == ref.argmax(-1)  # (P,)
    rank = (ref > ref.gather(-1, fa[:, None])).sum(-1)  # (P,): reference logits above the fast argmax's
    confident = gap > noise_factor * noise  # (P,)
    n_conf = int(confident.sum())
    conf_agree = agree[confident].float().mean().item() if n_conf else float("nan")
    reasons = []
    if n_conf < max(1.0, min_confident * len(gap)):
        reasons.append(f"only {n_conf} of {len(gap)} positions have a top-two gap above {noise_factor:g} x noise "
                       f"{noise:.2e}")
    elif conf_agree < min_agree:
        reasons.append(f"argmax agrees at {conf_agree:.2%} of the {n_conf} confident positions (< {min_agree:.0%})")
    if int(rank.max()) >= top:
        reasons.append(f"fast argmax outside the reference top {top} at {int((rank >= top).sum())} positions")
    return {"passed": not reasons, "reasons": reasons, "raw_agreement": agree.float().mean().item(),
            "max_diff": diff.max().item(), "noise": noise, "threshold": noise_factor * noise,
            "confident": n_conf, "positions": len(gap), "confident_agreement": conf_agree,
            "worst_rank": int(rank.max())}


def part_correctness(p: Part, s: dict) -> None:
    """The fast path (Triton attention, fused ops, the CUDA-graph decode path) against the torch
    reference (torch attention, torch ops: fused kernels off, eager), same weights, teacher-forced:
    the first quarter as one prefill, then one decode step per token; the margin-aware gate."""
    import torch

    from lmserve import LLM
    from lmserve.layers import dispatch
    cpu = s["device"] == "cpu"
    n_pos = 16 if s["small"] else 384
    model = s["model"]
    fast = LLM(model, device=s["device"], attention_backend="triton", kv_cache_memory=s["kv_small"],
               cuda_graph_sizes=[1])
    if cpu:  # no CUDA graphs here: the same padded static-buffer decode path, run without one
        fast.engine.runner.enable_graphs([1], fast.engine.max_model_len, capture=False)
    rng = random.Random(0)
    toks = [rng.randrange(10, fast.engine.vocab_size) for _ in range(n_pos)]
    with dispatch.use_fused(True if cpu else None):  # on the CPU the fused kernels run under the interpreter
        lf = fast.score(toks, decode_from=n_pos // 4).float()  # (P, V)
    capture_s = fast.engine.graph_capture_time
    replays = fast.engine.runner.graphs.replays if fast.engine.runner.graphs else 0
    dtype = str(fast.engine.config.torch_dtype)
    del fast
    _free(s["device"])
    with dispatch.use_fused(False):
        ref = LLM(model, device=s["device"], attention_backend="torch", enforce_eager=True,
                  kv_cache_memory=s["kv_small"])
        lr = ref.score(toks).float()  # (P, V)
    del ref
    g = argmax_gate(lf, lr)
    p.put(gate=g, graph_capture_s=capture_s, graph_replays=replays, dtype=dtype)
    p.row("max |logit diff| fast vs reference",
          f"{g['max_diff']:.3g} (noise: median per-position max {g['noise']:.3g})")
    p.row("argmax agreement: raw / confident positions",
          f"{g['raw_agreement']:.2%} / {g['confident_agreement']:.2%} of {g['confident']} of {g['positions']}"
          f" (top-two gap > {g['threshold']:.3g})")
    p.row("worst rank of the fast argmax in the reference", f"{g['worst_rank']} (gate: < 5 everywhere)")
    p.row("decode steps through the graph path", f"{replays} of {n_pos - n_pos // 4}"
          + (" (CPU: static buffers, no graph)" if cpu else ""))
    p.row("CUDA graph capture s (size 1)", "-" if capture_s is None else f"{capture_s:.1f}")
    if not g["passed"]:
        p.fail("argmax gate: " + "; ".join(g["reasons"]))
    if replays != n_pos - n_pos // 4:
        p.fail("graph path not taken")
    if not torch.isfinite(lf).all():
        p.fail("non-finite fast logits")


def part_host(p: Part, s: dict) -> None:
    """Host work per decode step at batch 256 (32 with --small): the engine is synchronous, so
    everything between reading one step's tokens and launching the next step's graph leaves the
    GPU idle. Times schedule, the graph runner's input building + replay launch (Python loops,
    block-table packing, copies), the sampler (after a sync, so without waiting for the forward),
    the scheduler's update and the rest of Engine.step, against the forward's GPU time."""
    import torch

    from lmserve import LLM, SamplingParams
    from lmserve.bench.common import random_workload
    b = 32 if s["small"] else 256
    out_len = 8 if s["small"] else 48
    llm = LLM(s["model"], **_engine_opts(s, kv_cache_memory=s["kv_host"], max_num_seqs=b, cuda_graph_sizes=[b]))
    eng, runner = llm.engine, llm.engine.runner
    reqs = random_workload(num_requests=b, input_len=(16, 32), output_len=(out_len, out_len),
                           vocab_size=eng.vocab_size, seed=0)
    params = [SamplingParams(temperature=0.6, max_tokens=r.max_tokens, ignore_eos=True, seed=i)
              for i, r in enumerate(reqs)]
    llm.generate([r.prompt for r in reqs[:8]], SamplingParams(max_tokens=4, temperature=0.6), use_tqdm=False)  # warm-up
    cuda = s["device"].startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    cur: dict[str, float] = {}
    tot: dict[str, float] = {}
    steps = [0]

    def timed(name: str, fn):  # type: ignore[no-untyped-def]
        def run(*a, **kw):  # type: ignore[no-untyped-def]
            t = time.perf_counter()
            r = fn(*a, **kw)
            cur[name] = cur.get(name, 0.0) + time.perf_counter() - t
            return r
        return run

    schedule, forward, update, step = eng.scheduler.schedule, runner.forward, eng.scheduler.update_from_output, eng.step

    def fwd(out):  # type: ignore[no-untyped-def]
        cur["decode"] = float(len(out.scheduled) == b and all(n == 1 for _, n in out.scheduled))
        t = time.perf_counter()
        h = forward(out)
        t1 = time.perf_counter()
        sync()
        cur["forward host"], cur["forward GPU"] = t1 - t, time.perf_counter() - t1
        return h

    class Sampler:  # the runner calls self.sampler(logits, seqs)
        def __init__(self, real) -> None:  # type: ignore[no-untyped-def]
            self.real = real

        def __call__(self, *a, **kw):  # type: ignore[no-untyped-def]
            return timed("sampler", self.real)(*a, **kw)

        def __getattr__(self, k: str):  # type: ignore[no-untyped-def]
            return getattr(self.real, k)

    def stepped():  # type: ignore[no-untyped-def]
        cur.clear()
        t = time.perf_counter()
        r = step()
        cur["step"] = time.perf_counter() - t
        if cur.get("decode"):
            steps[0] += 1
            for k, v in cur.items():
                tot[k] = tot.get(k, 0.0) + v
        return r

    eng.scheduler.schedule = timed("schedule", schedule)  # type: ignore[method-assign]
    eng.scheduler.update_from_output = timed("update", update)  # type: ignore[method-assign]
    runner.forward = fwd  # type: ignore[method-assign]
    runner.sampler = Sampler(runner.sampler)  # type: ignore[assignment]
    eng.step = stepped  # type: ignore[method-assign]
    llm.generate([r.prompt for r in reqs], params, use_tqdm=False)
    n = steps[0]
    if not n:
        raise RuntimeError(f"no step ran all {b} sequences as decodes")
    ms = {k: v / n * 1e3 for k, v in tot.items() if k != "decode"}
    rest = ms["step"] - ms["schedule"] - ms["forward host"] - ms["forward GPU"] - ms["sampler"] - ms["update"]
    host = ms["step"] - ms["forward GPU"]
    p.put(batch=b, decode_steps=n, ms_per_step=ms, rest_ms=rest, graphs=runner.graphs is not None)
    where = "graph inputs + replay launch" if runner.graphs is not None else "forward (eager: Python + launches)"
    p.row(f"host ms per decode step at batch {b} (GPU idle)",
          f"{host:.2f} = schedule {ms['schedule']:.2f} + {where} {ms['forward host']:.2f} + sampler "
          f"{ms['sampler']:.2f} + update {ms['update']:.2f} + rest of step {rest:.2f}")
    if cuda:
        p.row(f"GPU ms per decode step at batch {b} (forward, synced)", f"{ms['forward GPU']:.2f}")
        p.row("host share of a decode step", f"{host / ms['step']:.0%} over {n} steps")


def part_batch1(p: Part, s: dict) -> None:
    """Batch-1 decode against the bandwidth bound from `lmserve plan`, with CUDA graphs and eager
    (on the CPU, eager only), each after a warm-up that compiles every kernel variant."""
    from lmserve import LLM, SamplingParams
    from lmserve.bench.offline import failed, run_latency
    from lmserve.plan import DEVICES, model_from_name, plan
    out_len = 16 if s["small"] else 256
    in_len = 32 if s["small"] else 128
    cuda = s["device"].startswith("cuda")
    bound = plan(model_from_name(s["shape"]), DEVICES["h200" if cuda else "cpu"], "bf16", batch=1,
                 seq_len=in_len + out_len)["decode"]
    p.put(plan_bound=bound)
    p.row("plan bound tok/s (bf16)", f"{bound['tokens_per_s']:.0f}")
    for label, eager in ((("graphs", False), ("eager", True)) if cuda else (("eager", True),)):
        llm = LLM(s["model"], **_engine_opts(s, kv_cache_memory=s["kv_small"], enforce_eager=eager,
                                             cuda_graph_sizes=[1]))
        failed(llm.generate([[11] * in_len], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False))  # warm-up
        graphs = llm.engine.runner.graphs
        if cuda and not eager and graphs is None:  # capture failed: the engine serves eagerly (logged only)
            p.fail("CUDA graph capture failed: the 'graphs' row is eager")
        v0 = compiled_variants()
        lat = run_latency(llm, 1, in_len, out_len, repeats=1 if s["small"] else 3)
        v1 = compiled_variants()
        del llm
        _free(s["device"])
        p.put(**{f"latency_{label}": lat, f"compiled_variants_{label}": v1,
                 f"graph_sizes_{label}": list(graphs.sizes) if graphs is not None else None})
        p.row(f"batch-1 decode tok/s ({label})", f"{lat['decode_tokens_per_s']:.1f} = "
              f"{lat['decode_tokens_per_s'] / bound['tokens_per_s']:.1%} of bound; "
              f"compiles while timed: {_compiles(v0, v1)}")


def part_quant_matmul(p: Part, s: dict) -> None:
    """The Triton dequantize-in-matmul kernels (layers/triton_quant.py, issue #14). Correctness: the GEMV
    and tiled kernels against float64 over each layer's dequantized weight (quant_matmul_check), fp32
    (IEEE dots) and bf16 activations. Speed, on CUDA: the linears of one batch-1 decode step of a
    Llama-3.1-8B-shaped model (32 layers of qkv / o / gate_up / down, then the LM head; random weights
    made on the device) with bf16 weights (F.linear) and int8 / int4 / fp8 weights (quant_matmul; fp8
    also through Fp8Linear's own torch._scaled_mm), each step captured in a CUDA graph, ms per token and
    the ratio to bf16 (quant_decode_timing; the issue's goal: int8 >= 1.6x, int4 >= 2.5x bf16). With
    --small on the CPU: the same code on tiny shapes under the interpreter, not a speed."""
    import torch
    cuda = s["device"].startswith("cuda")
    dtypes = [("fp32", torch.float32, 1e-5), ("bf16", torch.bfloat16, 1e-2)]
    if not cuda:  # the interpreter's tl.dot is wrong for bf16
        dtypes = dtypes[:1]
    for name, dt, tol in dtypes:
        rows = quant_matmul_check(s["device"], dt, small=s["small"], full=name == "bf16")
        errs = [r["err"] for r in rows]
        bad = [f"{r['scheme']} {r['kernel']} M={r['m']}" for r in rows if not r["err"] < tol]
        worst = max(rows, key=lambda r: r["err"])
        p.put(**{f"quant_matmul_{name}": rows})
        p.row(f"quant matmul kernels {name}: checks passed",
              f"{len(rows) - len(bad)} of {len(rows)} (max rel err {max(errs):.1e} at {worst['scheme']} "
              f"{worst['kernel']} M={worst['m']}, tol {tol:g})" + (f"; FAILED: {', '.join(bad)}" if bad else ""))
        if bad:
            p.fail(f"quant matmul {name}")
    shape = "debug-tiny" if s["small"] else "llama-3.1-8b"
    t = quant_decode_timing(s["device"], shape, num_layers=1 if s["small"] else None)
    p.put(quant_decode_timing=t)
    base = t["bf16"]["ms"]
    goals = {"int8": 1.6, "int4": 2.5}
    for scheme, r in t.items():
        if scheme == "config":
            continue
        ratio = base / r["ms"]
        goal = f", goal {goals[scheme]:g}x: {'met' if ratio >= goals[scheme] else 'NOT MET'}" \
            if scheme in goals and cuda else ""
        how = f"{r['ms']:.3f} ms ({'eager' if r.get('graph_error') else 'graph'})" + (
            f", {r['eager_ms']:.3f} eager" if r.get("eager_ms") is not None and not r.get("graph_error") else "")
        p.row(f"decode linears {shape} x{t['config']['layers']} + head, {scheme}",
              f"{how}; {r['gb'] / r['ms'] * 1e3:.0f} GB/s of weights ({r['gb']:.2f} GB); {ratio:.2f}x bf16{goal}"
              if cuda else f"{r['ms']:.0f} ms per token (CPU interpreter: exercises the code, not a speed)")
        if r.get("graph_error"):
            p.row(f"  {scheme}: CUDA graph capture failed, eager time above", r["graph_error"])


GEMV_SWEEP = [dict(block_k=k, block_n=n, num_warps=w) for k in (256, 512, 1024) for n in (None, 32) for w in (4, 8)] + \
    [dict(block_k=k, block_n=None, num_warps=w, reduce_each=True) for k in (1024, 2048) for w in (4, 8)]  # (a tile's sum at once)


def part_quant_sweep(p: Part, s: dict) -> None:
    """The GEMV kernel's block choices for batch-1 decode, measured (the first H200 run found int8 at 0.99x
    and int4 at 0.72x bf16 with the defaults, at half the card's bandwidth: too few bytes in flight is the
    suspect): the quant matmul part's Llama-3.1-8B step for int8 / int4 / fp8 with each of GEMV_SWEEP
    (block_k per tile: int4's doubled, the same bytes; block_n None: the default by SM count; num_warps;
    reduce_each: a tile's products summed at once, registers for larger tiles),
    beside the defaults and bf16; the best per scheme, so that triton_quant's defaults follow a measure."""
    cuda = s["device"].startswith("cuda")
    shape = "debug-tiny" if s["small"] else "llama-3.1-8b"
    sweep = GEMV_SWEEP[:2] if s["small"] else GEMV_SWEEP
    t = quant_decode_timing(s["device"], shape, num_layers=1 if s["small"] else None, reps=2 if s["small"] else 20,
                            sweep=sweep)
    p.put(quant_sweep=t)
    base = t["bf16"]["ms"]
    for scheme in ("int8", "int4", "fp8"):
        wrong = [k for k, r in t.items() if k.startswith(scheme + " k") and "ms" in r
                 and not (isinstance(r.get("rel_err"), float) and r["rel_err"] < 1e-2)]
        if wrong:
            p.fail(f"{scheme} blocks computing a wrong result: {', '.join(wrong)}")
        rows = {k: r for k, r in t.items() if (k == scheme or k.startswith(scheme + " k")) and "ms" in r
                and k not in wrong}
        failed = [k for k, r in t.items() if k.startswith(scheme + " k") and "error" in r]
        best = min(rows, key=lambda k: rows[k]["ms"])
        p.row(f"{scheme}: default blocks / best of {len(rows) - 1}" + (f" ({len(failed)} failed)" if failed else ""),
              f"{rows[scheme]['ms']:.3f} / {rows[best]['ms']:.3f} ms ({best}); best {base / rows[best]['ms']:.2f}x bf16, "
              f"{rows[best]['gb'] / rows[best]['ms'] * 1e3:.0f} GB/s" if cuda else
              f"{len(rows)} variants ran (CPU interpreter: exercises the code, not a speed)")


def quant_matmul_check(device: str, dtype: Any, small: bool = False, full: bool = True) -> list[dict]:
    """layers/triton_quant.py's GEMV and tiled kernels on `device` against float64 over each layer's
    dequantize(): int8 per channel and per group of 128, int4 groups of 32 and 128, fp8; 300 outputs (no
    multiple of a block), K 1000 (per row: a partial last K tile in both kernels) or 1152 (grouped: 9
    groups of 128, a partial last GEMV tile). full: GEMV at M 1 and 7, tiled at 7 and 300; else GEMV at 1,
    tiled at 300. small (the CPU dry run): 40 outputs, K 100 / 384, GEMV at 1 and tiled at 17. Each row:
    scheme, kernel, m, err = max |y - ref| / max |ref|."""
    import math

    import torch

    from lmserve.layers import triton_quant as tq
    from lmserve.layers.quant import Fp8Linear, Int4Linear, Int8Linear
    out_f, k_row, k_group = (40, 100, 384) if small else (300, 1000, 1152)
    schemes: dict[str, tuple[int, Callable[[Any], Any]]] = {
               "int8": (k_row, lambda w: Int8Linear.from_float(w)),
               "int8 g128": (k_group, lambda w: Int8Linear.from_float(w, group_size=128)),
               "int4 g32": (k_group, lambda w: Int4Linear.from_float(w, group_size=32)),
               "int4 g128": (k_group, lambda w: Int4Linear.from_float(w, group_size=128)),
               "fp8": (k_row, lambda w: Fp8Linear.from_float(w))}
    runs = [("gemv", 1), ("tiled", 17)] if small else \
        [("gemv", 1), ("gemv", 7), ("tiled", 7), ("tiled", 300)] if full else [("gemv", 1), ("tiled", 300)]
    g = torch.Generator().manual_seed(0)
    rows = []
    for scheme, (k, make) in schemes.items():
        layer = make(torch.randn(out_f, k, generator=g) * 0.05).to(device)  # float32 scales
        w = tq.packed_weight(layer)
        wd = layer.dequantize().double().cpu()  # (out, k)
        for kernel, m in runs:
            x = torch.randn(m, k, generator=g)
            ref = x.to(dtype).double() @ wd.T  # (m, out): the activations as the kernel gets them
            y = (tq.gemv if kernel == "gemv" else tq.tiled)(x.to(device, dtype), w).double().cpu()
            err = ((y - ref).abs().max() / ref.abs().max()).item()
            rows.append({"scheme": scheme, "kernel": kernel, "m": m, "err": float("inf") if math.isnan(err) else err})
    return rows


def quant_decode_timing(device: str, shape: str, num_layers: int | None = None, reps: int = 20,
                        schemes: tuple[str, ...] = ("bf16", "int8", "int4", "fp8"), sweep: list[dict] | None = None
                        ) -> dict:
    """ms per token of the linears of one batch-1 decode step: per layer qkv, o, gate_up, down, then the
    LM head, for a model of `shape` (num_layers: fewer layers). bf16 weights through F.linear; int8 (per
    channel), int4 (groups as quantize_model picks them) and fp8 through triton_quant.quant_matmul, fp8
    also through Fp8Linear's forward (torch._scaled_mm on sm89+: "fp8 scaled_mm"); the LM head of the
    quantized models int8 per channel, quantize_model's default. Random weights made on the device, all
    layers distinct (every step streams every weight from memory, as decode does); scales and mins in
    bf16, as a bf16 model holds them. CUDA: each step captured in a CUDA graph (ms: replays, after a
    warm-up that compiles every kernel variant; eager_ms beside it); the CPU (float32, interpreter): one
    eager step. sweep: GEMV block choices to time beside the defaults ({"block_k" (int4: doubled, the same
    bytes a tile), "block_n", "num_warps"} each; rows "SCHEME k.. n.. w.."): every linear of the step and
    the head through triton_quant.gemv with them. Returns {scheme: {"ms", "eager_ms", "gb" (weight bytes
    read, 1e9)}, "config": {...}}."""
    import gc

    import torch
    import torch.nn.functional as F

    from lmserve.layers.quant import Fp8Linear, Int4Linear, Int8Linear
    from lmserve.layers.triton_quant import dequantized, gemv, packed_weight, quant_matmul
    from lmserve.models.registry import default_group_size
    from lmserve.models.shapes import shape_config
    cfg = shape_config(shape)
    cuda = device.startswith("cuda")
    dt = torch.bfloat16 if cuda else torch.float32
    n_layers = num_layers or cfg.num_layers
    h, hd = cfg.hidden_size, cfg.head_dim
    dims = [((cfg.num_heads + 2 * cfg.num_kv_heads) * hd, h), (h, cfg.num_heads * hd),
            (2 * cfg.intermediate_size, h), (h, cfg.intermediate_size)]  # (out, in): qkv, o, gate_up, down
    xs = {k: torch.randn(1, k, device=device, dtype=dt) for k in {i for _, i in dims}}  # (1, in) each

    def make(scheme: str, out_f: int, in_f: int) -> Any:
        if scheme == "bf16":
            return torch.randn(out_f, in_f, device=device, dtype=dt) * 0.02  # (out, in)
        layer: Any
        with torch.device(device):  # the buffers are made there: no host copy of the weights
            if scheme == "int8":
                layer = Int8Linear(in_f, [out_f])
                layer.qweight.random_(-127, 128)
            elif scheme == "int4":
                layer = Int4Linear(in_f, [out_f], group_size=default_group_size(in_f))
                layer.qweight.random_(0, 256)
                layer.mins.uniform_(-0.02, 0.0)
            else:
                layer = Fp8Linear(in_f, [out_f])
                layer.qweight.random_(0, 254)  # e4m3 bytes without the NaNs 0x7F and 0xFF
                layer.qweight += (layer.qweight >= 0x7F).to(torch.uint8)
        layer.scales.uniform_(1e-3, 4e-3)
        return layer.to(dt)  # scales / mins as a bf16 model holds them

    def nbytes(m: Any) -> int:
        return m.numel() * m.element_size() if isinstance(m, torch.Tensor) else \
            sum(b.numel() * b.element_size() for b in m.buffers())

    def timed(step: Any) -> dict:
        if not cuda:
            t0 = time.perf_counter()
            step()
            return {"ms": (time.perf_counter() - t0) * 1e3, "eager_ms": None}
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: every kernel variant compiled, outside the graph and the timing
            step()
            step()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        ev[0].record()
        for _ in range(3):
            step()
        ev[1].record()
        out: dict[str, Any] = {}
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            graph.replay()
            ev[2].record()
            for _ in range(reps):
                graph.replay()
            ev[3].record()
            torch.cuda.synchronize()
            out["ms"] = ev[2].elapsed_time(ev[3]) / reps
            del graph
        except Exception as e:  # noqa: BLE001 - reported; the eager time stands in
            torch.cuda.synchronize()
            out["graph_error"] = f"{type(e).__name__}: {e}"[:300]
        out["eager_ms"] = ev[0].elapsed_time(ev[1]) / 3
        out.setdefault("ms", out["eager_ms"])
        return out

    res: dict[str, Any] = {"config": {"shape": shape, "layers": n_layers, "dims": dims, "vocab": cfg.vocab_size,
                                      "reps": reps, "dtype": str(dt)}}
    errs: dict[str, Any] = {}  # swept blocks: relative error of one layer against float64
    for scheme in schemes:
        stack = [[make(scheme, o, i) for o, i in dims] for _ in range(n_layers)]
        head = make("bf16" if scheme == "bf16" else "int8", cfg.vocab_size, h)
        gb = (sum(nbytes(m) for layer in stack for m in layer) + nbytes(head)) / 1e9
        ways = [(scheme, (lambda w, x: F.linear(x, w)) if scheme == "bf16" else (lambda w, x: quant_matmul(x, w)))]
        if scheme == "fp8" and cuda:
            ways.append(("fp8 scaled_mm", lambda w, x: w(x)))
        head_mm = (lambda w, x: F.linear(x, w)) if scheme == "bf16" else (lambda w, x: quant_matmul(x, w))
        heads = [head_mm] * len(ways)
        for blocks in (sweep or []) if scheme != "bf16" else []:
            kw = {**blocks, "block_k": blocks["block_k"] * (2 if scheme == "int4" else 1)}
            label = (f"{scheme} k{blocks['block_k']} n{blocks['block_n'] or 'auto'} w{blocks['num_warps']}"
                     + (" sum" if blocks.get("reduce_each") else ""))
            ways.append((label, lambda w, x, kw=kw: gemv(x, packed_weight(w), **kw)))
            try:  # the blocks compute the layer: one qkv against float64 over its dequantized weight
                w0, x0 = packed_weight(stack[0][0]), xs[dims[0][1]]
                ref = x0.double() @ dequantized(w0).double().T  # (1, out)
                errs[label] = ((gemv(x0, w0, **kw).double() - ref).norm() / ref.norm()).item()
            except Exception as e:  # noqa: BLE001 - said in its row (timed below: it fails there too)
                errs[label] = f"{type(e).__name__}: {e}"[:300]
            heads.append(lambda w, x, kw=blocks: gemv(x, packed_weight(w), **kw))  # (the int8 head, same blocks)
        for (label, mm), hmm in zip(ways, heads):
            def step(mm: Any = mm, stack: list = stack, head: Any = head, head_mm: Any = hmm) -> None:
                for layer in stack:
                    for w, (_, i) in zip(layer, dims):
                        mm(w, xs[i])
                head_mm(head, xs[h])
            try:
                res[label] = {**timed(step), "gb": gb, **({"rel_err": errs[label]} if label in errs else {})}
            except Exception as e:  # noqa: BLE001 - a swept block choice that fails (resources) is a row, not the end
                if label in (scheme, "fp8 scaled_mm"):
                    raise
                res[label] = {"error": f"{type(e).__name__}: {e}"[:300], "gb": gb}
                if cuda:
                    torch.cuda.synchronize()
            del step
        del stack, head
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return res


def _workload(s: dict, vocab: int) -> list:
    from lmserve.bench.common import PRESETS, random_workload
    return random_workload(vocab_size=vocab, seed=0, **PRESETS["tiny" if s["small"] else "gpu"])


def part_throughput(p: Part, s: dict) -> None:
    """The 256-request workload (the 'tiny' preset with --small) after a warm-up of mixed
    prefill / decode steps, with the count of kernels compiled while timed (should be 0)."""
    from lmserve import LLM, SamplingParams
    from lmserve.bench.common import random_workload
    from lmserve.bench.offline import failed, run_throughput
    llm = LLM(s["model"], **_engine_opts(s, kv_cache_memory=s["kv_big"]))
    warm = random_workload(num_requests=8, input_len=(4, 200), output_len=(4, 24), vocab_size=llm.engine.vocab_size,
                           seed=1)  # prefills, mixed steps, decodes of several batch sizes
    failed(llm.generate([r.prompt for r in warm], [SamplingParams(max_tokens=r.max_tokens, temperature=0.6,
                                                                  ignore_eos=True) for r in warm], use_tqdm=False))
    v0 = compiled_variants()
    tp = run_throughput(llm, _workload(s, llm.engine.vocab_size), progress=False)
    v1 = compiled_variants()
    graphs = llm.engine.runner.graphs
    p.put(throughput=tp, compiled_variants=v1, graph_capture_s=llm.engine.graph_capture_time,
          graph_sizes=list(graphs.sizes) if graphs is not None else None)
    p.row("throughput output tok/s (lmserve)", f"{tp['output_tokens_per_s']:.1f} ({tp['output_tokens']} tokens, "
                                               f"{tp['wall_s']:.1f} s)")
    p.row("kernel compiles while timed", _compiles(v0, v1))
    if v1 is not None:
        p.row("compiled variants per kernel", ", ".join(f"{k.strip('_')} {v}" for k, v in v1.items() if v))
    if v0 is not None and v0 != v1:
        p.fail("recompiled while timed")


def _needle(llm: Any, crowd: int, needle_len: int, seeded: bool, share: bool, max_tokens: int = 16
            ) -> tuple[Any, Any]:
    """The needle test's two runs: one prompt alone, then the same inside `crowd` random requests (mixed
    lengths, greedy and sampled; with `share`, one of them starts with the needle's first 60%, a
    prefix-cache hit computed in other chunks). Each: (token ids, logprobs (T, 3): the chosen token's and
    the top two)."""
    import torch

    from lmserve import SamplingParams
    rng = random.Random(0)
    v = llm.engine.vocab_size
    needle = [rng.randrange(10, v) for _ in range(needle_len)]
    p = SamplingParams(max_tokens=max_tokens, temperature=0.8 if seeded else 0, seed=5 if seeded else None,
                       logprobs=2, ignore_eos=True)
    others = [[rng.randrange(10, v) for _ in range(rng.randint(5, needle_len // 2))] for _ in range(crowd)]
    if share:
        others[0] = needle[:needle_len * 3 // 5] + others[0]
    params = [SamplingParams(max_tokens=rng.randint(2, max_tokens + 8), temperature=rng.choice([0, 0.9]), seed=i,
                             ignore_eos=True) for i in range(crowd)]

    def row(o: Any) -> tuple[list[int], Any]:
        return o.token_ids, torch.tensor([[x.logprob, *sorted(x.top.values())] for x in o.logprobs])
    alone = llm.generate([needle], p, use_tqdm=False)[0].outputs[0]
    if not llm.reset_prefix_cache():  # the crowd run computes the needle again (else it hits the alone run's blocks)
        raise RuntimeError("reset_prefix_cache refused: the engine holds blocks")
    half = crowd // 2
    outs = llm.generate(others[:half] + [needle] + others[half:], params[:half] + [p] + params[half:], use_tqdm=False)
    return row(alone), row(outs[half].outputs[0])


def part_deterministic(p: Part, s: dict) -> None:
    """Deterministic mode on the device (issue #18): the batch-invariant attention kernels
    (attention/triton_invariant.py) against float64, and bit for bit across four batchings of a
    sequence beside the fast kernels' drift; then the engine's needle test (Triton attention, fused
    kernels, CUDA-graph decode): one prompt alone against the same inside 64 random requests (greedy;
    seeded sampling with a prefix-cache hit), logprobs compared with torch.equal, and teacher-forced
    logits as prefill chunks against one decode step a token; the needle with the mode off beside it."""
    import torch

    from lmserve import LLM
    from lmserve.attention.testing import batching_outputs, check_kernels
    from lmserve.attention.triton_attn import TritonAttention
    from lmserve.attention.triton_invariant import InvariantTritonAttention
    from lmserve.layers import dispatch
    cpu, dev = s["device"] == "cpu", s["device"]
    dtypes = [("fp32", torch.float32, 2e-4), ("bf16", torch.bfloat16, 3e-2)][:1 if cpu else 2]
    for name, dt, tol in dtypes:
        krows = check_kernels(dev, dt, backend=InvariantTritonAttention(), **({"d": 32, "cases": [1, 2]} if s["small"]
                                                                             else {}))
        kernel_rows(p, f"invariant_kernels {name}", f"invariant attention kernels {name}", krows, tol)
        if not s["small"]:  # several 32-key splits a token and several launches a step, against float64
            krows = check_kernels(dev, dt, backend=InvariantTritonAttention(split_keys=32, scratch_bytes=8000))
            errs = [r[k] for r in krows for k in ("triton_err", "static_err") if k in r]
            p.row(f"invariant kernels {name}, 32-key splits, small launches: max err", f"{max(errs):.1e} (tol {tol:g})")
            if max(errs) >= tol:
                p.fail(f"invariant kernels {name} small splits")
        for window, kv in ((None, None),) if s["small"] else ((None, None), (24, "int8")):
            inv = batching_outputs(InvariantTritonAttention(split_keys=32), dev, dt, window, kv)
            fast = batching_outputs(TritonAttention(), dev, dt, window, kv)
            same = all(torch.equal(o, inv["one chunk"]) for o in inv.values())
            drift = max((o - fast["one chunk"]).abs().max().item() for o in fast.values())
            p.row(f"4 batchings of a sequence, {name}, window {window}, {kv or 'float'} KV",
                  f"invariant {'bit-identical' if same else 'DIFFER'}; fast kernels differ by up to {drift:.1e}")
            if not same:
                p.fail(f"invariant attention {name} window {window} {kv}")
    from lmserve.sampling.sampler import running_sum
    x = torch.rand(64, 512 if s["small"] else 151936, device=dev).softmax(-1)  # (64, V)
    alone = all(torch.equal(running_sum(x[i:i + 1], True), running_sum(x[:n], True)[i:i + 1])
                for i, n in ((0, 64), (5, 9)))
    raw = all(torch.equal(x[i:i + 1].cumsum(-1), x[:n].cumsum(-1)[i:i + 1]) for i, n in ((0, 64), (5, 9)))
    p.row("sampler running sums (top-p, inverse CDF): a row alone vs in 9 / 64",
          f"{'bit-identical' if alone else 'DIFFER'}; torch's cumsum {'equal too' if raw else 'differs'}")
    if not alone:
        p.fail("sampler running sums")
    crowd, needle_len, new = (2, 14, 3) if s["small"] else (64, 260, 16)
    opts = dict(device=dev, attention_backend="triton", kv_cache_memory="8MiB" if cpu else s["kv_small"],
                max_num_batched_tokens=8 if s["small"] else 512, cuda_graph_sizes=[1, 2, 4, 8, 16, 32, 64, 72],
                max_model_len=64 if s["small"] else None)
    with dispatch.use_fused(True if cpu else None):  # on the CPU the fused kernels run under the interpreter
        det = LLM(s["model"], deterministic=True, **opts)
        if cpu:  # the padded static-buffer decode path a graph replays, run without one
            det.engine.runner.enable_graphs([1, 2, 4], det.engine.max_model_len, capture=False)
        for seeded, share in ((False, False),) if cpu else ((False, False), (True, True)):  # (the interpreter: slow)
            t0 = time.perf_counter()
            (ta, la), (tc, lc) = _needle(det, crowd, needle_len, seeded, share, new)
            same = ta == tc and torch.equal(la, lc)
            p.row(f"needle alone vs in {crowd} others, {'seeded, prefix hit' if share else 'greedy'}",
                  f"{'bit-identical' if same else 'DIFFER'} ({len(ta)} tokens; max |logprob diff| "
                  f"{(la - lc).abs().max().item():.1e}; {time.perf_counter() - t0:.1f} s)")
            if not same:
                p.fail(f"needle {'seeded' if seeded else 'greedy'}")
        rng = random.Random(1)
        toks = [rng.randrange(10, det.engine.vocab_size) for _ in range(needle_len)]
        graphs = det.engine.runner.graphs
        before = graphs.replays if graphs else 0
        chunks, decodes = det.score(toks), det.score(toks, decode_from=len(toks) // 4)  # (P, V) each
        replays = (graphs.replays if graphs else 0) - before
        p.row("teacher-forced logits: prefill chunks vs decode steps",
              f"{'bit-identical' if torch.equal(chunks, decodes) else 'DIFFER'} "
              f"(max {(chunks - decodes).abs().max().item():.1e}); decode steps through the graph path: {replays}")
        if not torch.equal(chunks, decodes):
            p.fail("prefill vs decode")
        del det
        _free(dev)
        if cpu:  # (the interpreter rounds the same however a step is batched: nothing to show, 20 s to wait)
            p.row("the mode off: needle alone vs in the crowd", "not run on the CPU")
            return
        off = LLM(s["model"], **opts)
        (ta, la), (tc, lc) = _needle(off, crowd, needle_len, False, False, new)
    n = min(len(la), len(lc))
    p.row("the mode off: needle alone vs in the crowd",
          f"{'bit-identical' if ta == tc and torch.equal(la, lc) else 'differ'} (max |logprob diff| "
          f"{(la[:n] - lc[:n]).abs().max().item():.1e}; tokens {'equal' if ta == tc else 'diverge'})")


def near_tie_divergences(got: list[list[int]], ref: list[list[int]], ref_logprobs: list[list[Any]],
                         tie: float) -> tuple[int, int, list[tuple[int, int, float]]]:
    """Greedy outputs against a reference run's (with its top-2 logprobs): (equal, diverging first at a
    near-tie: the reference's top-two gap at that position <= tie, [(output, position, gap)] of the
    divergences at a clear choice). Two runs of one model batched differently (other split-KV counts,
    other GEMM kernels) round differently in bf16, and with random weights the top two are often close."""
    same, ties, clear = 0, 0, []
    for k, (a, b, lps) in enumerate(zip(got, ref, ref_logprobs)):
        i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if i is None:
            same += len(a) == len(b)
            if len(a) != len(b):
                clear.append((k, min(len(a), len(b)), float("inf")))
            continue
        top = sorted(lps[i].top.values(), reverse=True)
        gap = top[0] - top[1] if len(top) > 1 else float("inf")
        if gap <= tie:
            ties += 1
        else:
            clear.append((k, i, gap))
    return same, ties, clear


def part_swap(p: Part, s: dict) -> None:
    """Preemption by swapping on the device (pinned host copies): 12 requests in a pool of a quarter
    of what they need, every victim swapped; greedy tokens equal an unpreempted pool's, but where the
    two first part at a near-tie (other batch shapes round differently)."""
    import torch

    from lmserve import LLM, SamplingParams
    from lmserve.bench.offline import failed
    from lmserve.kv.cache import KVCache
    sizes = [1, 2, 4, 8, 16]  # graph captures: what these batches use, not the default's 35
    llm_big = LLM(s["model"], **_engine_opts(s, kv_cache_memory=s["kv_small"], enable_prefix_caching=False,
                                             cuda_graph_sizes=sizes))
    cfg, dtype = llm_big.engine.model_config, llm_big.engine.config.torch_dtype
    rng = random.Random(3)
    prompts = [[rng.randrange(10, llm_big.engine.vocab_size) for _ in range(rng.randint(16, 96))] for _ in range(12)]
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    ref_outs = llm_big.generate(prompts, SamplingParams(max_tokens=48, temperature=0, ignore_eos=True, logprobs=2),
                                use_tqdm=False)
    failed(ref_outs)
    ref = [o.outputs[0].token_ids for o in ref_outs]
    ref_lps = [o.outputs[0].logprobs for o in ref_outs]
    del llm_big
    _free(s["device"])
    need = sum(-(-(len(x) + 48) // 16) for x in prompts)  # blocks of 16 all of them need at once
    per_block = KVCache.bytes_per_block(cfg, 16, dtype)
    llm = LLM(s["model"], **_engine_opts(s, kv_cache_memory=per_block * max(need // 4, 16), block_size=16,
                                         enable_prefix_caching=False, preemption_mode="swap", swap_space="1GiB",
                                         cuda_graph_sizes=sizes))
    outs = llm.generate(prompts, params, use_tqdm=False)
    failed(outs)
    got = [o.outputs[0].token_ids for o in outs]
    st = llm.stats()
    noise = _read_part(Path(s["out"]) / "parts" / "correctness.json").get("data", {}).get("gate", {}).get("noise")
    tie = 2 * noise if noise else (0.1 if dtype != torch.float32 else 1e-3)  # as the correctness gate's bar
    same, ties, clear = near_tie_divergences(got, ref, ref_lps, tie)
    p.put(swap={"preemptions": st.num_preemptions, "swapped": st.num_swapped, "same": same, "near_ties": ties,
                "clear_divergences": clear, "tie": tie})
    p.row("swap preemption: preemptions (swapped) / outputs equal to an unpreempted pool",
          f"{st.num_preemptions} ({st.num_swapped}) / {same} of {len(prompts)}; {ties} part at a near-tie "
          f"(top-two gap <= {tie:.3g})")
    if st.num_swapped == 0:
        p.fail("no preemption swapped")
    if clear:
        p.fail(f"swapped outputs differ at a clear choice: (output, position, gap) {clear[:3]}")


def part_offload(p: Part, s: dict) -> None:
    """The prefix cache's offload tier on the device (kv_offloading_size: evicted blocks to host memory
    and back): a prompt whose blocks left a small pool comes back from the tier and gives the tokens
    and logprobs of a pool hit in a large pool, bit for bit (the same KV bytes, the same step shapes)."""
    from lmserve import LLM, SamplingParams
    from lmserve.bench.offline import failed
    from lmserve.kv.cache import KVCache
    sizes = [1, 2, 4]
    probe = LLM(s["model"], **_engine_opts(s, kv_cache_memory=s["kv_small"], cuda_graph_sizes=sizes))
    cfg, dtype, vocab = probe.engine.model_config, probe.engine.config.torch_dtype, probe.engine.vocab_size
    rng = random.Random(5)
    doc = [rng.randrange(10, vocab) for _ in range(513)]  # 32 full blocks of 16 before its last token
    others = [[rng.randrange(10, vocab) for _ in range(513)] for _ in range(3)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2)

    def visit(llm: Any) -> Any:
        failed(llm.generate([doc], params, use_tqdm=False))
        failed(llm.generate(others, params, use_tqdm=False))
        outs = llm.generate([doc], params, use_tqdm=False)
        failed(outs)
        return outs[0]
    hit = visit(probe)  # a pool that holds all four: the second visit is a pool hit
    del probe
    _free(s["device"])
    per_block = KVCache.bytes_per_block(cfg, 16, dtype)
    llm = LLM(s["model"], **_engine_opts(s, kv_cache_memory=per_block * 80, block_size=16, kv_offloading_size="1GiB",
                                         cuda_graph_sizes=sizes))
    back = visit(llm)
    st = llm.stats()
    same = back.outputs[0].token_ids == hit.outputs[0].token_ids
    exact = same and back.outputs[0].logprobs == hit.outputs[0].logprobs
    p.put(offload={"hit_tokens": back.metrics.num_cached_tokens, "tier_tokens": st.offload_hit_tokens,
                   "tokens_equal": same, "bit_identical": exact, "pool_hit_tokens": hit.metrics.num_cached_tokens})
    p.row("offload tier: tokens back from the tier / outputs vs a pool hit",
          f"{st.offload_hit_tokens} of {back.metrics.num_cached_tokens} cached; "
          f"{'bit-identical' if exact else 'tokens equal, logprobs differ' if same else 'tokens differ'}")
    if st.offload_hit_tokens != 512 or hit.metrics.num_cached_tokens != 512:
        p.fail(f"expected 512 tokens from the tier and from the pool, got {st.offload_hit_tokens} and "
               f"{hit.metrics.num_cached_tokens}")
    if not same:
        p.fail("a tier hit gave other tokens than a pool hit")


def part_hf(p: Part, s: dict) -> None:
    """HF transformers on the same weights: `generate` at batch 1 (prompt 128 + 128 new tokens), then
    static batches beside lmserve on one slice of the throughput workload, both in this part: its
    first HF_REQUESTS requests with max_tokens clipped to HF_MAX_TOKENS, in one padded batch for HF.
    (The whole 256-request workload took HF past its time on the first H200 run: its decode step is
    host-bound, ~0.12 s, and the workload's longest outputs are 1,024 tokens.)"""
    from dataclasses import replace

    from lmserve import LLM
    from lmserve.bench.common import random_workload
    from lmserve.bench.hf import hf_generate, hf_latency, load_hf_model
    from lmserve.bench.offline import run_throughput
    from lmserve.config import EngineConfig
    from lmserve.models.shapes import shape_config
    vocab = shape_config(s["shape"]).vocab_size
    hf = load_hf_model(s["model"], EngineConfig(model=s["model"], device=s["device"]).torch_dtype, s["device"])
    rng = random.Random(0)
    in_len, out_len = (32, 16) if s["small"] else (128, 128)
    hfl = hf_latency(hf, [rng.randrange(10, vocab) for _ in range(in_len)], 1, out_len, s["device"])
    p.put(hf_latency=hfl)
    p.row("HF batch-1 decode tok/s", f"{hfl['decode_tokens_per_s']:.1f} (TPOT {hfl['tpot_s'] * 1e3:.1f} ms, "
                                     f"TTFT {hfl['ttft_s'] * 1e3:.0f} ms; prompt {in_len} + {out_len})")
    n, cap = (4, 8) if s["small"] else (HF_REQUESTS, HF_MAX_TOKENS)
    reqs = [replace(r, max_tokens=min(r.max_tokens, cap)) for r in _workload(s, vocab)[:n]]
    hft = hf_generate(hf, reqs, n, s["device"])
    p.put(hf_throughput=hft)
    del hf
    _free(s["device"])
    llm = LLM(s["model"], **_engine_opts(s, kv_cache_memory=s["kv_big"]))
    warm = random_workload(num_requests=8, input_len=(4, 200), output_len=(4, 24), vocab_size=vocab, seed=1)
    run_throughput(llm, warm, progress=False)  # warm-up: other prompts (the slice's own would be cached)
    ours = run_throughput(llm, reqs, progress=False)
    p.put(lmserve_throughput_same_slice=ours)
    if ours["prefix_cache_hit_rate"]:
        p.fail(f"lmserve's slice hit the prefix cache ({ours['prefix_cache_hit_rate']:.1%}): not HF's work")
    p.row(f"slice of the workload: {n} requests, max_tokens <= {cap}, output tok/s",
          f"HF generate (one batch) {hft['output_tokens_per_s']:.1f}; lmserve {ours['output_tokens_per_s']:.1f}; "
          f"lmserve / HF = {ours['output_tokens_per_s'] / hft['output_tokens_per_s']:.2f}x")


HF_REQUESTS = 64  # the slice of the throughput workload HF runs (one static batch)
HF_MAX_TOKENS = 256


# name, estimated seconds on CUDA (qwen3-0.6b; process start included: the first H200 run's, 2026-12-04, with
# some room; quant sweep's unmeasured), on the CPU with --small, function
PARTS: list[tuple[str, float, float, PartFn]] = [
    # what the README names first (kernel checks, fast path vs reference, batch 1 vs the bound, the
    # 256-request workload beside HF), so that a slow start leaves the rest to a rerun with --parts
    ("preflight", 15, 5, part_preflight),
    ("kernels", 130, 15, part_kernels),
    ("correctness", 40, 18, part_correctness),
    ("batch-1 decode", 60, 5, part_batch1),
    ("throughput", 50, 6, part_throughput),
    ("hf baseline", 80, 15, part_hf),
    ("fusions", 15, 4, part_fusions),
    ("swap", 20, 6, part_swap),
    ("offload", 20, 10, part_offload),
    ("host overhead", 15, 6, part_host),
    ("quant matmul", 30, 8, part_quant_matmul),
    ("deterministic", 55, 50, part_deterministic),  # #18's CUDA half; a cut first run: --parts deterministic
    ("quant sweep", 180, 10, part_quant_sweep),  # the GEMV blocks for batch-1 decode (after the first H200 run)
]
NEEDS_TRITON = {"fusions", "kernels", "correctness", "deterministic", "quant matmul", "quant sweep"}


def skip_without_triton(name: str, settings: dict) -> str | None:
    """run_parts' `before`: the parts that test Triton kernels are skipped once the preflight failed."""
    return "needs Triton, and the preflight could not launch a kernel" if settings["no_triton"] and \
        name in NEEDS_TRITON else None


def note_preflight(name: str, res: dict, settings: dict, banner: list[str]) -> None:
    """run_parts' `after`: a preflight that did not end 'ok' hides Triton from every later part (they
    run on torch ops) and puts a loud line around the table."""
    if name == "preflight" and res["status"] != "ok":
        settings["no_triton"] = True
        why = str(res.get("error") or res.get("failures"))[:200]
        banner.append(f"!!! NO TRITON: the preflight launch failed ({why}); the parts below ran on torch ops: "
                      "no Triton attention, fused kernels, Gumbel sampler or CUDA graphs !!!")


def machine_info() -> dict[str, str]:
    """What BENCHMARKS.md needs beside the figures: the GPU and driver (nvidia-smi: the parent process
    must not initialise CUDA before its parts start), the commit, the date."""
    import subprocess

    def cmd(*args: str) -> str:
        try:
            return subprocess.run(args, capture_output=True, text=True, timeout=20).stdout.strip() or "unknown"
        except (OSError, subprocess.SubprocessError):
            return "unknown"
    return {"gpu": cmd("nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"),
            "commit": cmd("git", "-C", str(Path(__file__).resolve().parents[1]), "rev-parse", "--short", "HEAD"),
            "python": sys.version.split()[0], "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default=None, help="model shape (default qwen3-0.6b; debug-tiny with --small)")
    ap.add_argument("--small", action="store_true", help="tiny sizes (CPU dry run)")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds for the whole run (default 480 on CUDA, 600 on the CPU): a part that no longer "
                         "fits its estimate is skipped, one still running at the end is killed")
    ap.add_argument("--parts", default=None, help=f"comma-separated subset, run in the order given, of: {', '.join(n for n, *_ in PARTS)}")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out/gpu"))
    a = ap.parse_args()
    cpu = a.device == "cpu"
    if cpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    budget = a.budget if a.budget is not None else (600.0 if cpu else 480.0)
    shape = a.shape or ("debug-tiny" if a.small else "qwen3-0.6b")
    wanted = set(a.parts.split(",")) if a.parts else None
    if wanted and wanted - {n for n, *_ in PARTS}:
        ap.error(f"unknown parts: {', '.join(sorted(wanted - {n for n, *_ in PARTS}))}")
    order = a.parts.split(",") if a.parts else [n for n, *_ in PARTS]  # --parts: in the order given
    parts = [(n, cpu_s if a.small else cuda_s, fn) for name in order for n, cuda_s, cpu_s, fn in PARTS if n == name]
    settings = {"device": a.device, "shape": shape, "model": f"shape:{shape}", "small": a.small, "out": a.out,
                "no_triton": False,  # set when the preflight fails: the later parts run on torch ops
                "kv_small": "1GiB" if a.small else "4GiB", "kv_host": "1GiB" if a.small else "8GiB",
                "kv_big": "1GiB" if a.small else None}  # None: sized by the memory profile (gpu_memory_utilization)
    settings["machine"] = machine_info()
    banner: list[str] = []

    def stop(signum: int, frame: Any) -> None:  # `timeout` sends SIGTERM: end the running part, keep the JSON
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    out = Path(a.out)
    print(f"gpu_check: {a.device}, shape {shape}, budget {budget:.0f} s, results in {out}/gpu_check.json", flush=True)
    t0 = time.monotonic()
    try:
        report = run_parts(parts, settings, out, budget - (time.monotonic() - t0), before=skip_without_triton,
                           after=lambda name, res: note_preflight(name, res, settings, banner))
    except KeyboardInterrupt:
        report = json.loads((out / "gpu_check.json").read_text())
    if banner:
        report["banner"] = banner[0]
        (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
    print(f"\n[{time.monotonic() - t0:.0f} s of --budget {budget:.0f}]\n{format_table(report)}", flush=True)
    return 1 if report["failed"] else 0


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
    norm128 = RMSNorm(128).to(device, bf)  # Qwen3's per-head q/k norm
    rot = RotaryEmbedding(128, 40960, 1e6).to(device)
    out: dict = {}
    for n in (256, 8192):
        x, r = torch.randn(n, 1024, device=device, dtype=bf), torch.randn(n, 1024, device=device, dtype=bf)
        gu = torch.randn(n, 2 * 3072, device=device, dtype=bf)
        q = torch.randn(n, 16, 128, device=device, dtype=bf)
        k = torch.randn(n, 8, 128, device=device, dtype=bf)
        pos = torch.randint(0, 4096, (n,), device=device)
        cos, sin = rot.cos[pos], rot.sin[pos]
        with dispatch.use_fused(False):  # the torch path, on CUDA tensors
            torch_us = {"add+rmsnorm": time_us(lambda: norm(x, r)),
                        "silu*mul": time_us(lambda: torch.nn.functional.silu(gu[:, :3072]) * gu[:, 3072:]),
                        "rotary q+k": time_us(lambda: rot(pos, q, k, (cos.unsqueeze(1), sin.unsqueeze(1)))),
                        "q/k rmsnorm": time_us(lambda: (norm128(q), norm128(k)))}
        fused_us = {"add+rmsnorm": time_us(lambda: add_rmsnorm(x, r, norm.weight, norm.eps)),
                    "silu*mul": time_us(lambda: silu_and_mul(gu)),
                    "rotary q+k": time_us(lambda: (rotary_(q, cos, sin), rotary_(k, cos, sin))),
                    "q/k rmsnorm": time_us(lambda: (norm128(q), norm128(k)))}
        for op in torch_us:
            out[f"{op} N={n}"] = (fused_us[op], torch_us[op])
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


def mla_kernel_check(device: str, dtype: Any, small: bool) -> tuple[float, bool]:
    """attention/triton_mla.decode (split-KV) against float64 on the CPU, DeepSeek-V3's widths (128 heads,
    latent 512, rope 64; tiny with small) over ragged contexts, plus a padding row (context 0) that must
    come out zero. Returns (max abs error of the live rows, padding row zero)."""
    import torch

    from lmserve.attention import triton_mla
    from lmserve.attention.testing import random_step
    h, lat, rope, ctx = (4, 32, 16, [5, 20]) if small else (128, 512, 64, [1, 37, 300, 1000])
    meta, _, tables = random_step(ctx, [1] * len(ctx), 16, 1, 8, seed=7)
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(meta.block_tables.max().item() * 16 + 16, lat + rope, generator=g).to(dtype)  # (S, L + R)
    b = len(ctx) + 1  # the last row: padding
    q_lat, q_pe = torch.randn(b, h, lat, generator=g).to(dtype), torch.randn(b, h, rope, generator=g).to(dtype)
    scale = 192 ** -0.5
    bt = torch.cat([meta.block_tables, meta.block_tables[:1]]).to(device)
    lens = torch.tensor([*ctx, 0], device=device)
    out = triton_mla.decode(q_lat.to(device), q_pe.to(device), cache.to(device), bt, lens, scale, 16,
                            target_programs=64).cpu().double()  # (B, H, L)
    err = 0.0
    for i, c in enumerate(ctx):
        rows = cache[[tables[i][j // 16] * 16 + j % 16 for j in range(c)]].double()  # (c, L + R)
        s = (q_lat[i].double() @ rows[:, :lat].T + q_pe[i].double() @ rows[:, lat:].T) * scale  # (H, c)
        err = max(err, (out[i] - s.softmax(-1) @ rows[:, :lat]).abs().max().item())
    return err, bool((out[-1] == 0).all())


def fused_check(device: str, n: int = 37) -> float:
    """Fused add+RMSNorm (rows, and per-head q/k as Qwen3 uses it), SiLU-and-mul and in-place rotary
    on the device against the torch code they replace (run on CPU copies, where nothing is fused),
    bf16, n tokens. Returns the largest difference."""
    import torch

    from lmserve.layers import dispatch
    from lmserve.layers.fused import add_rmsnorm, rotary_, silu_and_mul
    from lmserve.layers.norm import RMSNorm
    from lmserve.layers.rotary import RotaryEmbedding
    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(n, 1024, generator=g).to(torch.bfloat16) for _ in range(2))
    norm = RMSNorm(1024).to(torch.bfloat16)
    ref_out, ref_res = norm(x, r)  # the torch path (CPU tensors)
    out, res = add_rmsnorm(x.to(device), r.to(device), norm.weight.to(device), norm.eps)
    errs = [(out.cpu().float() - ref_out.float()).abs().max().item(),
            (res.cpu().float() - ref_res.float()).abs().max().item()]
    qkv = torch.randn(n, 3 * 4 * 128, generator=g).to(torch.bfloat16)  # (n, 3 x 4 heads x 128)
    head_norm = RMSNorm(128).to(torch.bfloat16)
    with dispatch.use_fused(True):  # q as Qwen3 normalises it: a strided (n, 4, 128) view of the qkv output
        got = head_norm.to(device)(qkv.to(device)[:, :4 * 128].view(n, 4, 128))  # (n, 4, 128)
    errs.append((got.cpu().float() - head_norm.cpu()(qkv[:, :4 * 128].view(n, 4, 128)).float()).abs().max().item())
    gu = torch.randn(n, 2 * 3072, generator=g).to(torch.bfloat16)
    gate, up = gu.float().chunk(2, dim=-1)
    errs.append((silu_and_mul(gu.to(device)).cpu().float() - torch.nn.functional.silu(gate) * up).abs().max().item())
    rot = RotaryEmbedding(128, 4096, 1e6)
    pos = torch.randint(0, 4096, (n,), generator=g)
    for heads in (16, 8):
        q = torch.randn(n, heads, 128, generator=g).to(torch.bfloat16)
        ref, _ = rot(pos, q, q)
        got = rotary_(q.to(device), rot.cos[pos].to(device), rot.sin[pos].to(device))
        errs.append((got.cpu().float() - ref.float()).abs().max().item())
    return max(errs)


if __name__ == "__main__":
    sys.exit(main())
