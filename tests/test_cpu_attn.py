"""The CPU attention backend (decode through our C kernel reading the paged cache in place) against
the float64 oracle on the kernel cases (ragged, GQA groups 1-8, block sizes 16 / 32, windows, prefixes
ending mid-block), fp32 and bf16 caches, every code path."""

from __future__ import annotations

import pytest
import torch

from lmserve.attention.cpu_attn import CpuAttention
from lmserve.attention.registry import get_backend
from lmserve.attention.testing import KERNEL_CASES, case_inputs, float64_attention
from lmserve.attention.torch_ref import TorchAttention
from lmserve.layers import cpu_native

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="no C compiler to build the CPU kernels")


@pytest.mark.parametrize("idx", range(len(KERNEL_CASES)))
@pytest.mark.parametrize("isa", ["avx512", "avx2", "c"])
def test_cpu_backend_matches_float64(idx, isa, monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("LMSERVE_ISA", isa)
    window = KERNEL_CASES[idx][4]
    meta, cache, tables, q, k, v = case_inputs(idx, hkv=2, d=64, device="cpu", dtype=torch.float32, seed=7)
    scale = 64 ** -0.5
    ref_cache, cpu_cache = cache.clone(), cache.clone()
    ref = TorchAttention().forward(q, k, v, ref_cache, meta, scale, window)
    got = CpuAttention().forward(q, k, v, cpu_cache, meta, scale, window)
    exact = float64_attention(q, ref_cache, meta, tables, scale, window)
    assert torch.equal(cpu_cache, ref_cache)  # the same store
    assert (got.double() - exact).abs().max() < 2e-5
    assert (ref.double() - exact).abs().max() < 2e-5


@pytest.mark.parametrize("idx", [1, 3, 5])  # decode-only cases, one with a window
@pytest.mark.parametrize("isa", ["avx512", "avx2", "c"])
def test_bf16_cache_is_read_in_place(idx, isa, monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("LMSERVE_ISA", isa)
    window = KERNEL_CASES[idx][4]
    meta, cache, tables, q, k, v = case_inputs(idx, hkv=2, d=64, device="cpu", dtype=torch.bfloat16, seed=3)
    scale = 64 ** -0.5
    got = CpuAttention().forward(q, k, v, cache, meta, scale, window)  # bf16 q / out, the cache in bf16
    exact = float64_attention(q, cache, meta, tables, scale, window)  # from the same bf16 values
    assert got.dtype == torch.bfloat16
    assert (got.double() - exact).abs().max() < 2e-2  # the output's own bf16 rounding (outputs ~1)


def test_the_cpu_backend_is_the_cpu_default():
    assert type(get_backend("auto", "cpu")) is CpuAttention
    assert type(get_backend("torch", "cpu")) is TorchAttention
