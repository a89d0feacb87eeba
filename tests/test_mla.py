"""Multi-head latent attention over the paged latent cache (attention/mla.py): the absorbed form (W_UK
folded into the query, W_UV after attention, per-head K / V never built) equals the expanded form and
a dense float64 oracle, on ragged steps of prefill chunks and decodes; the planner's MLA bytes; the
Triton latent decode kernel (attention/triton_mla.py, under TRITON_INTERPRET=1) against both, split-KV
and CUDA-graph padding rows included."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton decode kernel on the CPU (read when triton.jit decorates)

import pytest  # noqa: E402
import torch  # noqa: E402

from lmserve.attention import mla  # noqa: E402
from lmserve.attention.testing import random_step  # noqa: E402

H, NOPE, R, V, L = 4, 16, 8, 12, 24  # heads, q/k nope dims, rope dims, value dims, kv_lora_rank


def _step(ctx: list[int], qlens: list[int], seed: int):  # type: ignore[no-untyped-def]
    meta, kv, tables = random_step(ctx, qlens, 4, 1, 8, seed=seed)
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(kv.shape[1], L + R, generator=g)  # (S, L + R): earlier context already cached
    n = sum(qlens)
    q_nope, q_pe = torch.randn(n, H, NOPE, generator=g), torch.randn(n, H, R, generator=g)
    c_kv, k_pe = torch.randn(n, L, generator=g), torch.randn(n, R, generator=g)
    mla.store(cache, c_kv, k_pe, meta.slot_mapping)
    w_uk, w_uv = torch.randn(H, NOPE, L, generator=g) * 0.3, torch.randn(H, V, L, generator=g) * 0.3
    return meta, cache, tables, q_nope, q_pe, w_uk, w_uv


def _oracle(meta, cache, tables, q_nope, q_pe, w_uk, w_uv, scale):  # type: ignore[no-untyped-def]
    """Dense float64 MLA, sequence by sequence, per-head K / V expanded from the cached latents."""
    out = torch.empty(q_nope.shape[0], H, V, dtype=torch.float64)
    a = 0
    for t, (total, n) in enumerate(zip(meta.seq_lens_host, meta.query_lens_host)):
        bs = meta.block_size
        rows = cache[[tables[t][j // bs] * bs + j % bs for j in range(total)]].double()  # (T, L + R)
        k = torch.cat([torch.einsum("tl,hdl->thd", rows[:, :L], w_uk.double()),
                       rows[:, None, L:].expand(total, H, R)], dim=-1)  # (T, H, nope + R)
        v = torch.einsum("tl,hvl->thv", rows[:, :L], w_uv.double())  # (T, H, v)
        for i in range(n):
            q = torch.cat([q_nope[a + i], q_pe[a + i]], dim=-1).double()  # (H, nope + R)
            s = torch.einsum("hd,thd->ht", q, k)[:, :total - n + i + 1] * scale
            out[a + i] = torch.einsum("ht,thv->hv", s.softmax(-1), v[:total - n + i + 1])
        a += n
    return out


@pytest.mark.parametrize("ctx, qlens", [([9, 30, 17], [9, 1, 5]), ([40, 12], [1, 1]), ([64], [20])])
def test_absorbed_equals_expanded_equals_float64(ctx, qlens):  # type: ignore[no-untyped-def]
    meta, cache, tables, q_nope, q_pe, w_uk, w_uv = _step(ctx, qlens, seed=len(ctx))
    scale = (NOPE + R) ** -0.5
    want = _oracle(meta, cache, tables, q_nope, q_pe, w_uk, w_uv, scale)
    for form in (True, False, None):
        got = mla.mla_attention(q_nope, q_pe, cache, meta, w_uk, w_uv, scale, absorbed=form)  # (N, H, v)
        assert (got.double() - want).abs().max() < 2e-5, form
    in64 = mla.mla_attention(q_nope.double(), q_pe.double(), cache.double(), meta, w_uk.double(), w_uv.double(),
                             scale, absorbed=True)
    assert (in64 - want).abs().max() < 1e-10  # the absorbed algebra is exact, not approximately so


def test_the_cache_holds_only_the_latent_and_the_rope_key():
    meta, cache, _, _, _, _, _ = _step([10], [3], seed=0)
    assert cache.shape[1] == L + R
    # DeepSeek-V3: 61 layers, kv_lora_rank 512, rope 64, bf16 -> 70,272 bytes a token (what `lmserve
    # plan` reports), against 61 x 128 heads x (192 + 128) x 2 for full MHA K / V
    from lmserve.plan import model_from_name
    v3 = mla.latent_bytes_per_token(61, 512, 64, 2)
    assert v3 == 70_272 == model_from_name("deepseek-v3").kv_elems_per_token * 2
    assert 61 * 128 * (192 + 128) * 2 / v3 > 50


def _triton_mla():  # type: ignore[no-untyped-def]
    """The Triton MLA module (under the interpreter on the CPU), or a skip where Triton is not installed."""
    pytest.importorskip("triton", reason="triton is not installed: the MLA decode kernel is not tested")
    from lmserve.attention import triton_mla
    return triton_mla


@pytest.mark.parametrize("ctx, bs, splits", [([9, 30, 17, 1], 4, 1), ([40, 70], 4, 8), ([33, 64, 5], 16, 4)])
def test_triton_decode_equals_the_reference(ctx, bs, splits):  # type: ignore[no-untyped-def]
    """The latent decode kernel (W_UK folded in before, W_UV applied after, as the model does) against
    the absorbed reference and the float64 oracle, split-KV included; outputs poisoned with NaN."""
    triton_mla = _triton_mla()
    meta, _, tables = random_step(ctx, [1] * len(ctx), bs, 1, 8, seed=sum(ctx))
    g = torch.Generator().manual_seed(bs)
    cache = torch.randn(meta.block_tables.max().item() * bs + bs, L + R, generator=g)  # (S, L + R)
    n = len(ctx)
    q_nope, q_pe = torch.randn(n, H, NOPE, generator=g), torch.randn(n, H, R, generator=g)
    c_kv, k_pe = torch.randn(n, L, generator=g), torch.randn(n, R, generator=g)
    w_uk, w_uv = torch.randn(H, NOPE, L, generator=g) * 0.3, torch.randn(H, V, L, generator=g) * 0.3
    scale = (NOPE + R) ** -0.5
    ref_cache, tri_cache = cache.clone(), torch.full_like(cache, float("nan"))
    tri_cache[:] = cache
    mla.store(ref_cache, c_kv, k_pe, meta.slot_mapping)
    triton_mla.store(tri_cache, c_kv, k_pe, meta.slot_mapping)
    assert torch.equal(tri_cache, ref_cache)
    q_lat = torch.einsum("nhd,hdl->nhl", q_nope, w_uk)  # (B, H, L)
    o_lat = triton_mla.decode(q_lat, q_pe, tri_cache, meta.block_tables, meta.seq_lens, scale, bs,
                              max_splits=splits, target_programs=64, keys=16)  # (B, H, L)
    got = torch.einsum("nhl,hvl->nhv", o_lat, w_uv)
    want = _oracle(meta, ref_cache, tables, q_nope, q_pe, w_uk, w_uv, scale)
    ref = mla.mla_attention(q_nope, q_pe, ref_cache, meta, w_uk, w_uv, scale, absorbed=True)
    assert not torch.isnan(o_lat).any()
    assert (got.double() - want).abs().max() < 2e-5 and (ref.double() - want).abs().max() < 2e-5


def test_triton_padding_rows_store_nothing_and_read_nothing():
    """A CUDA-graph batch's padding row (slot -1, context 0): the cache is untouched there, its output is zeros."""
    triton_mla = _triton_mla()
    meta, _, _ = random_step([12, 5], [1, 1], 4, 1, 8, seed=3)
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(32, L + R, generator=g)
    before = cache.clone()
    slots = torch.tensor([int(meta.slot_mapping[0]), -1])
    triton_mla.store(cache, torch.ones(2, L), torch.ones(2, R), slots)
    assert torch.equal(cache[slots[0]], torch.ones(L + R))
    mask = torch.ones(32, dtype=torch.bool)
    mask[slots[0]] = False
    assert torch.equal(cache[mask], before[mask])
    seq_lens = torch.tensor([12, 0])
    o = triton_mla.decode(torch.randn(2, H, L, generator=g), torch.randn(2, H, R, generator=g), cache,
                          meta.block_tables, seq_lens, 0.2, 4)
    assert torch.equal(o[1], torch.zeros(H, L)) and o[0].abs().sum() > 0
