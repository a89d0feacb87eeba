"""Triton kernels under TRITON_INTERPRET=1 against the torch reference and float64 math.

Fresh random inputs; GQA ratios 1/2/4/8; block sizes 16 and 32; ragged lengths; prefixes ending
mid-block; sliding windows; outputs poisoned with NaN before the run so unwritten elements fail.
In float32: the interpreter's tl.dot is wrong for bfloat16 inputs (a plain 16x16 dot is off by
~1e10), so the bf16 runs of these same cases are in scripts/gpu_check.py, compiled for the GPU.
"""

from __future__ import annotations

import functools
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from lmserve.attention.testing import KERNEL_CASES, check_kernels, float64_attention, random_step  # noqa: E402
from lmserve.attention.torch_ref import TorchAttention  # noqa: E402
from lmserve.attention.triton_attn import TritonAttention, store_kv  # noqa: E402


@pytest.mark.parametrize("ctx,qlens,group,bs,window", KERNEL_CASES)
def test_attention_kernels(ctx, qlens, group, bs, window):  # type: ignore[no-untyped-def]
    hkv, d = 2, 32
    h = hkv * group
    seed = hash((tuple(ctx), group, bs)) % 10000
    meta, cache, tables = random_step(ctx, qlens, bs, hkv, d, seed)
    g = torch.Generator().manual_seed(seed + 1)
    n = sum(qlens)
    q = torch.randn(n, h, d, generator=g)
    k = torch.randn(n, hkv, d, generator=g)
    v = torch.randn(n, hkv, d, generator=g)
    scale = d ** -0.5

    ref_cache = cache.clone()
    ref = TorchAttention().forward(q, k, v, ref_cache, meta, scale, window)
    tri_cache = cache.clone()
    tri = TritonAttention(rows=16, target_programs=64).forward(q, k, v, tri_cache, meta, scale, window)
    exact = float64_attention(q, ref_cache, meta, tables, scale, window)

    assert torch.equal(tri_cache, ref_cache)  # the store kernel wrote exactly the same slots
    assert not torch.isnan(tri).any()
    assert (tri.double() - exact).abs().max() < 1e-4
    assert (ref.double() - exact).abs().max() < 1e-4
    # the decode path really split the context (split-KV), for the long decodes
    if 1 in qlens and max(ctx) > 4 * bs:
        plan = TritonAttention(rows=16, target_programs=64)._plan(meta, hkv, group)
        assert plan["splits"] > 1


def test_store_kv_poisoned_cache():
    n, hkv, d, slots_total = 7, 2, 16, 64
    k, v = torch.randn(n, hkv, d), torch.randn(n, hkv, d)
    kc = torch.full((slots_total, hkv, d), float("nan"))
    vc = torch.full((slots_total, hkv, d), float("nan"))
    slots = torch.tensor([3, 10, 11, 40, 41, 42, 63])
    store_kv(k, v, kc, vc, slots)
    assert torch.equal(kc[slots], k) and torch.equal(vc[slots], v)
    untouched = torch.ones(slots_total, dtype=torch.bool)
    untouched[slots] = False
    assert torch.isnan(kc[untouched]).all()  # nothing else written


def test_output_poisoned_rows_all_written(monkeypatch):  # type: ignore[no-untyped-def]
    meta, cache, _ = random_step([40, 3, 18], [40, 1, 5], 16, 2, 32, seed=7)
    q = torch.randn(46, 4, 32)
    k, v = torch.randn(46, 2, 32), torch.randn(46, 2, 32)
    real_empty = torch.empty_like

    def poisoned(t, *a, **kw):  # type: ignore[no-untyped-def]
        return real_empty(t, *a, **kw).fill_(float("nan"))

    monkeypatch.setattr(torch, "empty_like", poisoned)
    out = TritonAttention(rows=16).forward(q, k, v, cache, meta, 32 ** -0.5, None)
    assert not torch.isnan(out).any()


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_engine_with_triton_backend_matches_torch(tiny_models, family):  # type: ignore[no-untyped-def]
    from lmserve import LLM, SamplingParams
    path, _ = tiny_models[family]
    prompts = [[5, 17, 33, 9, 100, 3] * 5, [11, 12], list(range(40, 77))]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    ref = LLM(str(path), attention_backend="torch", block_size=16).generate(prompts, params, use_tqdm=False)
    tri_llm = LLM(str(path), attention_backend="triton", block_size=16, max_num_batched_tokens=32)
    out = tri_llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    logits_t = tri_llm.score(prompts[2])
    logits_r = LLM(str(path), attention_backend="torch").score(prompts[2])
    assert (logits_t - logits_r).abs().max() < 1e-4


def test_check_kernels_used_by_gpu_check():
    """The function scripts/gpu_check.py runs on the GPU, here on two cases (one decode-only, so the
    padded static batch is checked too)."""
    rows = check_kernels("cpu", torch.float32, d=32, cases=[1, 2])
    assert [r["case"] for r in rows] == [1, 2]
    for r in rows:
        assert r["store_equal"] and r["triton_err"] < 1e-4 and r["torch_err"] < 1e-4
    assert rows[0]["static_err"] < 1e-4 and rows[0]["static_pad_zero"] and rows[0]["static_store_equal"]
    assert "static_err" not in rows[1]


@functools.cache
def _jit_binder(kernel):  # type: ignore[no-untyped-def]
    """Triton's own binder for `kernel` as the JIT (not the interpreter, which compiles nothing)
    builds it: from the kernel's Python function and its do_not_specialize list, with the CUDA
    backend's rules (an integer argument equal to 1 becomes a constant; integers divisible by 16
    and 16-byte aligned pointers are marked; listed parameters are left alone)."""
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import JITFunction, create_function_from_signature
    jf = JITFunction(kernel.fn, do_not_specialize=kernel.kwargs.get("do_not_specialize"),
                     do_not_specialize_on_alignment=kernel.kwargs.get("do_not_specialize_on_alignment"))
    return create_function_from_signature(jf.signature, jf.params, CUDABackend)


def _jit_key(kernel, args: tuple, kwargs: dict) -> str:  # type: ignore[no-untyped-def]
    """The cache key the JIT computes for a launch with these arguments: each distinct key is one
    compile on the GPU."""
    _, spec, options = _jit_binder(kernel)(*args, **kwargs)
    return str(spec) + str(options)


def test_kernel_variants_constant_over_random_steps(tiny_models, monkeypatch):  # type: ignore[no-untyped-def]
    """40 random engine steps (arrivals, chunked prefills mixed with decodes, decode-only steps
    through the padded static-buffer path of several sizes; attention kernels, and in every 4th
    step the fused kernels, Qwen3's per-head q/k norm included) launch every kernel with the JIT
    keys its call sites show in the first steps, and no other later: after a warm-up no step would
    compile a new variant in the middle of a measurement. Each attention kernel has one key in all.
    (Before do_not_specialize, the split count, block-table width, scratch strides and the offsets
    of index lists inside the runner's packed step tensor gave new keys all along: the same test
    then finds new prefill, decode and reduce keys at steps 11, 18 and 26.)

    The interpreter compiles nothing, so the keys are computed, not observed: Triton's own binder
    (see _jit_binder) applied to the arguments of every launch the steps make."""
    import random

    from lmserve import LLM, SamplingParams
    from lmserve.attention import triton_attn
    from lmserve.layers import dispatch, fused
    attention = ("_store_kv_kernel", "_prefill_kernel", "_decode_kernel", "_reduce_kernel")
    kernels = {n: getattr(triton_attn, n) for n in attention}
    kernels.update({n: getattr(fused, n) for n in ("_add_rmsnorm_kernel", "_silu_mul_kernel", "_rotary_kernel")})
    first_seen: dict[tuple[str, str], int] = {}  # (kernel, JIT key) -> the step that first launched it
    step = [0]
    for name, kern in kernels.items():
        def recording(*args, grid, warmup, _run=kern.run, _k=kern, _n=name, **kwargs):  # type: ignore[no-untyped-def]
            first_seen.setdefault((_n, _jit_key(_k, args, kwargs)), step[0])
            return _run(*args, grid=grid, warmup=warmup, **kwargs)
        monkeypatch.setattr(kern, "run", recording)
    path, _ = tiny_models["qwen3"]  # q/k norm (per-head rows through the fused norm), GQA 4
    eng = LLM(str(path), attention_backend="triton", max_num_batched_tokens=12, max_num_seqs=6).engine
    eng.runner.model.layers[0].self_attn.backend.target_programs = 16  # fewer programs under the interpreter,
    eng.runner.enable_graphs([1, 2, 4], eng.max_model_len, capture=False)  # still 1..4 splits as steps vary
    rng = random.Random(0)
    for step[0] in range(40):
        if step[0] < 3 or rng.random() < 0.3:
            prompt = [rng.randrange(3, 120) for _ in range(rng.randint(2, 30))]
            eng.add_request(f"r{step[0]}", prompt, SamplingParams(max_tokens=rng.randint(2, 14), temperature=0,
                                                                  ignore_eos=True))
        with dispatch.use_fused(True if step[0] % 4 == 0 else None):  # every 4th step: the interpreter is slow
            eng.step()
    assert eng.runner.graphs.replays > 5  # decode-only steps took the static path
    assert {n for n, _ in first_seen} == set(kernels)
    late = sorted((n, at) for (n, _), at in first_seen.items() if at >= 10)
    assert not late, f"new JIT keys after the warm-up steps: {late}"
    per_kernel = {n: sum(1 for m, _ in first_seen if m == n) for n in kernels}
    assert all(per_kernel[n] == 1 for n in attention), per_kernel
    assert per_kernel["_add_rmsnorm_kernel"] <= 3  # call sites: with / without residual, per-head q/k rows


def test_fp32_check_uses_ieee_dots(monkeypatch):  # type: ignore[no-untyped-def]
    """On Hopper, tl.dot on float32 inputs defaults to TF32. Emulated here (the interpreter's dot
    rounds both inputs to TF32 when asked for it, as the tensor cores do), the prefill error is
    ~1e-3 against float64 with the engine's default; the kernel checks ask for IEEE dots and stay at
    float32 rounding."""
    from triton._C.libtriton import ir
    from triton.runtime import interpreter

    real = interpreter.InterpreterBuilder.create_dot

    def tf32_dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # type: ignore[no-untyped-def]
        if input_precision == ir.INPUT_PRECISION.TF32 and a.data.dtype == "float32":
            a = interpreter.TensorHandle(interpreter._round_f32_to_tf32(a.data), a.dtype.scalar)
            b = interpreter.TensorHandle(interpreter._round_f32_to_tf32(b.data), b.dtype.scalar)
        return real(self, a, b, d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", tf32_dot)
    tf32 = check_kernels("cpu", torch.float32, d=32, cases=[0], fp32_dot="tf32")[0]
    ieee = check_kernels("cpu", torch.float32, d=32, cases=[0])[0]
    assert tf32["triton_err"] > 3e-4  # what the GPU's default would give the check
    assert ieee["triton_err"] < 1e-5
    # the engine's backend computes a float32 model as torch's float32 matmuls do (IEEE unless
    # torch.set_float32_matmul_precision allows TF32): its default was TF32, the ~1e-3 above
    engine = check_kernels("cpu", torch.float32, d=32, cases=[0], backend=TritonAttention())[0]
    assert engine["triton_err"] < 1e-5
    torch.set_float32_matmul_precision("high")
    try:
        assert TritonAttention().fp32_dot == "tf32"
    finally:
        torch.set_float32_matmul_precision("highest")
