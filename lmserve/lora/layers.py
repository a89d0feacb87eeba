"""LoRA in the forward pass: the step's adapter rows (LoRAContext) and each adapted projection's
delta (LoRAPoint), hooked into the model's linears.

Tokens are flattened, so one step may hold rows of several adapters and rows of none. The runner
writes the step's groups ([(adapter, rows)]) into the LoRAContext before the forward and clears them
after; every adapted linear (`LinearBase.lora`) then adds, for each group whose adapter has weights
for it, (x[rows] A_cat^T) B_cat^T to its output rows. A step without adapter rows costs nothing more,
and takes the fast paths (the CPU decode plan, CUDA graphs); a step with some runs eagerly.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from lmserve.layers.linear import LinearBase, row_blocks
from lmserve.lora.adapter import LoRAAdapter

TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # our leaves LoRA applies to
MODELS = ("LlamaForCausalLM", "Gemma3ForCausalLM")  # (MLA's absorbed projections are not plain linears)


class LoRAContext:
    """The step's adapter rows in the flat batch: [(adapter, rows)], rows a slice or an index tensor.
    Written by the runner around each forward (`begin` / `end`), read by the LoRA points."""

    def __init__(self) -> None:
        self.groups: list[tuple[LoRAAdapter, slice | torch.Tensor]] = []

    @property
    def active(self) -> bool:
        return bool(self.groups)

    def begin(self, scheduled: list[tuple[Any, int]], device: torch.device) -> bool:
        """Group the step's rows by adapter (scheduled: [(seq, n)], each seq's n rows in a row, its
        adapter `seq.lora` or None); True when any row has one."""
        rows: dict[int, tuple[LoRAAdapter, list[int]]] = {}
        start = 0
        for seq, n in scheduled:
            if seq.lora is not None:
                rows.setdefault(id(seq.lora), (seq.lora, []))[1].extend(range(start, start + n))
            start += n
        self.groups = []
        for adapter, idx in rows.values():
            contiguous = idx[-1] - idx[0] + 1 == len(idx)
            self.groups.append((adapter, slice(idx[0], idx[-1] + 1) if contiguous
                                else torch.tensor(idx, dtype=torch.long, device=device)))
        return self.active

    def end(self) -> None:
        self.groups = []


class LoRAPoint:
    """One adapted projection: adds each of the step's adapters' low-rank delta to its rows."""

    def __init__(self, name: str, ctx: LoRAContext) -> None:
        self.name, self.ctx = name, ctx

    def __call__(self, x: torch.Tensor, y: torch.Tensor, invariant: bool) -> torch.Tensor:
        """x (N, in), y (N, out) the base output -> y with the deltas added (in place). invariant
        (deterministic mode): the products over fixed row blocks, as the base linear's."""
        for adapter, rows in self.ctx.groups:
            ab = adapter.weights.get(self.name)
            if ab is None:
                continue
            a, b = ab  # (S*r, in), (out, S*r)
            delta = lambda t: F.linear(F.linear(t, a), b)  # noqa: E731 - (R, in) -> (R, out)
            xs = x[rows]  # (R, in)
            d = row_blocks(delta, xs) if invariant else delta(xs)  # (R, out)
            if isinstance(rows, slice):
                y[rows] += d
            else:
                y.index_add_(0, rows, d)
        return y


def lora_targets(model: torch.nn.Module) -> dict[str, LinearBase]:
    """The model's projections LoRA applies to: our module path -> layer. ValueError for a model it
    does not apply to."""
    if type(model).__name__ not in MODELS:
        raise ValueError(f"enable_lora: LoRA is supported for {', '.join(MODELS)}, not {type(model).__name__}")
    return {name: m for name, m in model.named_modules()
            if isinstance(m, LinearBase) and name.rpartition(".")[2] in TARGETS and ".experts." not in name}


def attach_lora(model: torch.nn.Module) -> LoRAContext:
    """Hook a LoRA point into every target projection of the model; returns the context the runner
    fills each step (also kept as model.lora, which the model's forward reads to leave its CPU plan)."""
    ctx = LoRAContext()
    for name, layer in lora_targets(model).items():
        layer.lora = LoRAPoint(name, ctx)
    model.lora = ctx
    return ctx
