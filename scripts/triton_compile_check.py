"""Compile every Triton kernel of lmserve for a GPU on a machine without one (Triton's front end, then
ptxas to a cubin), in the variants the GPU check launches.

    python scripts/triton_compile_check.py             # sm_90 (the H200 scripts/gpu_check.py runs on)
    python scripts/triton_compile_check.py --arch 80

The kernels are otherwise only ever run under TRITON_INTERPRET=1 here, which shares Triton's language
front end but never meets the compiler's rules (types of loop-carried values, layouts, register and
shared-memory limits, ptxas); a kernel that fails to compile would cost a device session, which is
short and rare. This drives the same Python wrappers scripts/gpu_check.py drives (attention, fast and
batch-invariant, float and quantized caches; MLA's latent decode; the fused norm / SiLU / rotary; the
Gumbel sampler; the quantized matmuls), on CPU tensors, with `JITFunction.run` replaced by a compile
of the variant it would launch (the same binder, specialization and constexprs). The outputs are never
computed, so the checks' numbers are meaningless here; what counts is that every variant compiles and
that every kernel in lmserve was reached. Exit status 1 otherwise. The installed Triton's compiler is
used (the device machine's Triton may be older: say which in a note). tests/test_triton_compile.py runs it.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
import traceback
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # before any kernel is defined: real JITFunctions, not interpreted
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

KERNEL_MODULES = ("lmserve.attention.triton_attn", "lmserve.attention.triton_invariant",
                  "lmserve.attention.triton_mla", "lmserve.layers.fused", "lmserve.sampling.gumbel",
                  "lmserve.layers.triton_quant")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability x 10 (default 90: Hopper)")
    ap.add_argument("--quick", action="store_true", help="bf16 and fewer kernel cases: every kernel, fewer "
                    "variants (the test suite's run, ~1 min on two cores; the full run ~3)")
    a = ap.parse_args()
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile, make_backend
    from triton.runtime import jit

    target = GPUTarget("cuda", a.arch, 32)
    backend = make_backend(target)
    compiled: dict[tuple[str, str, str], float] = {}
    failures: list[str] = []

    def run(self, *args, grid, warmup, **kwargs):  # type: ignore[no-untyped-def]  # JITFunction.run
        bound, spec, options = jit.create_function_from_signature(self.signature, self.params, backend)(*args, **kwargs)
        key = (f"{self.fn.__module__}.{self.__name__}", str(spec), str(options))
        if key in compiled:
            return None
        options, signature, constexprs, attrs = self._pack_args(backend, kwargs, bound, spec, options)
        t0 = time.perf_counter()
        try:
            compile(ASTSource(self, signature, constexprs, attrs), target=target, options=options.__dict__)
        except Exception as e:  # noqa: BLE001
            failures.append(f"{self.__name__} {dict(constexprs)}: {type(e).__name__}: {str(e)[:1500]}")
        compiled[key] = time.perf_counter() - t0
        return None

    jit.JITFunction.run = run  # type: ignore[method-assign]
    import gpu_check

    from lmserve.attention.testing import batching_outputs, check_kernels, check_quant_kernels
    from lmserve.attention.triton_attn import TritonAttention
    from lmserve.attention.triton_invariant import InvariantTritonAttention
    from lmserve.attention import triton_mla
    from lmserve.layers import triton_quant
    from lmserve.sampling.gumbel import gumbel_sample

    def mla_store(dt: torch.dtype) -> None:  # DeepSeek-V3's widths: latent 512, rope 64
        triton_mla.store(torch.empty(64, 576, dtype=dt), torch.empty(5, 512, dtype=dt), torch.empty(5, 64, dtype=dt),
                         torch.arange(5))
    triton_quant._target_programs = lambda device: 4 * 132  # type: ignore[assignment]  # as on an H100 / H200
    triton_quant._fp8_native = lambda device: a.arch >= 89  # type: ignore[assignment]
    bf16, fp32 = torch.bfloat16, torch.float32
    dtypes = (bf16,) if a.quick else (fp32, bf16)
    cases = [1, 2, 4] if a.quick else None  # decodes (GQA 2), mixed chunks (GQA 4, block 32), a window
    drivers = [
        ("attention, fast", lambda: [check_kernels("cpu", dt, fp32_dot=dot, cases=cases) for dt, dot in
                                     (((bf16, "tf32"), (fp32, "ieee")) if a.quick else
                                      ((fp32, "ieee"), (fp32, "tf32"), (bf16, "tf32")))]),
        ("attention, quantized KV", lambda: [check_quant_kernels("cpu", bf16, kv, cases=cases) for kv in ("int8", "fp8")]
         + ([] if a.quick else [check_quant_kernels("cpu", fp32, "int8")])),
        ("attention, batch-invariant", lambda: [
            check_kernels("cpu", dt, backend=InvariantTritonAttention(**kw), cases=cases) for dt in dtypes
            for kw in ({}, {"split_keys": 32, "scratch_bytes": 8000})]
            + [check_quant_kernels("cpu", bf16, kv, backend=InvariantTritonAttention(), cases=cases)
               for kv in ("int8", "fp8")]
            + [batching_outputs(b, "cpu", dt, w, kv) for dt in dtypes for w, kv in ((None, None), (24, "int8"))
               for b in (InvariantTritonAttention(split_keys=32), TritonAttention())]),
        ("MLA latent decode", lambda: [gpu_check.mla_kernel_check("cpu", dt, small=False) for dt in dtypes]
         + [mla_store(dt) for dt in dtypes]),
        ("fused norm / SiLU / rotary", lambda: gpu_check.fused_check("cpu")),
        ("Gumbel sampler", lambda: gumbel_sample(torch.randn(8, 151936), torch.ones(8), torch.arange(8))),
        ("quantized matmuls", lambda: [gpu_check.quant_matmul_check("cpu", bf16, full=not a.quick)]
         + ([] if a.quick else [gpu_check.quant_matmul_check("cpu", torch.float16)])),
    ]
    if not a.quick:  # the GEMV block choices gpu_check's quant sweep times (a Llama-3.1-8B layer's width)
        drivers.append(("quant sweep blocks", lambda: [quant_sweep_launch(triton_quant, kind, blocks)
                                                       for kind in ("int8", "int4", "fp8")
                                                       for blocks in gpu_check.GEMV_SWEEP]))
    from lmserve.layers import dispatch
    t0 = time.perf_counter()
    with dispatch.use_fused(True):  # the fused kernels on CPU tensors: the wrappers launch (compile) them
        for name, fn in drivers:
            t = time.perf_counter()
            try:
                fn()
            except Exception:  # noqa: BLE001  # a wrapper that cannot even reach its launch
                failures.append(f"{name}: the driver raised\n{traceback.format_exc()[-2000:]}")
            print(f"{name}: {time.perf_counter() - t:.1f} s", flush=True)
    kernels = {f"{m}.{n}" for m in KERNEL_MODULES for n, v in vars(importlib.import_module(m)).items()
               if isinstance(v, jit.JITFunction) and not getattr(v, "noinline", False) and n.endswith("_kernel")}
    reached = {n for n, _, _ in compiled}
    per: dict[str, int] = {}
    for n, _, _ in compiled:
        n = n.rsplit(".", 2)[-2] + "." + n.rsplit(".", 1)[-1]  # module.kernel
        per[n] = per.get(n, 0) + 1
    print(f"sm_{a.arch}: {len(compiled)} variants of {len(per)} kernels compiled in {time.perf_counter() - t0:.0f} s "
          f"({', '.join(f'{k} {v}' for k, v in sorted(per.items()))})")
    for k in sorted(kernels - reached):
        failures.append(f"{k}: never launched by the drivers")
    for f in failures:
        print("FAILED:", f)
    return 1 if failures else 0


def quant_sweep_launch(tq, kind: str, blocks: dict) -> None:  # type: ignore[no-untyped-def]
    """One batch-1 GEMV launch of a 4096 x 4096 layer of `kind` with gpu_check's sweep `blocks`."""
    import torch

    from lmserve.layers.quant import Fp8Linear, Int4Linear, Int8Linear
    from lmserve.models.registry import default_group_size
    layer = Int8Linear(4096, [4096]) if kind == "int8" else Fp8Linear(4096, [4096]) if kind == "fp8" else \
        Int4Linear(4096, [4096], group_size=default_group_size(4096))
    layer = layer.to(torch.bfloat16)
    kw = {**blocks, "block_k": blocks["block_k"] * (2 if kind == "int4" else 1)}
    tq.gemv(torch.randn(1, 4096, dtype=torch.bfloat16), tq.packed_weight(layer), **kw)


if __name__ == "__main__":
    sys.exit(main())
