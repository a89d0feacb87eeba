"""Triton kernels under TRITON_INTERPRET=1 against the torch reference and float64 math.

Fresh random inputs; GQA ratios 1/2/4/8; block sizes 16 and 32; ragged lengths; prefixes ending
mid-block; sliding windows; outputs poisoned with NaN before the run so unwritten elements fail.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from lmserve.attention.backend import AttentionMetadata  # noqa: E402
from lmserve.attention.torch_ref import TorchAttention  # noqa: E402
from lmserve.attention.triton_attn import TritonAttention, store_kv  # noqa: E402


def make_step(ctx_lens: list[int], q_lens: list[int], bs: int, hkv: int, d: int, seed: int):
    """A random paged cache holding each sequence's earlier context, and the step's metadata."""
    g = torch.Generator().manual_seed(seed)
    pages = [-(-c // bs) for c in ctx_lens]
    total = sum(pages) + 3
    perm = torch.randperm(total, generator=g).tolist()  # scattered physical blocks
    tables, k = [], 0
    for p in pages:
        tables.append(perm[k:k + p])
        k += p
    width = max(pages)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
    slots, qsl, pos = [], [0], []
    for i, (c, n) in enumerate(zip(ctx_lens, q_lens)):
        for p in range(c - n, c):
            slots.append(tables[i][p // bs] * bs + p % bs)
            pos.append(p)
        qsl.append(qsl[-1] + n)
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(qsl),
                             seq_lens=torch.tensor(ctx_lens), block_tables=bt, positions=torch.tensor(pos),
                             block_size=bs, query_lens_host=list(q_lens), seq_lens_host=list(ctx_lens))
    cache = torch.randn(2, total * bs, hkv, d, generator=g)  # earlier context: random K/V
    return meta, cache, tables


def float64_attention(q, cache, meta, tables, scale, window):  # type: ignore[no-untyped-def]
    """Dense float64 attention, sequence by sequence, straight from the cache contents."""
    out = torch.empty_like(q, dtype=torch.float64)
    h, hkv = q.shape[1], cache.shape[2]
    for i, (c, n) in enumerate(zip(meta.seq_lens_host, meta.query_lens_host)):
        slots = torch.tensor([tables[i][p // meta.block_size] * meta.block_size + p % meta.block_size
                              for p in range(c)])
        k = cache[0, slots].double().repeat_interleave(h // hkv, dim=1)  # (c, H, d)
        v = cache[1, slots].double().repeat_interleave(h // hkv, dim=1)
        s0 = int(meta.query_start_loc[i])
        for t in range(n):
            qp = c - n + t
            allowed = torch.arange(c) <= qp
            if window is not None:
                allowed &= torch.arange(c) > qp - window
            sc = torch.einsum("hd,khd->hk", q[s0 + t].double(), k) * scale
            sc[:, ~allowed] = float("-inf")
            out[s0 + t] = torch.einsum("hk,khd->hd", sc.softmax(-1), v)
    return out


CASES = [
    # ctx lens, new-token lens (1 = decode), GQA group, block size, window
    ([37, 5, 64, 17], [37, 5, 3, 1], 1, 16, None),
    ([50, 33, 100], [1, 1, 1], 2, 16, None),
    ([70, 20, 45], [12, 20, 1], 4, 32, None),
    ([129, 40], [1, 9], 8, 16, None),
    ([90, 61, 33], [1, 30, 7], 2, 16, 24),
    ([200, 64], [1, 1], 4, 32, 50),
]


@pytest.mark.parametrize("ctx,qlens,group,bs,window", CASES)
def test_attention_kernels(ctx, qlens, group, bs, window):  # type: ignore[no-untyped-def]
    hkv, d = 2, 32
    h = hkv * group
    seed = hash((tuple(ctx), group, bs)) % 10000
    meta, cache, tables = make_step(ctx, qlens, bs, hkv, d, seed)
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
    meta, cache, _ = make_step([40, 3, 18], [40, 1, 5], 16, 2, 32, seed=7)
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
