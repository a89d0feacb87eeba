"""The CPU attention backend (decode through our C kernel reading the paged cache in place) against
the float64 oracle on the kernel cases (ragged, GQA groups 1-8, block sizes 16 / 32, windows, prefixes
ending mid-block), fp32, bf16 and int8 caches, every code path."""

from __future__ import annotations

import pytest
import torch

from lmserve.attention.cpu_attn import CpuAttention
from lmserve.attention.registry import get_backend
from lmserve.attention.testing import KERNEL_CASES, case_inputs, float64_attention
from lmserve.attention.torch_ref import TorchAttention
from lmserve.kv.cache import QuantizedKV, dequantize
from lmserve.layers import cpu_native

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="no C compiler to build the CPU kernels")


def skip_avx512_without_it(isa: str) -> None:
    """Skip a case of the AVX-512 attention loop on a CPU without AVX-512 (LMSERVE_ISA only caps the
    path: such a CPU would quietly run the AVX2 loop in its place)."""
    if isa == "avx512" and cpu_native.attn_simd() != 2:
        pytest.skip("this CPU has no AVX-512: that loop does not run")


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


@pytest.mark.parametrize("idx", range(len(KERNEL_CASES)))
@pytest.mark.parametrize("d", [20, 264, 72, 128, 80, 48])
@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_head_dims_of_every_loop(idx, d, isa, monkeypatch):  # type: ignore[no-untyped-def]
    """Head dims beside 64 against the same oracle: the generic loop (20: not a multiple of 8; 264: over
    256), the AVX2 loop by chunk count with an odd number of 8-lane chunks (72: the value pass's last
    chunk alone; under avx512 too, 72 not being a multiple of 16) and compiled for 128; the AVX-512 loop
    compiled for 128, and by chunk count: 80 (a value pass of 4 chunks, then 1), 48 (3)."""
    monkeypatch.setenv("LMSERVE_ISA", isa)
    skip_avx512_without_it(isa)
    window = KERNEL_CASES[idx][4]
    meta, cache, tables, q, k, v = case_inputs(idx, hkv=2, d=d, device="cpu", dtype=torch.float32, seed=11)
    scale = d ** -0.5
    ref_cache = cache.clone()
    TorchAttention().forward(q, k, v, ref_cache, meta, scale, window)
    got = CpuAttention().forward(q, k, v, cache, meta, scale, window)
    exact = float64_attention(q, ref_cache, meta, tables, scale, window)
    assert (got.double() - exact).abs().max() < 2e-5


@pytest.mark.parametrize("idx", range(len(KERNEL_CASES)))
@pytest.mark.parametrize("isa, d", [("avx512", 64), ("avx2", 64), ("c", 64), ("avx2", 128), ("avx2", 72), ("avx2", 20),
                                    ("avx512", 128), ("avx512", 80), ("avx512", 48)])
def test_int8_cache_is_stored_and_read_in_place(idx, isa, d, monkeypatch):  # type: ignore[no-untyped-def]
    """kv_cache_dtype int8: the kernel quantizes the step's K / V into the QuantizedKV exactly as
    QuantizedKV.store does (the same bytes and scales), and attends over the cache's dequantized
    contents as the float64 oracle does. d = 64, 128: a scale per 32 channels; 72: one per head, an odd
    number of 8-lane chunks; 20: the generic loop; under avx512, 48 and 80: one scale per head, 3 and 5
    chunks of 16 lanes."""
    monkeypatch.setenv("LMSERVE_ISA", isa)
    skip_avx512_without_it(isa)
    window = KERNEL_CASES[idx][4]
    meta, cache, tables, q, k, v = case_inputs(idx, hkv=2, d=d, device="cpu", dtype=torch.float32, seed=17)
    scale = d ** -0.5
    ref_cache, cpu_cache = QuantizedKV.from_float(cache, torch.int8), QuantizedKV.from_float(cache, torch.int8)
    TorchAttention().forward(q, k, v, ref_cache, meta, scale, window)  # stores with QuantizedKV.store
    got = CpuAttention().forward(q, k, v, cpu_cache, meta, scale, window)
    assert torch.equal(cpu_cache.data, ref_cache.data) and torch.equal(cpu_cache.scale, ref_cache.scale)
    dense = dequantize(ref_cache.data, ref_cache.scale)  # (2, slots, Hkv, d) float32
    exact = float64_attention(q, dense, meta, tables, scale, window)
    assert (got.double() - exact).abs().max() < 2e-5


@pytest.mark.parametrize("isa", ["avx512", "avx2", "c"])
def test_a_non_finite_kv_value_reads_back_nan_from_either_store(isa, monkeypatch):  # type: ignore[no-untyped-def]
    """A NaN / inf in a step's K or V: the kernel's store gives its group the scale QuantizedKV.store
    gives it (torch's amax keeps a NaN; the C loop's compare skipped it: the NaN read back as 0.0 and the
    attention came out finite), so the group reads back NaN from either store."""
    monkeypatch.setenv("LMSERVE_ISA", isa)
    meta, cache, tables, q, k, v = case_inputs(1, hkv=2, d=64, device="cpu", dtype=torch.float32, seed=23)
    k, v = k.clone(), v.clone()
    k[0, 0, 3] = float("nan")  # (tokens, Hkv, d): channel 3 of head 0, group 0
    v[0, 1, 40] = float("inf")  # head 1, group 1
    ref_cache, cpu_cache = QuantizedKV.from_float(cache, torch.int8), QuantizedKV.from_float(cache, torch.int8)
    TorchAttention().forward(q, k, v, ref_cache, meta, 64 ** -0.5, None)
    got = CpuAttention().forward(q, k, v, cpu_cache, meta, 64 ** -0.5, None)
    assert torch.equal(cpu_cache.scale.isnan(), ref_cache.scale.isnan()) and ref_cache.scale.isnan().any()
    same = ~ref_cache.scale.isnan()
    assert torch.equal(cpu_cache.scale[same], ref_cache.scale[same])
    a, b = dequantize(cpu_cache.data, cpu_cache.scale), dequantize(ref_cache.data, ref_cache.scale)
    assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
    assert got[0].isnan().any()  # the sequence that attends to the NaN key says so


@pytest.mark.parametrize("idx", [1, 3])  # decode rows, and rows of a few tokens: the kernel's steps
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_models_kv_goes_into_an_int8_cache(idx, dtype):  # type: ignore[no-untyped-def]
    """A bf16 / fp16 model with kv_cache_dtype int8: the step's K / V reach the kernel in the model's
    dtype and are stored as QuantizedKV.store stores them (before, the kernel refused them: every
    request of that configuration ended after its first token with finish_reason error)."""
    meta, cache, tables, q, k, v = case_inputs(idx, hkv=2, d=64, device="cpu", dtype=torch.float32, seed=5)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    ref_cache, cpu_cache = QuantizedKV.from_float(cache, torch.int8), QuantizedKV.from_float(cache, torch.int8)
    want = TorchAttention().forward(q, k, v, ref_cache, meta, 0.125, None)
    got = CpuAttention().forward(q, k, v, cpu_cache, meta, 0.125, None)
    assert got.dtype == dtype
    assert torch.equal(cpu_cache.data, ref_cache.data) and torch.equal(cpu_cache.scale, ref_cache.scale)
    assert (got.float() - want.float()).abs().max() < 2e-2  # both in the model's dtype


@pytest.mark.parametrize("isa", ["avx512", "avx2", "c"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_a_sequence_gets_the_same_bits_alone_and_in_a_batch(isa, dtype, monkeypatch):  # type: ignore[no-untyped-def]
    """The kernel splits a batch into one task per sequence and one per (sequence, kv head) for a
    single row: the same sums in the same order either way, so a row's output does not depend on
    what else is in the step (deterministic mode relies on it)."""
    monkeypatch.setenv("LMSERVE_ISA", isa)
    g = torch.Generator().manual_seed(21)
    bs, hkv, h, d, lens = 16, 3, 9, 64, [37, 100, 5, 64, 17, 80, 33, 48]
    tables = torch.randperm(60, generator=g)[:8 * 7].view(8, 7)  # (B, T) distinct blocks
    cache = torch.randn(2, 60 * bs, hkv, d, generator=g)  # (2, slots, Hkv, d)
    cache = QuantizedKV.from_float(cache, dtype) if dtype == torch.int8 else cache.to(dtype)
    q = torch.randn(8, h, d, generator=g)  # (B, H, d)
    seq_lens = torch.tensor(lens)
    together = cpu_native.paged_decode_attention(q, cache, tables, seq_lens, bs, 0.125, None)  # (B, H, d)
    for b in range(8):
        alone = cpu_native.paged_decode_attention(q[b:b + 1], cache, tables[b:b + 1], seq_lens[b:b + 1], bs, 0.125,
                                                  None)
        assert torch.equal(alone[0], together[b])


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


@pytest.mark.parametrize("qlens, ctx, kernel", [([1, 9], [40, 33], True), ([4, 16, 2], [60, 45, 9], True),
                                                ([1, 17], [40, 33], False)])
def test_steps_of_few_tokens_a_sequence_are_kernel_rows(qlens, ctx, kernel, monkeypatch):  # type: ignore[no-untyped-def]
    """A verification-like step (up to ROWS_PER_SEQ new tokens a sequence): every token one row of the
    kernel, causal within the step, windows too; longer chunks take the reference."""
    from lmserve.attention.testing import random_step
    rows: list[int] = []
    real = cpu_native.paged_decode_attention
    monkeypatch.setattr(cpu_native, "paged_decode_attention", lambda q, *a, **kw: rows.append(q.shape[0]) or real(q, *a, **kw))
    for window in (None, 12):
        meta, cache, tables = random_step(ctx, qlens, 16, 2, 64, seed=11)
        g = torch.Generator().manual_seed(5)
        q, k, v = (torch.randn(sum(qlens), h, 64, generator=g) for h in (6, 2, 2))
        ref_cache = cache.clone()
        TorchAttention().forward(q, k, v, ref_cache, meta, 0.125, window)
        got = CpuAttention().forward(q, k, v, cache, meta, 0.125, window)
        assert torch.equal(cache, ref_cache)
        assert (got.double() - float64_attention(q, cache, meta, tables, 0.125, window)).abs().max() < 2e-5
    assert rows == ([sum(qlens)] * 2 if kernel else [1, 1])  # (the reference's decode rows go through it too)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("h, hkv, d", [(9, 3, 64), (4, 4, 72), (8, 2, 128), (6, 2, 80)])
@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_a_verifications_rows_get_the_same_bits_together_and_alone(  # type: ignore[no-untyped-def]
        dtype, h, hkv, d, isa, monkeypatch):
    """The vector loops (AVX-512, AVX2) attend the rows of one sequence that a verification step brings
    (each one key longer, the same blocks) together, reading each key once for all of them: every row's
    output is bit for bit what the row gets alone, the (row, head) triples of the value pass spanning rows
    included; runs longer than ROWS_PER_SEQ split; rows of other sequences, rows one key longer whose
    blocks differ from the run's first row's (further on too), and windows are not joined."""
    monkeypatch.setenv("LMSERVE_ISA", isa)
    if cpu_native.attn_simd() != {"avx512": 2, "avx2": 1}[isa]:
        pytest.skip(f"this CPU has no {isa}: that loop does not run")
    g = torch.Generator().manual_seed(5)
    bs = 16
    cache = torch.randn(2, 80 * bs, hkv, d, generator=g)  # (2, slots, Hkv, d)
    cache = QuantizedKV.from_float(cache, dtype) if dtype == torch.int8 else cache.to(dtype)
    blocks = torch.randperm(80, generator=g)
    # sequences (first row's keys, rows): a 5-row verification mid-block, a decode row, 3 rows over a block
    # edge, 18 rows (one run of 16 and one of 2), 2 rows right after it (one key longer: only their blocks
    # tell them apart)
    seqs, tables, lens, used = [(37, 5), (100, 1), (14, 3), (20, 18), (38, 2)], [], [], 0
    for first, rows in seqs:
        need = -(-(first + rows - 1) // bs)
        table = blocks[used:used + need]
        used += need
        for r in range(rows):
            tables.append(torch.nn.functional.pad(table, (0, 8 - need)))
            lens.append(first + r)
    # three rows whose blocks agree pairwise over the shorter row's blocks but not with the first row's:
    # 15 keys in block 70; then 16 and 17 keys in blocks 70, 71 (the first row's table says 70, 72)
    tables += [torch.tensor([70, 72] + [0] * 6), torch.tensor([70, 71] + [0] * 6), torch.tensor([70, 71] + [0] * 6)]
    lens += [15, 16, 17]
    tables_t, lens_t = torch.stack(tables), torch.tensor(lens)  # (B, 8), (B,)
    q = torch.randn(len(lens), h, d, generator=g)  # (B, H, d)
    for window in (None, 40):
        together = cpu_native.paged_decode_attention(q, cache, tables_t, lens_t, bs, 0.125, window)  # (B, H, d)
        for b in range(len(lens)):
            alone = cpu_native.paged_decode_attention(q[b:b + 1], cache, tables_t[b:b + 1], lens_t[b:b + 1], bs, 0.125,
                                                      window)
            assert torch.equal(alone[0].view(torch.int32), together[b].view(torch.int32)), (window, b)  # the bits
