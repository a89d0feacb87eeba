"""Fused elementwise kernels in Triton, used on CUDA: residual add + RMSNorm, SiLU-and-mul, rotary.

Each replaces several memory-bound torch ops (and their launches) with one pass over the data; each is
tested against the torch path it replaces (tests/test_fused.py, under TRITON_INTERPRET=1 on the CPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rmsnorm_kernel(x_ptr, r_ptr, w_ptr, o_ptr, ro_ptr, n_cols, eps,
                        HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    m = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=m, other=0.0)
    if HAS_RES:
        r = tl.load(r_ptr + row * n_cols + cols, mask=m, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # one rounding, as torch's add
        tl.store(ro_ptr + row * n_cols + cols, x, mask=m)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    y = (xf * inv).to(x.dtype).to(tl.float32) * w  # as HF: normalise in fp32, cast, then scale
    tl.store(o_ptr + row * n_cols + cols, y.to(x.dtype), mask=m)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x (N, D) [+ residual] -> (rmsnorm(x + residual) * weight, x + residual or None)."""
    x = x.contiguous()
    n, d = x.shape
    out = torch.empty_like(x)
    new_res = torch.empty_like(x) if residual is not None else None
    res = residual.contiguous() if residual is not None else x
    _add_rmsnorm_kernel[(n,)](x, res, weight, out, new_res if new_res is not None else out, d, eps,
                              HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(d))
    return out, new_res


@triton.jit
def _silu_mul_kernel(x_ptr, o_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    blk = tl.program_id(1)
    cols = blk * BLOCK + tl.arange(0, BLOCK)
    m = cols < n_cols
    g = tl.load(x_ptr + row * 2 * n_cols + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * 2 * n_cols + n_cols + cols, mask=m, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(o_ptr + row * n_cols + cols, y.to(o_ptr.dtype.element_ty), mask=m)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(N, 2I) with gate | up halves -> silu(gate) * up, (N, I)."""
    gate_up = gate_up.contiguous()
    n, two_i = gate_up.shape
    i = two_i // 2
    out = torch.empty(n, i, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(i))
    _silu_mul_kernel[(n, triton.cdiv(i, block))](gate_up, out, i, BLOCK=block)
    return out


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, n_heads, stride_n, stride_h, HALF: tl.constexpr,
                   BLOCK: tl.constexpr):
    """In place, rotate-half layout: x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin (cos/sin halves equal)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    j = tl.arange(0, BLOCK)
    m = j < HALF
    base = x_ptr + t * stride_n + h * stride_h
    x1 = tl.load(base + j, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF + j, mask=m, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + t * 2 * HALF + j, mask=m, other=0.0)
    s = tl.load(sin_ptr + t * 2 * HALF + j, mask=m, other=0.0)
    tl.store(base + j, (x1 * c - x2 * s).to(x_ptr.dtype.element_ty), mask=m)
    tl.store(base + HALF + j, (x2 * c + x1 * s).to(x_ptr.dtype.element_ty), mask=m)


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (N, H, d) in place with cos/sin rows (N, d) float32; returns x."""
    n, h, d = x.shape
    if n == 0:
        return x
    _rotary_kernel[(n, h)](x, cos.contiguous(), sin.contiguous(), h, x.stride(0), x.stride(1), HALF=d // 2,
                           BLOCK=triton.next_power_of_2(d // 2))
    return x
