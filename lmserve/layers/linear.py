"""The one Linear interface every model uses.

A model never calls nn.Linear directly: it builds `Linear` (one weight) or `MergedLinear` (several
logical projections fused into one matmul, e.g. q/k/v or gate/up). Each carries a `load` method the
loader calls with a checkpoint tensor and, for merged layers, the shard's index, so checkpoint names
map to our parameters through a small table. `LinearBase` holds what every linear shares (shape,
output split, float bias, the `load` contract); the quantized layers of `layers/quant.py` derive from
it too and differ only in how they store the weight (`load_weight`) and multiply by it (`forward`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


INVARIANT_ROWS = 16  # deterministic mode: every product is over blocks of exactly this many rows


def row_blocks(fn: Any, x: torch.Tensor) -> Any:
    """fn(x) computed over blocks of INVARIANT_ROWS rows (the last padded with zeros): a row's result
    then never depends on how many rows came with it, whatever kernel a matmul library picks for a
    shape, nor whether a vectorized elementwise function (exp, sigmoid, cos) takes the element in a
    full vector or in the scalar tail (deterministic mode). x: (N, ...) -> fn's (N, ...) tensor, or a
    tuple of them."""
    n = x.shape[0]
    pad = (-n) % INVARIANT_ROWS
    if pad:
        x = torch.cat([x, x.new_zeros(pad, *x.shape[1:])])  # (N + pad, ...)
    parts = [fn(x[i:i + INVARIANT_ROWS]) for i in range(0, n + pad, INVARIANT_ROWS)]
    if isinstance(parts[0], tuple):
        return tuple(torch.cat(col)[:n] for col in zip(*parts))
    return torch.cat(parts)[:n]


def make_batch_invariant(model: nn.Module) -> None:
    """Deterministic mode: every linear of the model (and a tied LM head) multiplies in fixed row
    blocks, as does every module that declares a `batch_invariant` switch (MoE routing, MLA rope)."""
    for m in model.modules():
        if isinstance(m, LinearBase) or hasattr(type(m), "batch_invariant"):
            m.batch_invariant = True
    model.batch_invariant = True


class LinearBase(nn.Module):
    """y = x @ W.T + b with W: [sum(sizes), in_features]; the output rows split into shards by `sizes`.
    With batch_invariant (deterministic mode) over fixed blocks of rows (`row_blocks`)."""

    batch_invariant = False
    reduce: Any = None  # tensor parallel, a row-parallel layer: the TPGroup whose all-reduce sums its output
    lora: Any = None  # a LoRA target: its lora.layers.LoRAPoint, which adds the step's adapters' deltas

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        y = row_blocks(super().__call__, x) if self.batch_invariant and x.dim() == 2 else super().__call__(x)
        if self.lora is not None:
            y = self.lora(x, y, self.batch_invariant)
        return y if self.reduce is None else self.reduce.all_reduce(y)

    def __init__(self, in_features: int, sizes: int | Sequence[int], bias: bool = False) -> None:
        super().__init__()
        self.sizes = [sizes] if isinstance(sizes, int) else list(sizes)
        self.in_features, self.out_features = in_features, sum(self.sizes)
        self.offsets = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        self.bias = nn.Parameter(torch.zeros(self.out_features), requires_grad=False) if bias else None

    @classmethod
    def from_float(cls, w: torch.Tensor, bias: torch.Tensor | None = None, **kw: Any) -> "LinearBase":
        """A layer of this class holding w [out, in] (and bias [out]), e.g. Int8Linear.from_float(w)."""
        layer = cls(w.shape[1], w.shape[0], bias is not None, **kw)
        layer.load(w)
        if bias is not None:
            layer.load(bias, kind="bias")
        return layer

    def rows(self, shard: int | None) -> slice:
        """The output rows of one shard (None: all of them)."""
        if shard is None:
            return slice(0, self.out_features)
        return slice(self.offsets[shard], self.offsets[shard] + self.sizes[shard])

    def load(self, tensor: Any, shard: int | None = None, kind: str = "weight") -> None:
        """Copy a checkpoint tensor (weight [rows, in] or bias [rows]) into the rows of `shard`."""
        if kind == "weight":
            return self.load_weight(tensor, shard)
        rows = self.rows(shard)
        if self.bias is None:
            raise ValueError(f"{type(self).__name__} has no {kind}")
        check_shape(tensor, (rows.stop - rows.start,), kind, shard)
        self.bias.data[rows].copy_(tensor)

    def load_weight(self, tensor: Any, shard: int | None) -> None:
        """Store the weight rows of `shard` ([rows, in]); each storage format implements it."""
        raise NotImplementedError

    def split(self, y: torch.Tensor) -> list[torch.Tensor]:  # (N, sum) -> [(N, s_i)]
        return list(y.split(self.sizes, dim=-1))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, sizes={self.sizes}, bias={self.bias is not None}"


def check_shape(tensor: Any, shape: tuple[int, ...], kind: str, shard: int | None) -> None:
    """Raise ValueError naming the shard when a checkpoint tensor does not fit its place."""
    if tuple(tensor.shape) != tuple(shape):
        where = f"shard {shard} {kind}" if shard is not None else kind
        raise ValueError(f"shape mismatch loading {where}: checkpoint {tuple(tensor.shape)} vs model {tuple(shape)}")


class Linear(LinearBase):
    """A float weight W: [out_features, in_features]."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias)
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, in) -> (N, out)
        return F.linear(x, self.weight, self.bias)

    def load_weight(self, tensor: Any, shard: int | None) -> None:
        target = self.weight.data[self.rows(shard)]  # (rows, in)
        check_shape(tensor, tuple(target.shape), "weight", shard)
        target.copy_(tensor)


class MergedLinear(Linear):
    """Several projections of the same input fused into one matmul; output split by `sizes`."""

    def __init__(self, in_features: int, sizes: list[int], bias: bool = False) -> None:
        super().__init__(in_features, sum(sizes), bias)
        self.sizes = list(sizes)
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes))]
