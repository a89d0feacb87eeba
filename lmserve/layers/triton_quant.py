"""Triton matmuls that dequantize the weights of layers/quant.py in registers (issue #14): x @ W.T with W
read in its stored form, never written out in float. `quant_matmul(x, layer)`: x (N, in) -> (N, out) in
x's dtype, no bias (what layer.matmul computes), for Int8Linear / Int4Linear / Fp8Linear, reading their
qweight, scales, mins, group_size (`packed_weight`; nothing is copied):

    format  qweight                               scales / mins                w[n, k]
    int8    int8 [out, in]                        [out, in // group] / opt.    q * scale (+ min)
    int4    uint8 [out, in // 2], byte j = column [out, in // group] both      q * scale + min
            2j in the low nibble, 2j + 1 the high
    fp8     uint8 [out, in], float8 e4m3 bits     [out] / none                 e4m3(q) * scale

  _gemv_kernel   decode-sized M (up to GEMV_MAX_M rows): a program owns BLOCK_N output features of all
                 rows and walks K; each (BLOCK_N, BLOCK_K) weight tile is dequantized in float32
                 registers and multiplied element-wise into float32 accumulators, summed over K once
                 at the end. BLOCK_N 16, halved down to 4 on CUDA while the grid has fewer than
                 PROGRAMS_PER_SM programs per SM.
  _tiled_kernel  prefill-sized M: tl.dot of the x tile with the dequantized weight tile cast to x's
                 dtype, float32 accumulation (TILED / TILED_SMALL_M / TILED_FP32).

A grid short of programs splits K (float32 partial sums added by one torch reduction: deterministic).
Integers become float32 through the bits of 1.5 * 2^23 + v (exact, no convert instruction); int4
multiplies the low nibbles by x's even columns and the high ones by the odd columns; e4m3 goes through
the hardware convert (sm89+, the interpreter) or exact integer bit work. Scales (and mins) are read
once per tile (a tile inside one group, or NG whole groups); per-row scales without mins multiply the
accumulator once at the end. A group size below the smallest K tile falls back to dequantize +
F.linear; Int8Linear's float outlier columns are added by a torch matmul after the kernel.

Block sizes are first choices, compiled for sm90a without register spills but not yet timed on a GPU:
scripts/gpu_check.py ('quant matmul') times them. Without Triton the module imports, `available()` is
False and quant_matmul raises; on the CPU the kernels run under TRITON_INTERPRET=1
(tests/test_triton_quant.py, float32 activations: the interpreter's tl.dot is wrong for bf16).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from lmserve.utils import sm_count

try:
    import triton
    import triton.language as tl
    _jit: Callable[..., Any] = triton.jit
except ImportError:  # the module imports without Triton; quant_matmul raises
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]

    def _jit(fn: Any = None, **kwargs: Any) -> Any:  # type: ignore[no-redef]
        return fn if fn is not None else (lambda f: f)

INT8, INT4, FP8 = 0, 1, 2  # the kernels' FMT
GEMV_MAX_M = 8  # up to this many rows the GEMV kernel, above the tiled one
GEMV_BLOCK_N = (4, 16)  # output features per GEMV program: 16, halved (CUDA) while the grid is short of programs
INTERPRETER_BLOCK_N = 64  # ... off CUDA: fewer, wider programs (the interpreter pays per program)
GEMV_TILE = 4096  # products per GEMV iteration: BLOCK_K = this / (BLOCK_M x BLOCK_N), in GEMV_BLOCK_K
GEMV_BLOCK_K = (32, 1024)  # (int4: twice these, the same number of bytes and products per nibble half)
# tiled kernel blocks: the largest that compile for sm90 without register spills for every format (ptxas -v
# on Triton's output; 64 x 128 tiles, or 4 warps, spill 100-1000 bytes), not yet timed on a GPU
TILED = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=3)  # prefill-sized M, 16-bit x
TILED_SMALL_M = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=3)  # up to 16 rows
TILED_FP32 = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, num_warps=8, num_stages=2)  # float32 x (IEEE dots: FMAs)
PROGRAMS_PER_SM = 4  # narrower GEMV blocks, then K splits, until the grid has this many programs per SM (CUDA)


def available() -> bool:
    """Whether Triton imported (the kernels can run: compiled on CUDA, interpreted elsewhere)."""
    return triton is not None


class PackedWeight(NamedTuple):
    """A quantized layer's weight as the kernels read it (the layer's own buffers, not copies)."""

    fmt: int  # INT8 / INT4 / FP8
    q: torch.Tensor  # int8 [out, in] / uint8 [out, in // 2] / uint8 [out, in] (e4m3 bits)
    scales: torch.Tensor  # [out, in // group], float32 or the model's dtype
    mins: torch.Tensor | None  # like scales, or None
    group: int  # input columns per scale (in_features: one per row)
    in_features: int
    out_features: int


def packed_weight(layer: Any) -> PackedWeight:
    """The weight of an Int8Linear / Int4Linear / Fp8Linear (layers/quant.py), read where it is stored:
    `qweight`, `scales`, `mins`, `group_size`."""
    # by the layers' attributes, not their classes (quant.py imports this module): GroupQuantLinear
    # subclasses carry `bits`; Fp8Linear holds e4m3 bytes and a scale per row, no groups
    fmt = {4: INT4, 8: INT8}.get(getattr(layer, "bits", None))
    if fmt is None and hasattr(layer, "qweight") and not hasattr(layer, "group_size"):
        fmt = FP8
    if fmt is None:
        raise TypeError(f"no Triton quant kernel for {type(layer).__name__}")
    lay: Any = layer  # (its buffers, untyped)
    if fmt == FP8:
        return PackedWeight(FP8, lay.qweight, lay.scales.view(-1, 1), None, lay.in_features, lay.in_features,
                            lay.out_features)
    return PackedWeight(fmt, lay.qweight, lay.scales, lay.mins, lay.group_size, lay.in_features, lay.out_features)


def dequantized(w: PackedWeight) -> torch.Tensor:
    """The float32 weight [out, in] the kernels multiply by (for checks; the layers' dequantize() is the
    same thing for their buffers)."""
    if w.fmt == FP8:
        q = w.q.view(torch.float8_e4m3fn).float()
    elif w.fmt == INT4:
        q = torch.stack([w.q & 15, w.q >> 4], dim=-1).reshape(w.out_features, -1).float()
    else:
        q = w.q.float()
    out = q.reshape(w.out_features, -1, w.group) * w.scales.float()[..., None]  # (out, G, group)
    if w.mins is not None:
        out = out + w.mins.float()[..., None]
    return out.reshape(w.out_features, w.in_features)


# ---------------------------------------------------------------- the kernels

@_jit
def _int_to_f32(v):
    """int32 values |v| < 2^22 -> float32, exactly: the float whose bits are those of 1.5 * 2^23 plus v
    (ulp 1 there), less 1.5 * 2^23. An integer add and a float subtract, both at full rate."""
    return (v + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0


@_jit
def _e4m3_to_f32(b, NATIVE: tl.constexpr):
    """float8 e4m3 bits (uint8) -> float32, exactly. NATIVE: the hardware convert (sm89+); else the bits
    moved into a float32 (exponent bias 7 -> 127), subnormals (exponent 0: m 2^-9) fixed up. The NaN
    patterns (0x7F, 0xFF) are never stored: the quantizer clamps to 448."""
    if NATIVE:
        f = b.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        v = b.to(tl.int32)
        em = v & 0x7F
        mag = ((em << 20) + (120 << 23)).to(tl.float32, bitcast=True)  # 2^(e - 7) (1 + m / 8), right for e >= 1
        mag = tl.where(em < 8, 2.0 * (mag - 0.0078125), mag)  # e == 0: 2^-7 (1 + m / 8) -> m 2^-9, exactly
        f = tl.where((v & 0x80) != 0, -mag, mag)
    return f


@_jit
def _scale_tile(q, s_ptr, m_ptr, n, n_ok, g0, G, stride_sn, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
                NG: tl.constexpr, HAS_MIN: tl.constexpr):
    """q (BLOCK_N, BLOCK_C) float32 values of rows n, the tile's columns in groups g0 .. g0 + NG (equal
    runs of BLOCK_C / NG columns) -> q * scale (+ min), float32."""
    gg = g0 + tl.arange(0, NG)  # (NG,)
    mask = n_ok[:, None] & (gg < G)[None, :]  # groups past the last: a tail tile, its q and x are 0 there
    s = tl.load(s_ptr + n[:, None] * stride_sn + gg[None, :], mask=mask, other=0.0).to(tl.float32)  # (BLOCK_N, NG)
    if NG == 1:
        w = q * s
        if HAS_MIN:
            w = w + tl.load(m_ptr + n[:, None] * stride_sn + gg[None, :], mask=mask, other=0.0).to(tl.float32)
    else:
        w3 = tl.reshape(q, (BLOCK_N, NG, BLOCK_C // NG)) * s[:, :, None]  # (BLOCK_N, NG, group)
        if HAS_MIN:
            mn = tl.load(m_ptr + n[:, None] * stride_sn + gg[None, :], mask=mask, other=0.0).to(tl.float32)
            w3 = w3 + mn[:, :, None]
        w = tl.reshape(w3, (BLOCK_N, BLOCK_C))
    return w


@_jit
def _weight_tile(q_ptr, s_ptr, m_ptr, n, n_ok, k0, K, G, stride_qn, stride_sn,
                 FMT: tl.constexpr, GS: tl.constexpr, NG: tl.constexpr, SCALE_AFTER: tl.constexpr,
                 HAS_MIN: tl.constexpr, EVEN_K: tl.constexpr, FP8_NATIVE: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    """The weight tile of rows n whose first stored column is k0 (a multiple of the tile), float32
    (BLOCK_N, BLOCK_C) (int4: stored bytes, so BLOCK_C = BLOCK_K / 2; this is called once per
    nibble: FMT 1 the low nibbles, FMT 3 the high), scaled unless SCALE_AFTER."""
    cc = k0 + tl.arange(0, BLOCK_C)  # (BLOCK_C,) stored columns
    mask = n_ok[:, None]
    if not EVEN_K:
        mask = mask & (cc < K)[None, :]
    raw = tl.load(q_ptr + n[:, None] * stride_qn + cc[None, :], mask=mask, other=0)  # (BLOCK_N, BLOCK_C)
    if FMT == 2:
        w = _e4m3_to_f32(raw, FP8_NATIVE)
    elif FMT == 1:
        w = _int_to_f32(raw.to(tl.int32) & 15)
    elif FMT == 3:
        w = _int_to_f32(raw.to(tl.int32) >> 4)
    else:
        w = _int_to_f32(raw.to(tl.int32))
    if not SCALE_AFTER:
        w = _scale_tile(w, s_ptr, m_ptr, n, n_ok, k0 // GS, G, stride_sn, BLOCK_N, BLOCK_C, NG, HAS_MIN)
    return w


@_jit
def _x_tile(x_ptr, mm, m_ok, k0, K, stride_xm, STEP: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_C: tl.constexpr):
    """x columns k0 + STEP * c (c < BLOCK_C) of rows mm: (BLOCK_M, BLOCK_C) in x's dtype, 0 outside.
    STEP 2 reads the even columns from k0 (odd: pass k0 + 1), the partners of int4's nibbles; K is
    then the number of stored bytes per row, and k0 counts columns."""
    cc = tl.arange(0, BLOCK_C)  # (BLOCK_C,)
    mask = m_ok[:, None]
    if not EVEN_K:
        mask = mask & ((k0 // STEP + cc) < K)[None, :]
    return tl.load(x_ptr + mm[:, None] * stride_xm + (k0 + STEP * cc)[None, :], mask=mask, other=0.0)


@_jit(do_not_specialize=["M", "stride_ys"])
def _gemv_kernel(x_ptr, q_ptr, s_ptr, m_ptr, y_ptr, M, N, K, G, stride_xm, stride_qn, stride_sn, stride_ym,
                 stride_ys, k_per_split,
                 FMT: tl.constexpr, GS: tl.constexpr, NG: tl.constexpr, SCALE_AFTER: tl.constexpr,
                 HAS_MIN: tl.constexpr, EVEN_K: tl.constexpr, FP8_NATIVE: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, REDUCE_EACH: tl.constexpr):
    """y[split] (M, N) = x (M, K) @ w[:, split's K columns].T for a few rows (BLOCK_M >= M), in float32:
    a program owns BLOCK_N output features, program_id(1) is the K split. The products accumulate
    element-wise in (BLOCK_M, BLOCK_N, BLOCK_K) registers (FMAs only in the loop), summed over K once
    at the end; or, REDUCE_EACH, summed over each tile into (BLOCK_M, BLOCK_N) (registers for larger
    tiles, at a reduction a tile). K: x's columns; for int4 the weight's stored bytes are K / 2 (GS,
    k_per_split count columns)."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    n_ok = n < N
    mm = tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    m_ok = mm < M
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    if REDUCE_EACH:
        acc3 = tl.zeros((BLOCK_M, BLOCK_N, 1), tl.float32)
    elif FMT == 1:
        acc3 = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K // 2), tl.float32)
    else:
        acc3 = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if FMT == 1:  # int4: low nibbles times the even columns of x, high nibbles times the odd ones
            lo = _weight_tile(q_ptr, s_ptr, m_ptr, n, n_ok, k0 // 2, K // 2, G, stride_qn, stride_sn, 1, GS // 2, NG,
                              SCALE_AFTER, HAS_MIN, EVEN_K, FP8_NATIVE, BLOCK_N, BLOCK_K // 2)  # (BLOCK_N, BLOCK_K / 2)
            hi = _weight_tile(q_ptr, s_ptr, m_ptr, n, n_ok, k0 // 2, K // 2, G, stride_qn, stride_sn, 3, GS // 2, NG,
                              SCALE_AFTER, HAS_MIN, EVEN_K, FP8_NATIVE, BLOCK_N, BLOCK_K // 2)
            xe = _x_tile(x_ptr, mm, m_ok, k0, K // 2, stride_xm, 2, EVEN_K, BLOCK_K // 2).to(tl.float32)
            xo = _x_tile(x_ptr, mm, m_ok, k0 + 1, K // 2, stride_xm, 2, EVEN_K, BLOCK_K // 2).to(tl.float32)
            prod = xe[:, None, :] * lo[None, :, :] + xo[:, None, :] * hi[None, :, :]  # xe, xo (BLOCK_M, BLOCK_K / 2)
        else:
            w = _weight_tile(q_ptr, s_ptr, m_ptr, n, n_ok, k0, K, G, stride_qn, stride_sn, FMT, GS, NG,
                             SCALE_AFTER, HAS_MIN, EVEN_K, FP8_NATIVE, BLOCK_N, BLOCK_K)  # (BLOCK_N, BLOCK_K)
            x = _x_tile(x_ptr, mm, m_ok, k0, K, stride_xm, 1, EVEN_K, BLOCK_K).to(tl.float32)  # (BLOCK_M, BLOCK_K)
            prod = x[:, None, :] * w[None, :, :]  # (BLOCK_M, BLOCK_N, BLOCK_K)
        if REDUCE_EACH:
            acc3 += tl.sum(prod, 2, keep_dims=True)  # (BLOCK_M, BLOCK_N, 1)
        else:
            acc3 += prod
    acc = tl.sum(acc3, 2)  # (BLOCK_M, BLOCK_N)
    if SCALE_AFTER:  # one scale per output row: applied to the sum
        acc = acc * tl.load(s_ptr + n * stride_sn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + split * stride_ys + mm[:, None] * stride_ym + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@_jit(do_not_specialize=["M", "stride_ys"])
def _tiled_kernel(x_ptr, q_ptr, s_ptr, m_ptr, y_ptr, M, N, K, G, stride_xm, stride_qn, stride_sn, stride_ym,
                  stride_ys, k_per_split,
                  FMT: tl.constexpr, GS: tl.constexpr, NG: tl.constexpr, SCALE_AFTER: tl.constexpr,
                  HAS_MIN: tl.constexpr, EVEN_K: tl.constexpr, FP8_NATIVE: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """y[split] (M, N) = x (M, K) @ w[:, split's K columns].T, a BLOCK_M x BLOCK_N tile per program:
    each weight tile dequantized in float32, cast to x's dtype, tl.dot, float32 accumulation.
    DOT_PRECISION: tl.dot's input_precision for float32 x ("ieee" or "tf32")."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    mm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    m_ok = mm < M
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    n_ok = n < N
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if FMT == 1:  # int4: two dots of half the depth, over the even and the odd columns
            lo = _weight_tile(q_ptr, s_ptr, m_ptr, n, n_ok, k0 // 2, K // 2, G, stride_qn, stride_sn, 1, GS // 2, NG,
                              SCALE_AFTER, HAS_MIN, EVEN_K, FP8_NATIVE, BLOCK_N, BLOCK_K // 2)  # (BLOCK_N, BLOCK_K / 2)
            hi = _weight_tile(q_ptr, s_ptr, m_ptr, n, n_ok, k0 // 2, K // 2, G, stride_qn, stride_sn, 3, GS // 2, NG,
                              SCALE_AFTER, HAS_MIN, EVEN_K, FP8_NATIVE, BLOCK_N, BLOCK_K // 2)
            xe = _x_tile(x_ptr, mm, m_ok, k0, K // 2, stride_xm, 2, EVEN_K, BLOCK_K // 2)  # (BLOCK_M, BLOCK_K / 2)
            xo = _x_tile(x_ptr, mm, m_ok, k0 + 1, K // 2, stride_xm, 2, EVEN_K, BLOCK_K // 2)
            acc = tl.dot(xe, tl.trans(lo.to(xe.dtype)), acc, input_precision=DOT_PRECISION)
            acc = tl.dot(xo, tl.trans(hi.to(xo.dtype)), acc, input_precision=DOT_PRECISION)
        else:
            w = _weight_tile(q_ptr, s_ptr, m_ptr, n, n_ok, k0, K, G, stride_qn, stride_sn, FMT, GS, NG,
                             SCALE_AFTER, HAS_MIN, EVEN_K, FP8_NATIVE, BLOCK_N, BLOCK_K)  # (BLOCK_N, BLOCK_K)
            x = _x_tile(x_ptr, mm, m_ok, k0, K, stride_xm, 1, EVEN_K, BLOCK_K)  # (BLOCK_M, BLOCK_K)
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision=DOT_PRECISION)
    if SCALE_AFTER:
        acc = acc * tl.load(s_ptr + n * stride_sn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + split * stride_ys + mm[:, None] * stride_ym + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


# ---------------------------------------------------------------- launching

def _fit_block_k(block_k: int, w: PackedWeight, min_k: int) -> tuple[int, int] | None:
    """(BLOCK_K, NG) for a weight: each tile inside one group (NG 1) or over NG whole groups; None when
    only a tile below min_k would do (the caller falls back to dequantize + matmul)."""
    g = w.group
    if g >= w.in_features or g % block_k == 0:  # one scale per row, or tiles inside a group
        return block_k, 1
    if block_k % g == 0:
        return block_k, block_k // g
    b = g & -g  # the largest power of two dividing the group (< block_k here): tiles inside a group
    return (b, 1) if b >= min_k else None


def _target_programs(device: torch.device) -> int:
    """Programs a grid should have to keep every SM's memory pipes busy (0 off CUDA: no target)."""
    return PROGRAMS_PER_SM * sm_count(device) if device.type == "cuda" else 0


def _split_k(programs: int, k_tiles: int, device: torch.device) -> int:
    """K splits that bring the grid to _target_programs, each split at least 4 tiles deep."""
    return max(1, min(-(-_target_programs(device) // programs), k_tiles // 4))


def _gemv_block_n(n: int, device: torch.device) -> int:
    """CUDA: GEMV_BLOCK_N's upper end, halved down to its lower end while the grid is short of programs:
    narrow layers (o_proj, down_proj at decode) get more programs without K splits and their extra
    launches. Elsewhere (the interpreter, which runs programs one after another) INTERPRETER_BLOCK_N."""
    target = _target_programs(device)
    if not target:
        return INTERPRETER_BLOCK_N
    lo, b = GEMV_BLOCK_N
    while b > lo and -(-n // b) < target:
        b //= 2
    return b


def _launch(kernel: Any, x: torch.Tensor, w: PackedWeight, blocks: tuple[int, ...], block_k: int, ng: int,
            split_k: int | None, consts: dict) -> torch.Tensor:
    """Run `kernel` over the output blocks x K splits: x (M, K) -> (M, N) in x's dtype."""
    m, k = x.shape
    n = w.out_features
    k_tiles = -(-k // block_k)
    splits = split_k or _split_k(math.prod(blocks), k_tiles, x.device)
    k_per_split = -(-k_tiles // max(1, min(splits, k_tiles))) * block_k  # columns, whole tiles
    splits = -(-k // k_per_split)  # none left without columns
    # the output, or float32 partial sums per split (summed below, in a fixed order)
    y = x.new_empty(m, n) if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    scale_after = w.mins is None and w.group >= w.in_features
    kernel[(*blocks, splits)](
        x, w.q, w.scales, w.mins if w.mins is not None else w.scales, y,  # mins: unread without them
        m, n, k, w.in_features // w.group, x.stride(0), w.q.stride(0), w.scales.stride(0), n, m * n, k_per_split,
        FMT=w.fmt, GS=1 if scale_after else w.group, NG=ng, SCALE_AFTER=scale_after, HAS_MIN=w.mins is not None,
        EVEN_K=k % block_k == 0, FP8_NATIVE=_fp8_native(x.device), BLOCK_K=block_k, **consts)
    return y if splits == 1 else y.sum(0).to(x.dtype)


@functools.cache
def _fp8_native(device: torch.device) -> bool:
    """The hardware e4m3 convert: sm89+ (or the interpreter, which has it)."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)


def _prepare(x: torch.Tensor, w: PackedWeight) -> tuple[torch.Tensor, PackedWeight]:
    if triton is None:
        raise RuntimeError("the Triton quant kernels need Triton (pip install triton)")
    if x.shape[-1] != w.in_features:
        raise ValueError(f"x has {x.shape[-1]} columns, the weight {w.in_features}")
    x = x.reshape(-1, w.in_features)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if w.scales.stride(-1) != 1 or (w.mins is not None and w.mins.stride(-1) != 1) or w.q.stride(-1) != 1:
        w = w._replace(q=w.q.contiguous(), scales=w.scales.contiguous(),
                       mins=None if w.mins is None else w.mins.contiguous())
    return x, w


def gemv(x: torch.Tensor, w: PackedWeight, *, block_n: int | None = None, block_k: int | None = None,
         split_k: int | None = None, num_warps: int = 4, reduce_each: bool = False) -> torch.Tensor:
    """x (M, in) @ w.T -> (M, out) with the GEMV kernel (M up to 16 or so; float32 arithmetic). Defaults:
    block_n from GEMV_BLOCK_N by SM count (INTERPRETER_BLOCK_N off CUDA); block_k GEMV_TILE / (BLOCK_M x block_n) within
    GEMV_BLOCK_K (x 2 for int4); split_k by SM count (1 off CUDA). reduce_each: sum each tile's products at
    once (the kernel's REDUCE_EACH; scripts/gpu_check.py's quant sweep times it)."""
    x, w = _prepare(x, w)
    m = x.shape[0]
    if m == 0:
        return x.new_empty(0, w.out_features)
    block_m = triton.next_power_of_2(m)
    block_n = block_n or _gemv_block_n(w.out_features, x.device)
    if block_k is None:
        block_k = min(max(GEMV_TILE // (block_m * block_n), GEMV_BLOCK_K[0]), GEMV_BLOCK_K[1])
        block_k *= 2 if w.fmt == INT4 else 1
    fit = _fit_block_k(block_k, w, 16)
    if fit is None:
        return F.linear(x, dequantized(w).to(x.dtype))
    block_k, ng = fit
    return _launch(_gemv_kernel, x, w, (triton.cdiv(w.out_features, block_n),), block_k, ng, split_k,
                   dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, REDUCE_EACH=reduce_each))


def tiled(x: torch.Tensor, w: PackedWeight, *, block_m: int | None = None, block_n: int | None = None,
          block_k: int | None = None, split_k: int | None = None, num_warps: int | None = None,
          num_stages: int | None = None, fp32_dot: str = "ieee") -> torch.Tensor:
    """x (M, in) @ w.T -> (M, out) with the tiled tl.dot kernel. Blocks: TILED (TILED_SMALL_M up to 16 rows,
    TILED_FP32 for float32 x) unless given; fp32_dot: tl.dot's input_precision for float32 x ("ieee": as
    torch's float32 matmul; "tf32" faster)."""
    x, w = _prepare(x, w)
    m = x.shape[0]
    if m == 0:
        return x.new_empty(0, w.out_features)
    cfg = dict(TILED_FP32 if x.dtype == torch.float32 else TILED_SMALL_M if m <= 16 else TILED)
    cfg.update({k: v for k, v in dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
                                        num_stages=num_stages).items() if v is not None})
    fit = _fit_block_k(cfg.pop("BLOCK_K"), w, 32 if w.fmt == INT4 else 16)
    if fit is None:
        return F.linear(x, dequantized(w).to(x.dtype))
    block_k, ng = fit
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(w.out_features, cfg["BLOCK_N"]))
    precision = fp32_dot if x.dtype == torch.float32 else "tf32"  # no effect on 16-bit inputs: one variant
    return _launch(_tiled_kernel, x, w, grid, block_k, ng, split_k, dict(cfg, DOT_PRECISION=precision))


def quant_matmul(x: torch.Tensor, layer: Any, *, gemv_max_rows: int = GEMV_MAX_M, fp32_dot: str = "ieee"
                 ) -> torch.Tensor:
    """x (N, in) @ layer's weight.T -> (N, out) in x's dtype, for an Int8Linear / Int4Linear / Fp8Linear
    (what layer.matmul computes: no bias). GEMV kernel up to gemv_max_rows rows, tiled above; an
    Int8Linear's float outlier columns added with torch."""
    w = packed_weight(layer)
    if x.shape[-1] != w.in_features:
        raise ValueError(f"x has {x.shape[-1]} columns, the weight {w.in_features}")
    x2 = x.reshape(-1, w.in_features)
    y = gemv(x2, w) if x2.shape[0] <= gemv_max_rows else tiled(x2, w, fp32_dot=fp32_dot)  # (N, out)
    cols = getattr(layer, "outlier_cols", None)
    if cols is not None:  # the int8 part holds zeros in these columns
        y = y + x2[:, cols] @ layer.outlier_weight.to(x2.dtype).T
    return y.reshape(*x.shape[:-1], w.out_features)
