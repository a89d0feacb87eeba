"""The one Linear interface every model uses.

A model never calls nn.Linear directly: it builds `Linear` (one weight) or `MergedLinear` (several
logical projections fused into one matmul, e.g. q/k/v or gate/up). Each carries a `load` method the
loader calls with a checkpoint tensor and, for merged layers, the shard's index, so checkpoint names
map to our parameters through a small table. Quantized implementations slot in behind the same
interface later (same constructor shape, same `load`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """y = x @ W.T + b, W: [out_features, in_features]."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, in) -> (N, out)
        return F.linear(x, self.weight, self.bias)

    def load(self, tensor: torch.Tensor, shard: int | None = None, kind: str = "weight") -> None:
        """Copy a checkpoint tensor (weight [out, in] or bias [out]) into this layer."""
        param = self.weight if kind == "weight" else self.bias
        if param is None:
            raise ValueError(f"{type(self).__name__} has no {kind}")
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(f"shape mismatch loading {kind}: checkpoint {tuple(tensor.shape)} "
                             f"vs model {tuple(param.shape)}")
        param.data.copy_(tensor)


class MergedLinear(Linear):
    """Several projections of the same input fused into one matmul; output split by `sizes`."""

    def __init__(self, in_features: int, sizes: list[int], bias: bool = False) -> None:
        super().__init__(in_features, sum(sizes), bias)
        self.sizes = list(sizes)
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes))]

    def load(self, tensor: torch.Tensor, shard: int | None = None, kind: str = "weight") -> None:
        if shard is None:
            return super().load(tensor, None, kind)
        param = self.weight if kind == "weight" else self.bias
        if param is None:
            raise ValueError(f"{type(self).__name__} has no {kind}")
        lo, n = self.offsets[shard], self.sizes[shard]
        target = param.data[lo:lo + n]
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(f"shape mismatch loading shard {shard} {kind}: checkpoint "
                             f"{tuple(tensor.shape)} vs model {tuple(target.shape)}")
        target.copy_(tensor)

    def split(self, y: torch.Tensor) -> list[torch.Tensor]:  # (N, sum) -> [(N, s_i)]
        return list(y.split(self.sizes, dim=-1))
