"""Triton decode for multi-head latent attention (MLA's absorbed form) over the paged latent cache.

For steps of one new token a sequence (row b = sequence b, CUDA-graph batches included): the query
already absorbed W_UK, q_lat (B, H, L), with its rope part q_pe (B, H, R), against the cache rows
(S, L + R) = [c_kv, k_pe] of each sequence's blocks: score = (q_lat . c_kv + q_pe . k_pe) * scale,
o_lat = softmax(score) @ c_kv, (B, H, L); W_UV is applied outside, in torch (attention/mla.py has the
algebra and the reference). A program takes one sequence, BLOCK_H heads and one split of its pages:
every latent tile it loads serves all BLOCK_H heads (the cache row is shared by the heads: MLA's point),
and the score and output products are tl.dot. Splits of a sequence's pages (split-KV, a count taken
from tensor shapes only) are combined by their log-sum-exp in a second kernel.

A padding row of a CUDA-graph batch (slot -1, context 0) stores nothing and outputs zeros. Tested
under TRITON_INTERPRET=1 in float32 (tests/test_mla.py: the interpreter's tl.dot is wrong for
bfloat16), and compiled for the GPU in bf16 by scripts/gpu_check.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmserve.attention.triton_attn import grid_target


@triton.jit(do_not_specialize=["slot_ptr"])
def _store_kernel(row_ptr, cache_ptr, slot_ptr, row_stride, cache_stride, W: tl.constexpr, BLOCK: tl.constexpr):
    """One program per new token: its cache row (W = L + R) to its slot; slot -1 (padding): nothing."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    offs = tl.arange(0, BLOCK)
    m = offs < W
    if slot >= 0:
        tl.store(cache_ptr + slot * cache_stride + offs, tl.load(row_ptr + t * row_stride + offs, mask=m), mask=m)


def store(cache: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """cache (S, L + R) rows contiguous, c_kv (N, L), k_pe (N, R), slot_mapping (N,) (-1: skip)."""
    rows = torch.cat([c_kv, k_pe], dim=-1).to(cache.dtype)  # (N, L + R)
    n, w = rows.shape
    if n:
        _store_kernel[(n,)](rows, cache, slot_mapping, rows.stride(0), cache.stride(0), W=w,
                            BLOCK=triton.next_power_of_2(w))


@triton.jit(do_not_specialize=["sl_ptr", "num_splits", "stride_btb", "stride_ob", "stride_oh", "stride_lb",
                             "stride_lh"])
def _decode_kernel(ql_ptr, qp_ptr, c_ptr, op_ptr, lse_ptr, bt_ptr, sl_ptr, scale, num_splits,
                   stride_qlb, stride_qlh, stride_qpb, stride_qph, stride_cs, stride_btb,
                   stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                   H: tl.constexpr, L: tl.constexpr, R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr,
                   BLOCK_R: tl.constexpr, BS: tl.constexpr, PAGES: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Sequence b, heads [hb * BLOCK_H, +BLOCK_H), split `split` of its pages, PAGES pages an
    iteration: a partial o_lat (BLOCK_H, L) and its LSE."""
    b = tl.program_id(0)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(sl_ptr + b)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < H
    ll = tl.arange(0, BLOCK_L)
    l_ok = ll < L
    rr = tl.arange(0, BLOCK_R)
    r_ok = rr < R
    ql = tl.load(ql_ptr + b * stride_qlb + heads[:, None] * stride_qlh + ll[None, :],
                 mask=h_ok[:, None] & l_ok[None, :], other=0.0)  # (BLOCK_H, BLOCK_L)
    qp = tl.load(qp_ptr + b * stride_qpb + heads[:, None] * stride_qph + rr[None, :],
                 mask=h_ok[:, None] & r_ok[None, :], other=0.0)  # (BLOCK_H, BLOCK_R)
    n_pages = (ctx + BS - 1) // BS
    per_split = (n_pages + num_splits - 1) // num_splits
    p_start = split * per_split
    p_end = tl.minimum(p_start + per_split, n_pages)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
    kk = tl.arange(0, PAGES * BS)
    for j in range(p_start, p_end, PAGES):
        page = j + kk // BS  # (T,)
        page_ok = page < p_end
        blk = tl.load(bt_ptr + b * stride_btb + page, mask=page_ok, other=0)
        slots = blk * BS + kk % BS
        ok = page_ok & (page * BS + kk % BS < ctx)  # (T,)
        c = tl.load(c_ptr + slots[:, None] * stride_cs + ll[None, :], mask=ok[:, None] & l_ok[None, :],
                    other=0.0)  # (T, BLOCK_L): the latents
        kp = tl.load(c_ptr + slots[:, None] * stride_cs + L + rr[None, :], mask=ok[:, None] & r_ok[None, :],
                     other=0.0)  # (T, BLOCK_R): the rope keys
        s = tl.dot(ql, tl.trans(c), input_precision=DOT_PRECISION)
        s = (s + tl.dot(qp, tl.trans(kp), input_precision=DOT_PRECISION)) * scale  # (BLOCK_H, T)
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=DOT_PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(tl.where(l_i == 0.0, 1.0, l_i)))
    tl.store(op_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + ll[None, :], out,
             mask=h_ok[:, None] & l_ok[None, :])
    tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=h_ok)


@triton.jit(do_not_specialize=["num_splits", "stride_ob", "stride_oh", "stride_lb", "stride_lh"])
def _reduce_kernel(op_ptr, lse_ptr, o_ptr, num_splits, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                   stride_b, stride_h, L: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_S: tl.constexpr):
    """(row b, head h): the splits' partial outputs weighted by exp(LSE); no keys at all (padding): zeros."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    ss = tl.arange(0, BLOCK_S)
    s_ok = ss < num_splits
    lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh + ss, mask=s_ok, other=float("-inf"))  # (S,)
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.where(s_ok & (lse > float("-inf")), tl.exp(lse - m), 0.0)
    ll = tl.arange(0, BLOCK_L)
    l_ok = ll < L
    parts = tl.load(op_ptr + b * stride_ob + h * stride_oh + ss[:, None] * stride_os + ll[None, :],
                    mask=s_ok[:, None] & l_ok[None, :], other=0.0)  # (S, BLOCK_L)
    w_sum = tl.sum(w, 0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(w_sum == 0.0, 1.0, w_sum)
    tl.store(o_ptr + b * stride_b + h * stride_h + ll, out.to(o_ptr.dtype.element_ty), mask=l_ok)


def decode(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
           seq_lens: torch.Tensor, scale: float, block_size: int, max_splits: int = 16,
           target_programs: int | None = None, block_h: int = 16, keys: int | None = None) -> torch.Tensor:
    """q_lat (B, H, L), q_pe (B, H, R), cache (S, L + R), block_tables (B, M), seq_lens (B,) (0: a padding
    row) -> o_lat (B, H, L) in q_lat's dtype. Splits: enough programs for ~target_programs (default
    triton_attn.grid_target: two waves of the GPU's SMs), at most one a page of the widest table (from
    shapes: no host lengths). keys per iteration: 32 (16 for float32: a 512-wide latent tile is then
    32 KiB, as in bf16)."""
    b, h, L = q_lat.shape
    R = q_pe.shape[-1]
    q_lat, q_pe = q_lat.contiguous(), q_pe.contiguous()
    out = torch.empty_like(q_lat)
    if b == 0:
        return out
    bh = max(16, min(triton.next_power_of_2(h), block_h))  # tl.dot needs 16 rows
    keys = keys or (32 if q_lat.element_size() <= 2 else 16)
    block_l = max(16, triton.next_power_of_2(L))
    head_blocks = triton.cdiv(h, bh)
    target = target_programs or grid_target(q_lat.device)
    splits = max(1, min(max_splits, target // (b * head_blocks), block_tables.shape[1]))
    part = torch.empty(b, h, splits, L, dtype=torch.float32, device=q_lat.device)
    lse = torch.empty(b, h, splits, dtype=torch.float32, device=q_lat.device)
    _decode_kernel[(b, head_blocks, splits)](
        q_lat, q_pe, cache, part, lse, block_tables, seq_lens, scale, splits,
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), cache.stride(0), block_tables.stride(0),
        part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
        H=h, L=L, R=R, BLOCK_H=bh, BLOCK_L=block_l, BLOCK_R=max(16, triton.next_power_of_2(R)), BS=block_size,
        PAGES=max(1, -(-max(keys, 16) // block_size)),
        DOT_PRECISION="ieee" if q_lat.dtype == torch.float32 else "tf32",  # tf32: ignored for bf16 inputs
        num_warps=8 if block_l >= 256 else 4, num_stages=2)  # the (BLOCK_H, L) accumulator over more threads
    _reduce_kernel[(b, h)](part, lse, out, splits, part.stride(0), part.stride(1), part.stride(2), lse.stride(0),
                           lse.stride(1), out.stride(0), out.stride(1), L=L, BLOCK_L=triton.next_power_of_2(L),
                           BLOCK_S=triton.next_power_of_2(max_splits))
    return out
