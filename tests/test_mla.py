"""Multi-head latent attention over the paged latent cache (attention/mla.py): the absorbed form (W_UK
folded into the query, W_UV after attention, per-head K / V never built) equals the expanded form and
a dense float64 oracle, on ragged steps of prefill chunks and decodes; the planner's MLA bytes."""

from __future__ import annotations

import pytest
import torch

from lmserve.attention import mla
from lmserve.attention.testing import random_step

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
        rows = cache[[tables[t][j // 4] * 4 + j % 4 for j in range(total)]].double()  # (T, L + R)
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
