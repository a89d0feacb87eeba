"""The CPU fused ops (layers/csrc/fused.c) against the torch code they replace, and the model using
them: greedy tokens equal to the unfused eager path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lmserve.layers import cpu_fused, cpu_native, dispatch
from lmserve.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="no C compiler to build the CPU kernels")


@pytest.mark.parametrize("rows, d", [(1, 576), (3, 576), (37, 576), (120, 576), (5, 100), (4, 7)])
def test_add_rmsnorm(rows, d):  # type: ignore[no-untyped-def]
    """Against float64; rows past 64k elements (threads), widths with a tail past the 16 lanes (100)
    or only a tail (7); each row's bits the same alone as in the batch (deterministic mode)."""
    g = torch.Generator().manual_seed(rows)
    x, r, w = torch.randn(rows, d, generator=g), torch.randn(rows, d, generator=g), torch.randn(d, generator=g)
    out, new_res = cpu_fused.add_rmsnorm(x, r, w, 1e-5)
    h = (x.double() + r.double())
    want = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    assert torch.allclose(new_res.double(), h, atol=1e-6) and (out.double() - want).abs().max() < 1e-5
    alone, none = cpu_fused.add_rmsnorm(x, None, w, 1e-5)
    assert none is None and torch.allclose(alone, F.rms_norm(x, (d,), w, 1e-5), atol=1e-5)
    for i in (0, rows - 1):
        one, _ = cpu_fused.add_rmsnorm(x[i:i + 1], r[i:i + 1], w, 1e-5)
        assert torch.equal(one[0], out[i])


def test_argmax_is_torchs():
    """Greedy sampling's argmax (the C loop) against torch.argmax: the first of equal maxima, a NaN the
    largest (its first), rows of -inf, -0.0 beside 0.0, rows of a wider tensor (a stride), rows enough
    for threads, no rows; non-float32 rows take torch's own."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(12, 49152, generator=g)
    x[1, [5, 700, 40000]] = 9.0  # three equal maxima
    x[2, 30] = float("nan")
    x[3, [100, 200]] = float("nan")
    x[3, 50] = 99.0  # a larger value before the first NaN
    x[4] = float("-inf")
    x[5] = 0.0
    x[5, 10] = -0.0
    x[6, -1] = 50.0  # the last position
    x[7, 0] = float("inf")
    x[7, 9] = float("inf")
    x[8, :2] = torch.tensor([-0.0, 0.0])  # a row of zeros that starts with -0.0
    x[8, 2:] = -1.0
    x[9, 995] = 60.0  # in the last, partial chunk of 16 lanes of the 1000-wide rows below
    for rows in (x, x[:, :1000], x[:1], x[:0], x[:, :1]):
        assert torch.equal(cpu_fused.argmax(rows), rows.argmax(dim=-1)), rows.shape
    wide = torch.randn(6, 50000, generator=g)
    assert torch.equal(cpu_fused.argmax(wide[:, 17:49169]), wide[:, 17:49169].argmax(dim=-1))  # stride 50000
    half = x[:3].to(torch.bfloat16)
    assert torch.equal(cpu_fused.argmax(half), half.argmax(dim=-1))


@pytest.mark.parametrize("width", [1536, 300, 7])  # whole chunks of 256, a partial last chunk, one short chunk
def test_silu_and_mul(width):  # type: ignore[no-untyped-def]
    gu = torch.randn(5, 2 * width)
    assert torch.allclose(cpu_fused.silu_and_mul(gu), F.silu(gu[:, :width]) * gu[:, width:], atol=1e-6)
    assert torch.allclose(cpu_fused.gelu_tanh_and_mul(gu), F.gelu(gu[:, :width], approximate="tanh") * gu[:, width:],
                          atol=1e-6)


def test_silu_and_mul_over_the_whole_float_range_against_float64():
    """The kernel's own exp (csrc/vmath.h, vectorised): relative error near float32's, from where
    exp(-g) overflows to where it underflows."""
    gate = torch.cat([torch.linspace(-100, 100, 4001), torch.randn(95) * 3])  # (4096,)
    gu = torch.stack([torch.cat([gate, torch.ones_like(gate)]), torch.cat([gate, -2 * torch.ones_like(gate)])])
    got = cpu_fused.silu_and_mul(gu).double()  # (2, 4096)
    g = gate.double()
    want = torch.stack([g * torch.sigmoid(g), -2 * g * torch.sigmoid(g)])
    assert ((got - want).abs() <= 4e-7 * want.abs() + 1e-30).all()


def test_rotary_in_place_on_a_strided_view():
    rot = RotaryEmbedding(64, 512, 10000.0)
    pos = torch.tensor([0, 7, 300])
    qkv = torch.randn(3, (9 + 3 + 3) * 64)
    q, k = qkv[:, :9 * 64].view(3, 9, 64), qkv[:, 9 * 64:12 * 64].view(3, 3, 64)  # views of one buffer
    want_q, want_k = rot(pos, q.clone(), k.clone())
    cos, sin = rot.lookup(pos)
    cpu_fused.rotary_(q, cos.squeeze(1), sin.squeeze(1))
    cpu_fused.rotary_(k, cos.squeeze(1), sin.squeeze(1))
    assert torch.allclose(q, want_q, atol=1e-5) and torch.allclose(k, want_k, atol=1e-5)


def test_dispatch_hands_float32_cpu_tensors_our_module():
    assert dispatch.fused_ops(torch.zeros(2, dtype=torch.float32)) is cpu_fused
    assert dispatch.fused_ops(torch.zeros(2, dtype=torch.bfloat16)) is None
    with dispatch.use_fused(False):
        assert dispatch.fused_ops(torch.zeros(2)) is None


@pytest.mark.parametrize("family", ["llama", "qwen3"])  # qwen3: q/k norms, rotary per tensor; llama: q and k at once
def test_model_greedy_equals_the_unfused_path(tiny_models, family):  # type: ignore[no-untyped-def]
    from lmserve import LLM, SamplingParams
    path = tiny_models[family][0]
    prompts = [[5, 9, 2, 7, 1, 3], [4, 4, 8]]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    llm = LLM(str(path), kv_cache_memory="16MiB")
    fast = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    with dispatch.use_fused(False):
        ref = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert fast == ref


def test_gelu_tanh_and_mul_against_float64():
    """GeGLU (Gemma's MLP) in C: tanh through our exp; against float64 over a wide range."""
    gate = torch.cat([torch.linspace(-30, 30, 3001), torch.randn(1095) * 2])  # (4096,)
    gu = torch.stack([torch.cat([gate, torch.ones_like(gate)]), torch.cat([gate, 0.5 * torch.ones_like(gate)])])
    got = cpu_fused.gelu_tanh_and_mul(gu).double()  # (2, 4096)
    want = F.gelu(gate.double(), approximate="tanh")
    assert ((got - torch.stack([want, 0.5 * want])).abs() <= 1e-6 * want.abs() + 1e-7).all()
