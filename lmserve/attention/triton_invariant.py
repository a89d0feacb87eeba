"""Batch-invariant Triton attention (deterministic mode on CUDA): each new token's attention computed
alone, the same way whatever else is in the step and however its prompt was chunked.

The fast backend (triton_attn.py) is not invariant, by design: a prefill token is a row of a tl.dot
tile whose extent follows its chunk, and a decode token's keys are cut into as many splits as the
step leaves programs for (the split count follows the batch), whose partial results then combine in
another grouping. Here every token is a row of its own (AttentionMetadata.token_seqs: its sequence,
whose block-table row it reads, and the number of keys it sees); its keys are cut at fixed absolute positions
(`split_keys` keys a split, whatever the batch); each split is summed in one order (PAGES pages an
iteration, the same compiled kernel for every token); and the splits combine one after another, in
order. A token's output is then a function of its own query and keys alone: the grid, the other rows,
the chunking and the launch a token falls in change nothing. The price is speed: prefill tokens run
the decode-style loop (no tensor-core tl.dot); decode keeps split-KV parallelism on long contexts.

The store kernels are triton_attn's (a copy per token: invariant). Checked under TRITON_INTERPRET=1
against float64 and for bit-identity across batches and chunkings (tests/test_triton_invariant.py);
scripts/gpu_check.py runs the same checks compiled for the GPU, and the model-level needle test.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmserve.attention.backend import AttentionMetadata
from lmserve.attention.triton_attn import _decode_pages, store_step
from lmserve.kv.cache import QuantizedKV

# Triton keys a compiled variant on each integer argument's divisibility by 16 and each pointer's
# alignment, and a variant may lay out (and so sum) differently: everything that varies from step to
# step is left unspecialised, so every step runs the one variant.
_VARYING = ["len_ptr", "t0", "stride_on", "stride_oh", "stride_ln", "stride_lh"]


@triton.jit(do_not_specialize=_VARYING + ["bt_ptr", "seq_ptr", "stride_btb", "stride_qn", "stride_qh"])
def _split_kernel(q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, op_ptr, lse_ptr, bt_ptr, seq_ptr, len_ptr, t0, scale, window,
                  stride_qn, stride_qh, stride_cs, stride_ch, stride_ss, stride_btb,
                  stride_on, stride_oh, stride_os, stride_ln, stride_lh,
                  G: tl.constexpr, G_P2: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BS: tl.constexpr,
                  PAGES: tl.constexpr, SPLIT_PAGES: tl.constexpr, HAS_WINDOW: tl.constexpr, QUANT: tl.constexpr,
                  GROUP: tl.constexpr, NGROUPS: tl.constexpr):
    """Token t0 + program 0 (x the G query heads of KV head program 1) over split program 2: pages
    [split * SPLIT_PAGES, (split + 1) * SPLIT_PAGES) of those it sees; writes the split's normalised
    output and its LSE. A split with no keys (past the token's context, before its window, a padding
    row's) writes nothing: the combine reads the token's own splits only."""
    r = tl.program_id(0)  # the row in this launch's scratch
    t = t0 + r  # the token
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(len_ptr + t)  # keys [0, ctx) before the window; 0: a padding row
    lo_key = 0
    if HAS_WINDOW:
        lo_key = tl.maximum(0, ctx - window)  # the query at ctx - 1 sees (ctx - 1 - window, ctx - 1]
    p_start = tl.maximum(split * SPLIT_PAGES, lo_key // BS)
    p_end = tl.minimum(split * SPLIT_PAGES + SPLIT_PAGES, (ctx + BS - 1) // BS)
    if p_start < p_end:
        bt_row = bt_ptr + tl.load(seq_ptr + t) * stride_btb  # its sequence's block table
        hig = tl.arange(0, G_P2)
        h_ok = hig < G
        head = kvh * G + hig
        dd = tl.arange(0, BLOCK_D)
        d_ok = dd < D
        q = tl.load(q_ptr + t * stride_qn + head[:, None] * stride_qh + dd[None, :],
                    mask=h_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)  # (G_P2, BLOCK_D)
        out, lse = _decode_pages(q, kc_ptr, vc_ptr, ks_ptr, vs_ptr, bt_row, p_start, p_end, lo_key, ctx, kvh, scale,
                                 stride_cs, stride_ch, stride_ss, dd, d_ok, G_P2, BLOCK_D, BS, PAGES, QUANT, GROUP,
                                 NGROUPS)  # (every split in range holds a key: a finite lse)
        tl.store(op_ptr + r * stride_on + head[:, None] * stride_oh + split * stride_os + dd[None, :], out,
                 mask=h_ok[:, None] & d_ok[None, :])
        tl.store(lse_ptr + r * stride_ln + head * stride_lh + split, lse, mask=h_ok)


@triton.jit(do_not_specialize=_VARYING)
def _combine_kernel(op_ptr, lse_ptr, o_ptr, len_ptr, t0, window,
                    stride_on, stride_oh, stride_os, stride_ln, stride_lh, stride_qn, stride_qh,
                    D: tl.constexpr, BLOCK_D: tl.constexpr, BS: tl.constexpr, SPLIT_PAGES: tl.constexpr,
                    HAS_WINDOW: tl.constexpr):
    """Token t0 + program 0, head program 1: its splits combined one after another, in order (each
    holds a key, so each LSE is finite); a padding row (no keys) gets zeros."""
    r = tl.program_id(0)
    t = t0 + r
    h = tl.program_id(1)
    ctx = tl.load(len_ptr + t)
    lo_key = 0
    if HAS_WINDOW:
        lo_key = tl.maximum(0, ctx - window)
    s_lo = lo_key // BS // SPLIT_PAGES
    s_hi = ((ctx + BS - 1) // BS + SPLIT_PAGES - 1) // SPLIT_PAGES
    dd = tl.arange(0, BLOCK_D)
    d_ok = dd < D
    m_i = tl.full([BLOCK_D], float("-inf"), tl.float32)  # every lane the same: the running max
    l_i = tl.zeros([BLOCK_D], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s in range(s_lo, s_hi):
        lse = tl.load(lse_ptr + r * stride_ln + h * stride_lh + s)
        part = tl.load(op_ptr + r * stride_on + h * stride_oh + s * stride_os + dd, mask=d_ok, other=0.0)
        m_new = tl.maximum(m_i, lse)
        alpha = tl.exp(m_i - m_new)
        w = tl.exp(lse - m_new)
        acc = acc * alpha + part * w
        l_i = l_i * alpha + w
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)
    tl.store(o_ptr + t * stride_qn + h * stride_qh + dd, out.to(o_ptr.dtype.element_ty), mask=d_ok)


class InvariantTritonAttention:
    """Backend for deterministic mode on CUDA (or the CPU under TRITON_INTERPRET=1): the fast backend's
    store, then every token's attention computed alone (the module docstring says how).

    split_keys: keys a split (whole pages); scratch_bytes: the float32 partial results one launch may
    hold (a long prefill chunk at a long context runs in several launches, which changes nothing)."""

    supports_cuda_graphs = True  # a static decode batch: plans from tensor shapes alone
    rows_per_seq = None  # every token alone (models/deepseek.py's MLA reads this: it attends so too)

    def __init__(self, split_keys: int = 512, decode_keys: int = 64, scratch_bytes: int = 256 << 20) -> None:
        self.split_keys = split_keys
        self.decode_keys = decode_keys  # keys x query heads an iteration (registers), as triton_attn's decode
        self.scratch_bytes = scratch_bytes

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor | QuantizedKV,
                meta: AttentionMetadata, scale: float, window: int | None) -> torch.Tensor:
        """q: (N, H, d), k/v: (N, Hkv, d), kv_cache: (2, S, Hkv, d) or a QuantizedKV -> (N, H, d)."""
        k_cache, v_cache, k_scale, v_scale, quant = store_step(k, v, kv_cache, meta.slot_mapping)
        n, h, d = q.shape
        hkv = k.shape[1]
        g = h // hkv
        q = q.contiguous()
        out = torch.empty_like(q)
        if n == 0:
            return out
        seqs, lens = meta.token_seqs()  # (N,) each token's sequence, (N,) the keys it sees
        tables = meta.block_tables  # (B, M)
        bs, g_p2, block_d = meta.block_size, triton.next_power_of_2(g), triton.next_power_of_2(d)
        pages = max(1, self.decode_keys // g_p2 // bs)
        split_pages = pages * max(1, self.split_keys // (pages * bs))
        splits = max(1, triton.cdiv(tables.shape[1], split_pages))  # the table's width bounds every token's
        rows = max(1, min(n, self.scratch_bytes // (h * splits * (d + 1) * 4)))
        part = torch.empty(rows, h, splits, d, dtype=torch.float32, device=q.device)
        lse = torch.empty(rows, h, splits, dtype=torch.float32, device=q.device)
        ng = k_scale.shape[-1] if quant else 1  # scales per head (groups of d / ng channels)
        win = window or 0
        for t0 in range(0, n, rows):
            r = min(rows, n - t0)
            _split_kernel[(r, hkv, splits)](
                q, k_cache, v_cache, k_scale, v_scale, part, lse, tables, seqs, lens, t0, scale, win,
                q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_scale.stride(0) if quant else 0,
                tables.stride(0), part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
                G=g, G_P2=g_p2, D=d, BLOCK_D=block_d, BS=bs, PAGES=pages, SPLIT_PAGES=split_pages,
                HAS_WINDOW=window is not None, QUANT=quant, GROUP=d // ng, NGROUPS=ng)
            _combine_kernel[(r, h)](
                part, lse, out, lens, t0, win,
                part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
                out.stride(0), out.stride(1), D=d, BLOCK_D=block_d, BS=bs, SPLIT_PAGES=split_pages,
                HAS_WINDOW=window is not None)
        return out
