"""Triton attention over the paged KV cache: KV store, FlashAttention-style prefill, split-KV decode.

Selected automatically on CUDA; on the CPU they run (slowly) under TRITON_INTERPRET=1, which is how
the tests check them against the torch reference and a float64 reference.

Layouts (as in the reference): q (N, H, d); k/v cache (num_slots, Hkv, d) with slot = block * bs +
offset; block_tables (B, M); query_start_loc (B+1,); seq_lens (B,) = context length after the step.

Quantized cache (kv_cache_dtype int8 / fp8, a QuantizedKV): `store_kv_quant` quantizes each new
token's heads (absmax per group of GROUP channels of a head, kv/cache.kv_group_size; the same float32
arithmetic as the torch reference, so the bytes match), and the prefill and decode kernels load the
elements with their scales (one per slot, head and group) and dequantize in registers (QUANT),
before the dots.

GQA: a program owns one KV head and all G = H / Hkv query heads that read it, so each K/V tile is
loaded once per query group: the query tile is BLOCK_M tokens x G heads, flattened into rows.

One compiled variant per kernel and model: Triton's JIT keys every launch on each integer argument
(== 1, divisible by 16) and each pointer (16-byte aligned) unless told not to, and compiles again for
every new key (0.5-2 s, in the middle of a measurement). The arguments that change from step to
step (the split count, block-table width, scratch strides, and index lists whose offset inside the
runner's packed step tensor moves with the batch) are listed in each kernel's do_not_specialize;
they are only read as scalars or multiplied into gathered addresses, so nothing is lost. Split
counts share one reduce variant (BLOCK_S covers max_splits). tests/test_triton_kernels.py counts
the keys the JIT would compute over random engine steps.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmserve.attention.backend import AttentionMetadata
from lmserve.kv.cache import QuantizedKV
from lmserve.utils import sm_count, to_device


def grid_target(device: torch.device) -> int:
    """Programs a split-KV decode grid aims at: two waves of the GPU's SMs (264 on an H100 / H200); off
    CUDA (the interpreter, which runs programs one after another: splits add work, no parallelism) 16,
    which still splits a small batch's keys (a 4-sequence step over 2 KV heads in 2 parts)."""
    if device.type != "cuda":
        return 16
    return 2 * sm_count(device)


@triton.jit(do_not_specialize=["slot_ptr"])
def _store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, row_stride, cache_stride,
                     HD: tl.constexpr, BLOCK: tl.constexpr):
    """One program per new token: copy its (Hkv*d) K and V rows to the cache slot. Slot -1 marks a
    padding row of a CUDA-graph batch: nothing is written."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    offs = tl.arange(0, BLOCK)
    m = offs < HD
    if slot >= 0:
        tl.store(kc_ptr + slot * cache_stride + offs, tl.load(k_ptr + t * row_stride + offs, mask=m), mask=m)
        tl.store(vc_ptr + slot * cache_stride + offs, tl.load(v_ptr + t * row_stride + offs, mask=m), mask=m)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: (N, Hkv, d) contiguous; caches: (S, Hkv, d)."""
    n, hkv, d = k.shape
    if n == 0:
        return
    hd = hkv * d
    _store_kv_kernel[(n,)](k, v, k_cache, v_cache, slot_mapping, hd, k_cache.stride(0), HD=hd,
                           BLOCK=triton.next_power_of_2(hd))


@triton.jit
def _rne(t):
    """Round to the nearest integer, ties to even (torch.round), for |t| < 2^22."""
    r = tl.floor(t + 0.5)
    odd = (r - 2.0 * tl.floor(r * 0.5)) == 1.0
    return tl.where((r - t == 0.5) & odd, r - 1.0, r)


@triton.jit
def _quantize_rows(x, QMAX: tl.constexpr, FP8: tl.constexpr):
    """x (R, C) float32 -> (elements on the int8 / fp8 e4m3 grid, still float32; scales (R,)), absmax
    per row. fp8: rounded to the e4m3 grid here (ulp 2^(e-3), at least 2^-9), ties to even, so the
    cast that follows is exact: the interpreter's own float -> fp8 rounding drops the carry into the
    exponent (126.1 -> 64)."""
    scale = tl.div_rn(tl.max(tl.abs(x), 1), QMAX)  # (R,)
    y = tl.div_rn(x, tl.where(scale > 0.0, scale, 1.0)[:, None])
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    if FP8:
        e = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # exponent of y (-127: zero)
        u = tl.maximum(e - 3, -9)  # the grid step at y is 2^u
        ulp = ((u + 127) << 23).to(tl.float32, bitcast=True)
        inv = ((127 - u) << 23).to(tl.float32, bitcast=True)
        y = _rne(y * inv) * ulp  # products with powers of two: exact
    else:
        y = _rne(y)
    return y, scale


@triton.jit(do_not_specialize=["slot_ptr"])
def _store_kv_quant_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, slot_ptr, row_stride, cache_stride,
                           scale_stride, ROWS: tl.constexpr, GROUP: tl.constexpr, ROWS_P2: tl.constexpr,
                           BLOCK_G: tl.constexpr, QMAX: tl.constexpr, FP8: tl.constexpr):
    """One program per new token: quantize its K and V (Hkv, d) as ROWS = Hkv * d / GROUP rows of GROUP
    channels (head-major, as they lie in memory), absmax per row, and write elements and scales (one
    per row, in the same order) at its slot. Slot -1 (a padding row of a CUDA-graph batch): nothing
    is written."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    hh = tl.arange(0, ROWS_P2)
    dd = tl.arange(0, BLOCK_G)
    h_ok = hh < ROWS
    m = h_ok[:, None] & (dd < GROUP)[None, :]
    offs = hh[:, None] * GROUP + dd[None, :]  # (ROWS_P2, BLOCK_G)
    if slot >= 0:
        k, ks = _quantize_rows(tl.load(k_ptr + t * row_stride + offs, mask=m, other=0.0).to(tl.float32), QMAX, FP8)
        v, vs = _quantize_rows(tl.load(v_ptr + t * row_stride + offs, mask=m, other=0.0).to(tl.float32), QMAX, FP8)
        tl.store(kc_ptr + slot * cache_stride + offs, k.to(kc_ptr.dtype.element_ty), mask=m)
        tl.store(vc_ptr + slot * cache_stride + offs, v.to(vc_ptr.dtype.element_ty), mask=m)
        tl.store(ks_ptr + slot * scale_stride + hh, ks, mask=h_ok)
        tl.store(vs_ptr + slot * scale_stride + hh, vs, mask=h_ok)


def store_kv_quant(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   k_scale: torch.Tensor, v_scale: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v: (N, Hkv, d) contiguous; caches: (S, Hkv, d) int8 / float8_e4m3fn, contiguous per slot;
    scales: (S, Hkv, G) float32, contiguous per slot: one per d / G channels."""
    n, hkv, d = k.shape
    if n == 0:
        return
    fp8 = k_cache.dtype != torch.int8
    rows, group = hkv * k_scale.shape[-1], d // k_scale.shape[-1]  # a scale per (head, group of channels)
    _store_kv_quant_kernel[(n,)](k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping, hkv * d,
                                 k_cache.stride(0), k_scale.stride(0), ROWS=rows, GROUP=group,
                                 ROWS_P2=triton.next_power_of_2(rows), BLOCK_G=triton.next_power_of_2(group),
                                 QMAX=448.0 if fp8 else 127.0, FP8=fp8)


def store_step(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor | QuantizedKV, slot_mapping: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """Store the step's new K/V (N, Hkv, d) in the cache; returns what the attention kernels read: the
    K and V caches (S, Hkv, d), their scales (S, Hkv, G; the caches themselves, unread, when not
    quantized) and whether the cache is quantized."""
    if isinstance(kv_cache, QuantizedKV):
        k_cache, v_cache = kv_cache.data[0], kv_cache.data[1]
        k_scale, v_scale = kv_cache.scale[0], kv_cache.scale[1]  # (S, Hkv, G) each
        store_kv_quant(k.contiguous(), v.contiguous(), k_cache, v_cache, k_scale, v_scale, slot_mapping)
        return k_cache, v_cache, k_scale, v_scale, True
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    store_kv(k.contiguous(), v.contiguous(), k_cache, v_cache, slot_mapping)
    return k_cache, v_cache, k_cache, v_cache, False


@triton.jit
def _load_kv_pages(kc_ptr, vc_ptr, ks_ptr, vs_ptr, bt_row_ptr, j, end_page, lo_key, ctx, kvh, stride_cs, stride_ch,
                   stride_ss, dd, d_ok, BS: tl.constexpr, PAGES: tl.constexpr, QUANT: tl.constexpr,
                   GROUP: tl.constexpr, NGROUPS: tl.constexpr):
    """Pages [j, j + PAGES) of one sequence (those below end_page), KV head kvh: K and V (T, BLOCK_D)
    with T = PAGES * BS, their key positions (T,), and which keys are real (inside [lo_key, ctx)).
    Each key's block id is gathered from the block table row, so a tile spans several pages.
    QUANT: the elements are int8 / fp8 with a float32 scale per (slot, head, group of GROUP channels)
    (scale rows stride_ss apart, then NGROUPS per head): K and V come back dequantized, in float32."""
    kk = tl.arange(0, PAGES * BS)
    page = j + kk // BS  # (T,)
    page_ok = page < end_page
    blk = tl.load(bt_row_ptr + page, mask=page_ok, other=0)
    slots = blk * BS + kk % BS  # (T,)
    k_pos = page * BS + kk % BS
    kv_ok = page_ok & (k_pos < ctx) & (k_pos >= lo_key)
    mask = kv_ok[:, None] & d_ok[None, :]
    k = tl.load(kc_ptr + slots[:, None] * stride_cs + kvh * stride_ch + dd[None, :], mask=mask, other=0.0)
    v = tl.load(vc_ptr + slots[:, None] * stride_cs + kvh * stride_ch + dd[None, :], mask=mask, other=0.0)
    if QUANT:
        sc = slots[:, None] * stride_ss + kvh * NGROUPS + (dd // GROUP)[None, :]  # (T, BLOCK_D): each channel's scale
        ks = tl.load(ks_ptr + sc, mask=mask, other=0.0)
        vs = tl.load(vs_ptr + sc, mask=mask, other=0.0)
        k = k.to(tl.float32) * ks
        v = v.to(tl.float32) * vs
    return k, v, k_pos, kv_ok


@triton.jit
def _decode_pages(q, kc_ptr, vc_ptr, ks_ptr, vs_ptr, bt_row_ptr, p_start, p_end, lo_key, ctx, kvh, scale,
                  stride_cs, stride_ch, stride_ss, dd, d_ok, G_P2: tl.constexpr, BLOCK_D: tl.constexpr,
                  BS: tl.constexpr, PAGES: tl.constexpr, QUANT: tl.constexpr, GROUP: tl.constexpr,
                  NGROUPS: tl.constexpr):
    """One query (G_P2 heads, q (G_P2, BLOCK_D) float32) over pages [p_start, p_end) of one sequence, PAGES
    pages an iteration, online softmax in float32: (out (G_P2, BLOCK_D), lse (G_P2,)); no keys: zeros and
    -inf. The decode kernel's split and the batch-invariant kernel's (triton_invariant.py) both."""
    m_i = tl.full([G_P2], float("-inf"), tl.float32)
    l_i = tl.zeros([G_P2], tl.float32)
    acc = tl.zeros([G_P2, BLOCK_D], tl.float32)
    for j in range(p_start, p_end, PAGES):  # PAGES pages per iteration
        k, v, k_pos, kv_ok = _load_kv_pages(kc_ptr, vc_ptr, ks_ptr, vs_ptr, bt_row_ptr, j, p_end, lo_key, ctx, kvh,
                                            stride_cs, stride_ch, stride_ss, dd, d_ok, BS, PAGES, QUANT, GROUP,
                                            NGROUPS)
        k, v = k.to(tl.float32), v.to(tl.float32)  # (T, BLOCK_D) each
        s = tl.sum(q[:, None, :] * k[None, :, :], 2) * scale  # (G_P2, T)
        s = tl.where(kv_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], 1)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(tl.where(l_i == 0.0, 1.0, l_i)))
    return out, lse


@triton.jit(do_not_specialize=["qsl_ptr", "sl_ptr", "work_seq_ptr", "work_q_ptr", "stride_btb"])
def _prefill_kernel(q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, o_ptr, bt_ptr, qsl_ptr, sl_ptr, work_seq_ptr, work_q_ptr,
                    scale, window,
                    stride_qn, stride_qh, stride_cs, stride_ch, stride_ss, stride_btb,
                    G: tl.constexpr, G_P2: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_M: tl.constexpr, BS: tl.constexpr, PAGES: tl.constexpr, HAS_WINDOW: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, QUANT: tl.constexpr, GROUP: tl.constexpr, NGROUPS: tl.constexpr):
    """Causal attention of BLOCK_M new tokens (x G heads) over the sequence's whole paged context,
    PAGES pages (PAGES * BS keys) per iteration. DOT_PRECISION: tl.dot's input_precision, which
    matters for float32 inputs only ("tf32" rounds them to 10 mantissa bits, "ieee" does not)."""
    w = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = tl.load(work_seq_ptr + w)
    q0 = tl.load(work_q_ptr + w)  # first new token of this tile, relative to the sequence's new tokens
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    ctx = tl.load(sl_ptr + seq)
    first_pos = ctx - q_len

    R: tl.constexpr = BLOCK_M * G_P2
    r = tl.arange(0, R)
    tok = q0 + r // G_P2  # (R,)
    hig = r % G_P2
    row_ok = (tok < q_len) & (hig < G)
    head = kvh * G + hig
    dd = tl.arange(0, BLOCK_D)
    d_ok = dd < D
    q = tl.load(q_ptr + (q_start + tok)[:, None] * stride_qn + head[:, None] * stride_qh + dd[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # (R, BLOCK_D)
    q_pos = first_pos + tok  # (R,)

    m_i = tl.full([R], float("-inf"), tl.float32)
    l_i = tl.zeros([R], tl.float32)
    acc = tl.zeros([R, BLOCK_D], tl.float32)
    hi = tl.minimum(ctx, first_pos + q0 + BLOCK_M)  # causal: no key past the tile's last query
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(0, first_pos + q0 - window + 1)
    n_lo = lo // BS
    n_hi = (hi + BS - 1) // BS
    for j in range(n_lo, n_hi, PAGES):  # PAGES pages per iteration; keys below lo are outside every row's window
        k, v, k_pos, kv_ok = _load_kv_pages(kc_ptr, vc_ptr, ks_ptr, vs_ptr, bt_ptr + seq * stride_btb, j, n_hi, lo,
                                            ctx, kvh, stride_cs, stride_ch, stride_ss, dd, d_ok, BS, PAGES,
                                            QUANT, GROUP, NGROUPS)  # (T, BLOCK_D) x2, (T,) x2
        k, v = k.to(q.dtype), v.to(q.dtype)  # dequantized tiles to the model dtype (else no-ops)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION).to(tl.float32) * scale  # (R, T)
        ok = (k_pos[None, :] <= q_pos[:, None]) & kv_ok[None, :]
        if HAS_WINDOW:
            ok = ok & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION).to(tl.float32)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(o_ptr + (q_start + tok)[:, None] * stride_qn + head[:, None] * stride_qh + dd[None, :],
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["qsl_ptr", "sl_ptr", "seq_idx_ptr", "num_splits", "stride_btb",
                             "stride_ob", "stride_oh", "stride_lb", "stride_lh"])
def _decode_kernel(q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, op_ptr, lse_ptr, bt_ptr, qsl_ptr, sl_ptr, seq_idx_ptr,
                   scale, window, num_splits,
                   stride_qn, stride_qh, stride_cs, stride_ch, stride_ss, stride_btb,
                   stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                   G: tl.constexpr, G_P2: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                   BS: tl.constexpr, PAGES: tl.constexpr, HAS_WINDOW: tl.constexpr, QUANT: tl.constexpr,
                   GROUP: tl.constexpr, NGROUPS: tl.constexpr):
    """One decode query (x G heads) over one split of its pages, PAGES pages per iteration; writes a
    partial output and its LSE.

    Each sequence's pages (those inside its window) are cut into num_splits equal runs, so the split
    count is a launch constant that needs no host-side lengths (what a CUDA graph requires). A
    padding row (context 0) has no pages: its splits are empty and write LSE = -inf."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(seq_idx_ptr + b)
    tok = tl.load(qsl_ptr + seq)
    ctx = tl.load(sl_ptr + seq)
    q_pos = ctx - 1
    hig = tl.arange(0, G_P2)
    h_ok = hig < G
    head = kvh * G + hig
    dd = tl.arange(0, BLOCK_D)
    d_ok = dd < D
    q = tl.load(q_ptr + tok * stride_qn + head[:, None] * stride_qh + dd[None, :],
                mask=h_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)  # (G_P2, BLOCK_D)

    lo_key = 0  # the first key inside the window
    if HAS_WINDOW:
        lo_key = tl.maximum(0, q_pos - window + 1)
    lo_page = lo_key // BS
    n_pages = (ctx + BS - 1) // BS
    pages_per_split = (n_pages - lo_page + num_splits - 1) // num_splits
    p_start = lo_page + split * pages_per_split
    p_end = tl.minimum(p_start + pages_per_split, n_pages)
    out, lse = _decode_pages(q, kc_ptr, vc_ptr, ks_ptr, vs_ptr, bt_ptr + seq * stride_btb, p_start, p_end, lo_key, ctx,
                             kvh, scale, stride_cs, stride_ch, stride_ss, dd, d_ok, G_P2, BLOCK_D, BS, PAGES, QUANT,
                             GROUP, NGROUPS)
    tl.store(op_ptr + b * stride_ob + head[:, None] * stride_oh + split * stride_os + dd[None, :], out,
             mask=h_ok[:, None] & d_ok[None, :])
    tl.store(lse_ptr + b * stride_lb + head * stride_lh + split, lse, mask=h_ok)


@triton.jit(do_not_specialize=["qsl_ptr", "seq_idx_ptr", "num_splits", "stride_ob", "stride_oh", "stride_lb",
                             "stride_lh"])
def _reduce_kernel(op_ptr, lse_ptr, o_ptr, qsl_ptr, seq_idx_ptr, num_splits,
                   stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_qn, stride_qh,
                   D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    """Combine the splits of one (decode query, head): softmax-weighted by each split's LSE. A row
    with no keys at all (a padding row) gets zeros. BLOCK_S >= num_splits."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq = tl.load(seq_idx_ptr + b)
    tok = tl.load(qsl_ptr + seq)
    ss = tl.arange(0, BLOCK_S)
    s_ok = ss < num_splits
    lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh + ss, mask=s_ok, other=float("-inf"))  # (S,)
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # a row with no keys: every split is empty
    w = tl.where(s_ok & (lse > float("-inf")), tl.exp(lse - m), 0.0)
    dd = tl.arange(0, BLOCK_D)
    d_ok = dd < D
    parts = tl.load(op_ptr + b * stride_ob + h * stride_oh + ss[:, None] * stride_os + dd[None, :],
                    mask=s_ok[:, None] & d_ok[None, :], other=0.0)  # (S, BLOCK_D)
    w_sum = tl.sum(w, 0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(w_sum == 0.0, 1.0, w_sum)
    tl.store(o_ptr + tok * stride_qn + h * stride_qh + dd, out.to(o_ptr.dtype.element_ty), mask=d_ok)


class TritonAttention:
    """Backend: Triton store + prefill + split-KV decode kernels."""

    supports_cuda_graphs = True  # a static decode batch needs no host-side lengths (see _plan)

    def __init__(self, rows: int = 64, max_splits: int = 16, target_programs: int | None = None,
                 prefill_keys: int = 64, decode_keys: int = 64, fp32_dot: str | None = None) -> None:
        self.rows = rows  # query rows (tokens x heads of a group) per prefill program; >= 16 for tl.dot
        self.prefill_keys = prefill_keys  # keys per iteration of a prefill program (whole pages)
        self.decode_keys = decode_keys  # keys x query heads per iteration of a decode program (registers)
        self.max_splits = max_splits
        self.target_programs = target_programs  # decode programs a step aims at; None: grid_target(device)
        # prefill tl.dot on float32 inputs: "tf32" (tensor cores, ~1e-3 relative) or "ieee" (exact
        # products; what the kernel checks use); None: as torch's float32 matmuls
        # (torch.set_float32_matmul_precision: "highest", the default, is ieee), as SDPA and the torch path
        # compute a float32 model. bf16 inputs (the CUDA default) ignore it: exact products, float32 accumulation.
        self.fp32_dot = fp32_dot or ("ieee" if torch.get_float32_matmul_precision() == "highest" else "tf32")

    def _splits(self, num_decodes: int, num_kv_heads: int, device: torch.device, max_pages: int | None = None) -> int:
        """Split-KV factor: enough programs for ~2 waves, never more splits than pages."""
        target = self.target_programs or grid_target(device)
        want = max(1, target // (num_decodes * num_kv_heads))
        return max(1, min(self.max_splits, want, max_pages or want))

    def _plan(self, meta: AttentionMetadata, num_kv_heads: int, group: int) -> dict:
        """Per-step work lists, shared by all layers: prefill tiles and the decode split count."""
        dev = meta.block_tables.device
        block_m = max(1, self.rows // triton.next_power_of_2(group))
        if meta.static_decode:  # a CUDA-graph batch: row i is a decode of sequence i; no host lengths
            b = meta.slot_mapping.shape[0]
            return {"block_m": block_m, "work_seq": None, "work_q": None, "splits": self._splits(b, num_kv_heads, dev),
                    "dec": torch.arange(b, dtype=torch.int32, device=dev)}
        dec = [i for i, n in enumerate(meta.query_lens_host) if n == 1]
        work_seq: list[int] = []
        work_q: list[int] = []
        for i, n in enumerate(meta.query_lens_host):
            if n > 1:
                for q0 in range(0, n, block_m):
                    work_seq.append(i)
                    work_q.append(q0)
        lists = (dec, work_seq, work_q)
        flat = to_device(torch.tensor(dec + work_seq + work_q, dtype=torch.int32), dev).split(list(map(len, lists)))
        plan: dict = {"block_m": block_m, **{k: t if len(v) else None
                                             for k, t, v in zip(("dec", "work_seq", "work_q"), flat, lists)}}
        if dec:
            max_pages = max(-(-meta.seq_lens_host[i] // meta.block_size) for i in dec)
            plan["splits"] = self._splits(len(dec), num_kv_heads, dev, max_pages)
        return plan

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor | QuantizedKV,
                meta: AttentionMetadata, scale: float, window: int | None) -> torch.Tensor:
        """q: (N, H, d), k/v: (N, Hkv, d), kv_cache: (2, S, Hkv, d) or a QuantizedKV -> (N, H, d)."""
        k_cache, v_cache, k_scale, v_scale, quant = store_step(k, v, kv_cache, meta.slot_mapping)
        stride_ss = k_scale.stride(0) if quant else 0
        n, h, d = q.shape
        hkv = k.shape[1]
        g = h // hkv
        q = q.contiguous()
        out = torch.empty_like(q)
        plan = meta.memo(("triton_plan", hkv, g), lambda: self._plan(meta, hkv, g))
        bt = meta.block_tables
        g_p2, bs = triton.next_power_of_2(g), meta.block_size
        ng = k_scale.shape[-1] if quant else 1  # scales per head (groups of d / ng channels)
        common = dict(G=g, G_P2=g_p2, D=d, BLOCK_D=triton.next_power_of_2(d), BS=bs, HAS_WINDOW=window is not None,
                      GROUP=d // ng, NGROUPS=ng)
        win = window or 0
        if plan["work_seq"] is not None:
            work_seq, work_q = plan["work_seq"], plan["work_q"]
            _prefill_kernel[(work_seq.numel(), hkv)](
                q, k_cache, v_cache, k_scale, v_scale, out, bt, meta.query_start_loc, meta.seq_lens, work_seq, work_q,
                scale, win, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), stride_ss, bt.stride(0),
                BLOCK_M=plan["block_m"], PAGES=max(1, self.prefill_keys // bs), QUANT=quant,
                DOT_PRECISION=self.fp32_dot if q.dtype == torch.float32 else "tf32", **common)  # tf32: the default
        if plan["dec"] is not None:
            dec = plan["dec"]
            nd, splits = dec.numel(), plan["splits"]
            part = torch.empty(nd, h, splits, d, dtype=torch.float32, device=q.device)
            lse = torch.empty(nd, h, splits, dtype=torch.float32, device=q.device)
            _decode_kernel[(nd, hkv, splits)](
                q, k_cache, v_cache, k_scale, v_scale, part, lse, bt, meta.query_start_loc, meta.seq_lens, dec,
                scale, win, splits,
                q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), stride_ss, bt.stride(0),
                part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
                PAGES=max(1, self.decode_keys // g_p2 // bs), QUANT=quant, **common)
            _reduce_kernel[(nd, h)](
                part, lse, out, meta.query_start_loc, dec, splits,
                part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
                out.stride(0), out.stride(1), D=d, BLOCK_D=triton.next_power_of_2(d),
                BLOCK_S=triton.next_power_of_2(self.max_splits))
        return out
