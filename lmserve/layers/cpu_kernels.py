"""PyTorch's weight-only CPU kernels behind the quantized layers (layers/quant.py), and their layouts.

Measured on this machine (2 cores, AVX512; a SmolLM2-135M-sized stack of linears, 106M weights, see
the issue #14 report): torch._weight_int8pack_mm and aten._weight_int4pack_mm_for_cpu beat an fp32
matmul at decode sizes only with bf16 activations (fp32 / fp16 activations take a slow path, 3-10x
slower than fp32), so the activations go in as bf16 and come back in the caller's dtype. int8 keeps
our row-major layout; int4 needs the kernel's own nibble order (`int4_to_cpu_layout`), a fixed
permutation of nibble positions that `int4_from_cpu_layout` undoes.
"""

from __future__ import annotations

import torch

INT8_MAX_ROWS = 16  # the int8 kernel wins up to about this many rows; above, dequantize + fp32 matmul
INT4_GROUPS = (32, 64, 128, 256)  # group sizes the int4 kernel takes


def int8_mm(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x (N, in) @ (q int8 [out, in] * scales [out]).T -> (N, out) in x's dtype."""
    xb = x.to(torch.bfloat16).contiguous()  # (N, in)
    return torch._weight_int8pack_mm(xb, q, scales.to(torch.bfloat16).contiguous()).to(x.dtype)


def int4_kernel_fits(out_features: int, group_size: int) -> bool:
    """The int4 kernel's shape rules: output rows a multiple of 16, a group size it knows."""
    return out_features % 16 == 0 and group_size in INT4_GROUPS


def int4_to_cpu_layout(q: torch.Tensor) -> torch.Tensor:
    """Values uint8 [out, in] in 0..15 -> the int4 kernel's packed uint8 [out, in // 2]."""
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)


def int4_from_cpu_layout(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """int4_to_cpu_layout undone: -> values uint8 [out, in]. The layout moves nibbles without looking at
    them, so packing the base-16 digits of every position's index tells where each nibble went."""
    device, packed, n = packed.device, packed.cpu(), out_features * in_features
    idx = torch.arange(n, dtype=torch.int64).view(out_features, in_features)
    src = torch.zeros(n, dtype=torch.int64)  # stored nibble i holds the value at position src[i]
    for shift in range(0, max(4, (n - 1).bit_length()), 4):
        src |= _nibbles(int4_to_cpu_layout((idx >> shift) & 15)).long() << shift
    q = torch.empty(n, dtype=torch.uint8)
    q[src] = _nibbles(packed)
    return q.view(out_features, in_features).to(device)


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Every byte's low nibble, then its high one, in storage order: uint8 [2 * bytes]."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).flatten()


def int4_scales_zeros(scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """Our w = q * scale + min per group as the kernel's w = (q - 8) * scale + zero: bf16 [G, out, 2]."""
    return torch.stack([scales, mins + 8 * scales], dim=-1).transpose(0, 1).to(torch.bfloat16).contiguous()


def int4_mm(x: torch.Tensor, packed: torch.Tensor, group_size: int, scales_zeros: torch.Tensor) -> torch.Tensor:
    """x (N, in) @ W.T with W in the kernel's layout -> (N, out) in x's dtype."""
    xb = x.to(torch.bfloat16).contiguous()  # (N, in)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(xb, packed, group_size, scales_zeros).to(x.dtype)
