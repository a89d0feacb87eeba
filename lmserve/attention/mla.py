"""Multi-head latent attention (DeepSeek-V2 / V3) over a paged latent cache: the torch reference.

Per token and layer the cache holds one row of kv_lora_rank + qk_rope_head_dim elements: the
compressed latent c_kv (after kv_a_layernorm) and the decoupled rope key k_pe (already rotated),
shared by every head. That is all MLA caches; `latent_bytes_per_token` says how little.

Per head h the up-projections are W_UK[h] (nope, L) and W_UV[h] (v, L) (kv_b_proj's rows). Two
equal ways to attend (tests/test_mla.py holds them to a float64 oracle):

- expanded (prefill): k_nope[h] = c_kv W_UK[h]^T, v[h] = c_kv W_UV[h]^T, then ordinary attention with
  q = [q_nope, q_pe] and k = [k_nope, k_pe]; per-head K / V exist only for the step.
- absorbed (decode): W_UK folded into the query, q_lat[h] = q_nope[h] W_UK[h] (L wide), so
  score[h, t] = q_lat[h] . c_kv[t] + q_pe[h] . k_pe[t]; the weighted sum stays in the latent,
  o_lat[h] = sum_t p[h, t] c_kv[t], and W_UV is applied after: o[h] = o_lat[h] W_UV[h]^T. Per-head K
  / V are never built: each step reads L + R numbers a cached token instead of H (nope + R + v).
"""

from __future__ import annotations

import torch

from lmserve.attention.backend import AttentionMetadata


def latent_bytes_per_token(num_layers: int, kv_lora_rank: int, qk_rope_head_dim: int, dtype_bytes: int) -> int:
    """What MLA caches a token across all layers."""
    return num_layers * (kv_lora_rank + qk_rope_head_dim) * dtype_bytes


def store(cache: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor, slots: torch.Tensor) -> None:
    """Write the step's latents: cache (S, L + R), c_kv (N, L), k_pe (N, R), slots (N,)."""
    cache.index_copy_(0, slots, torch.cat([c_kv, k_pe], dim=-1).to(cache.dtype))


def _context(cache: torch.Tensor, meta: AttentionMetadata, seq: int, length: int) -> torch.Tensor:
    """The first `length` cached rows of sequence `seq`: (length, L + R)."""
    j = torch.arange(length, device=cache.device)
    slots = meta.block_tables[seq, j // meta.block_size] * meta.block_size + j % meta.block_size
    return cache.index_select(0, slots)


def mla_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
                  w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float, absorbed: bool | None = None,
                  token_at_a_time: bool = False) -> torch.Tensor:
    """Attention of the step's tokens over their sequences' cached latents (the step's own rows stored
    first, `store`): q_nope (N, H, nope), q_pe (N, H, R), cache (S, L + R), w_uk (H, nope, L), w_uv
    (H, v, L) -> (N, H, v). absorbed None: the absorbed form for one-token (decode) sequences, the
    expanded form for longer chunks; True / False force one form for all. token_at_a_time
    (deterministic mode): every token alone in the absorbed form, as a decode step computes it, so a
    token's result does not depend on how its sequence was chunked."""
    if token_at_a_time:
        return _token_at_a_time(q_nope, q_pe, cache, meta, w_uk, w_uv, scale)
    L = w_uk.shape[2]
    out = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], w_uv.shape[1])  # (N, H, v)
    starts = meta.query_starts_host
    for i, (n, total) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
        a = starts[i]
        ctx = _context(cache, meta, i, total).to(q_nope.dtype)  # (T, L + R)
        pos = torch.arange(total - n, total, device=ctx.device)  # the new tokens' positions
        mask = torch.arange(total, device=ctx.device)[None, :] <= pos[:, None]  # (n, T) causal
        form = absorbed_attention if (absorbed if absorbed is not None else n == 1) else expanded_attention
        out[a:a + n] = form(q_nope[a:a + n], q_pe[a:a + n], ctx[:, :L], ctx[:, L:], mask, w_uk, w_uv, scale)
    return out


def _token_at_a_time(q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
                     w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float) -> torch.Tensor:
    """mla_attention with each token alone: (N, H, nope), (N, H, R) -> (N, H, v)."""
    L = w_uk.shape[2]
    out = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], w_uv.shape[1])  # (N, H, v)
    for i, (n, total) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
        a = meta.query_starts_host[i]
        ctx = _context(cache, meta, i, total).to(q_nope.dtype)  # (T, L + R)
        for j in range(n):
            t = total - n + j + 1  # the token sees positions [0, t)
            mask = torch.ones(1, t, dtype=torch.bool, device=ctx.device)  # (1, t)
            out[a + j:a + j + 1] = absorbed_attention(q_nope[a + j:a + j + 1], q_pe[a + j:a + j + 1], ctx[:t, :L],
                                                      ctx[:t, L:], mask, w_uk, w_uv, scale)
    return out


def absorbed_attention(qn: torch.Tensor, qp: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                       mask: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float) -> torch.Tensor:
    """One sequence, in the latent: qn (n, H, nope), qp (n, H, R), c_kv (T, L), k_pe (T, R), mask (n, T)
    -> (n, H, v). W_UK goes into the query and W_UV after the weighted sum: no per-head K / V."""
    q_lat = torch.einsum("nhd,hdl->nhl", qn, w_uk)  # (n, H, L)
    scores = (torch.einsum("nhl,tl->nht", q_lat, c_kv) + torch.einsum("nhr,tr->nht", qp, k_pe)) * scale
    p = torch.softmax(scores.masked_fill(~mask[:, None, :], float("-inf")), dim=-1)  # (n, H, T)
    o_lat = torch.einsum("nht,tl->nhl", p, c_kv)  # (n, H, L)
    return torch.einsum("nhl,hvl->nhv", o_lat, w_uv)


def expanded_attention(qn: torch.Tensor, qp: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                       mask: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float) -> torch.Tensor:
    """One sequence with per-head K / V expanded from the latents for this step (prefill chunks): the
    arguments and result of `absorbed_attention`."""
    k_nope = torch.einsum("tl,hdl->thd", c_kv, w_uk)  # (T, H, nope)
    v = torch.einsum("tl,hvl->thv", c_kv, w_uv)  # (T, H, v)
    scores = (torch.einsum("nhd,thd->nht", qn, k_nope) + torch.einsum("nhr,tr->nht", qp, k_pe)) * scale
    p = torch.softmax(scores.masked_fill(~mask[:, None, :], float("-inf")), dim=-1)  # (n, H, T)
    return torch.einsum("nht,thv->nhv", p, v)
