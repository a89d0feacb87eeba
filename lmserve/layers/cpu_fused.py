"""The fused elementwise ops on the CPU (float32), with the interface of the Triton module
(layers/fused.py): residual add + RMSNorm, SiLU-and-mul, rotary; and greedy sampling's argmax. Our C
code (layers/csrc/fused.c, built by layers/cpu_native.py); layers/dispatch.py hands this module to
float32 CPU tensors when the library is built (the sampler calls `argmax` itself).
tests/test_cpu_fused.py holds each op to the torch code it replaces."""

from __future__ import annotations

import torch

from lmserve.layers import cpu_native


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x (N, D) [+ residual] -> (rmsnorm(x + residual) * weight, x + residual or None)."""
    lib = cpu_native.lib()
    n, d = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(n, d, dtype=torch.float32)  # (N, D)
    new_res = None
    if residual is not None:
        if residual.stride(1) != 1:
            residual = residual.contiguous()
        new_res = torch.empty(n, d, dtype=torch.float32)  # (N, D)
    lib.lm_add_rmsnorm(x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
                       0 if residual is None else residual.stride(0), weight.data_ptr(), eps, n, d, out.data_ptr(),
                       None if new_res is None else new_res.data_ptr(), torch.get_num_threads())
    return out, new_res


def _gated(kernel: str, gate_up: torch.Tensor) -> torch.Tensor:
    """(N, 2I) with gate | up halves -> act(gate) * up, (N, I), by the C kernel named `kernel`."""
    gate_up = gate_up.contiguous()
    n, two_i = gate_up.shape
    out = torch.empty(n, two_i // 2, dtype=torch.float32)  # (N, I)
    getattr(cpu_native.lib(), kernel)(gate_up.data_ptr(), n, two_i // 2, out.data_ptr(), torch.get_num_threads())
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(N, 2I) with gate | up halves -> silu(gate) * up, (N, I)."""
    return _gated("lm_silu_and_mul", gate_up)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(N, 2I) with gate | up halves -> gelu(gate, approximate='tanh') * up, (N, I) (GeGLU)."""
    return _gated("lm_gelu_tanh_and_mul", gate_up)


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (N, H, d) in place with cos/sin rows (N, d) float32; returns x."""
    n, h, d = x.shape
    if n == 0:
        return x
    assert x.stride(2) == 1, "rotary_ needs the head dim contiguous"
    cpu_native.lib().lm_rotary(x.data_ptr(), n, h, d, x.stride(0), x.stride(1), cos.contiguous().data_ptr(),
                               sin.contiguous().data_ptr())
    return x


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, dim=-1) for (B, V) logits, int64 (B,): the first largest, a NaN the largest.
    Float32 CPU rows through our C loop (torch's took ~70 us a 49,152-token row and up to ~1.8 ms for 8
    rows); anything else, or without the library, torch's own."""
    if (logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2 or logits.shape[1] == 0
            or logits.stride(1) != 1 or not cpu_native.available()):
        return logits.argmax(dim=-1)
    b, v = logits.shape
    out = torch.empty(b, dtype=torch.int64)  # (B,)
    cpu_native.lib().lm_argmax_rows(logits.data_ptr(), b, v, logits.stride(0), out.data_ptr(), torch.get_num_threads())
    return out
