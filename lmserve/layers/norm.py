"""RMSNorm, computed in float32 as HF does, with an optional fused residual add."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lmserve.layers import dispatch


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, over the last dim."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual).
        x: (..., dim), e.g. (N, hidden) or the per-head q/k of Qwen3, (N, heads, head_dim)."""
        fused = dispatch.fused_ops(x)
        if fused is not None:  # the kernel takes rows: (..., dim) -> (rows, dim) and back
            d = x.shape[-1]
            out, new_res = fused.add_rmsnorm(x.reshape(-1, d), None if residual is None else residual.reshape(-1, d),
                                             self.weight, self.eps)  # (rows, dim) each
            return out.view(x.shape) if residual is None else (out.view(x.shape), new_res.view(x.shape))
        if residual is not None:
            x = x + residual
            residual = x
        if x.dtype == torch.float32:  # one fused op; identical math to the path below in fp32
            out = F.rms_norm(x, self.weight.shape, self.weight, self.eps)
            return out if residual is None else (out, residual)
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(dtype)
        return out if residual is None else (out, residual)

    def load(self, tensor: torch.Tensor, shard: int | None = None, kind: str = "weight") -> None:
        if tuple(tensor.shape) != tuple(self.weight.shape):
            raise ValueError(f"RMSNorm shape mismatch: {tuple(tensor.shape)} vs {tuple(self.weight.shape)}")
        self.weight.data.copy_(tensor)
