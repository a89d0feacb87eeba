"""Fused Triton kernels (under TRITON_INTERPRET=1) against the torch code they replace."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from lmserve.layers.fused import add_rmsnorm, rotary_, silu_and_mul  # noqa: E402
from lmserve.layers.norm import RMSNorm  # noqa: E402
from lmserve.layers.rotary import RotaryEmbedding  # noqa: E402


# bf16: a few ulps (the interpreter emulates bf16 conversion by truncation, torch rounds to nearest)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 4e-2)])
@pytest.mark.parametrize("with_res", [False, True])
def test_add_rmsnorm(dtype, tol, with_res):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 96, generator=g).to(dtype)
    r = torch.randn(7, 96, generator=g).to(dtype)
    norm = RMSNorm(96, 1e-6)
    norm.weight.data = (torch.rand(96, generator=g) + 0.5)
    norm = norm.to(dtype)
    ref = norm(x, r) if with_res else norm(x)
    out, new_res = add_rmsnorm(x, r if with_res else None, norm.weight, 1e-6)
    if with_res:
        assert torch.allclose(out.float(), ref[0].float(), atol=tol, rtol=tol)
        assert torch.allclose(new_res.float(), ref[1].float(), atol=tol, rtol=tol)
    else:
        assert torch.allclose(out.float(), ref.float(), atol=tol, rtol=tol) and new_res is None


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_silu_and_mul(dtype, tol):  # type: ignore[no-untyped-def]
    x = torch.randn(5, 2 * 1500, generator=torch.Generator().manual_seed(1)).to(dtype)
    g, u = x.float().chunk(2, dim=-1)
    ref = torch.nn.functional.silu(g) * u  # float32 reference
    out = silu_and_mul(x)
    assert out.dtype == dtype and torch.allclose(out.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("d", [32, 64])
def test_rotary_in_place(d):  # type: ignore[no-untyped-def]
    rot = RotaryEmbedding(d, 256, 10000.0)
    pos = torch.tensor([0, 5, 17, 255, 3])
    q = torch.randn(5, 4, d)
    k = torch.randn(5, 2, d)
    rq, rk = rot(pos, q, k)
    cos, sin = rot.cos[pos], rot.sin[pos]
    q2, k2 = rotary_(q.clone(), cos, sin), rotary_(k.clone(), cos, sin)
    assert torch.allclose(q2, rq, atol=1e-5) and torch.allclose(k2, rk, atol=1e-5)


def test_model_with_fused_kernels_matches(tiny_models, monkeypatch):  # type: ignore[no-untyped-def]
    """The whole engine with every fused kernel switched on (as on CUDA) gives the same tokens, and
    every RMSNorm goes through the fused kernel: Qwen3's per-head q/k norms too ((N, heads, d), a
    strided view of the qkv output, as rows), which used to fall back to ~7 torch ops each."""
    from lmserve import LLM, SamplingParams
    from lmserve.layers import dispatch, fused
    path, _ = tiny_models["qwen3"]  # q/k norm + GQA: every fused path is exercised
    prompts = [[5, 17, 33, 9, 100, 3] * 3, [11, 12, 13]]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    ref_llm = LLM(str(path))
    ref = ref_llm.generate(prompts, params, use_tqdm=False)
    ref_logits = ref_llm.score(prompts[0])
    llm = LLM(str(path))
    widths: list[int] = []
    real = fused.add_rmsnorm

    def counting(x, residual, weight, eps):  # type: ignore[no-untyped-def]
        widths.append(x.shape[1])
        return real(x, residual, weight, eps)

    monkeypatch.setattr(fused, "add_rmsnorm", counting)
    with dispatch.use_fused(True):
        out = llm.generate(prompts, params, use_tqdm=False)
        widths.clear()
        logits = llm.score(prompts[0])  # one prefill: each norm runs once
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    assert (logits - ref_logits).abs().max() < 1e-4
    cfg = llm.engine.model_config
    # per layer: input + post-attention norm (hidden) and q + k norm (head_dim); then the final norm
    assert sorted(widths) == sorted([cfg.head_dim] * 2 * cfg.num_layers + [cfg.hidden_size] * (2 * cfg.num_layers + 1))


def test_qk_norm_fused_rows_match_torch():
    """RMSNorm over (N, heads, d) views, as Qwen3 calls it: the fused kernel on the rows it reshapes
    to gives the torch path's result, in the input's shape, with and without a residual."""
    from lmserve.layers import dispatch
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(5, (4 + 2 * 2) * 32, generator=g)  # (N, (H + 2 Hkv) d)
    q = qkv[:, :4 * 32].view(5, 4, 32)  # (N, H, d): strided, not contiguous
    norm = RMSNorm(32, 1e-6)
    norm.weight.data = torch.rand(32, generator=g) + 0.5
    ref = norm(q)
    r = torch.randn(5, 4, 32, generator=g)  # (N, H, d)
    ref_out, ref_res = norm(q, r)
    with dispatch.use_fused(True):
        out = norm(q)
        out_r, res = norm(q, r)
    assert out.shape == (5, 4, 32) and torch.allclose(out, ref, atol=1e-5)
    assert torch.allclose(out_r, ref_out, atol=1e-5) and torch.allclose(res, ref_res, atol=1e-6)
