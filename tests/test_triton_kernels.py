"""Triton kernels under TRITON_INTERPRET=1 against the torch reference and float64 math.

Fresh random inputs; GQA ratios 1/2/4/8; block sizes 16 and 32; ragged lengths; prefixes ending
mid-block; sliding windows; outputs poisoned with NaN before the run so unwritten elements fail.
In float32: the interpreter's tl.dot is wrong for bfloat16 inputs (a plain 16x16 dot is off by
~1e10), so the bf16 runs of these same cases are in scripts/gpu_check.py, compiled for the GPU.
"""

from __future__ import annotations

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
    logits_t = tri_llm.engine.score(prompts[2])
    logits_r = LLM(str(path), attention_backend="torch").engine.score(prompts[2])
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
