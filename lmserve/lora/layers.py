"""LoRA in the forward pass: the step's adapter rows (LoRAContext) and each adapted projection's
delta (LoRAPoint), hooked into the model's linears.

Tokens are flattened, so one step may hold rows of several adapters and rows of none. The runner
writes the step's groups ([(adapter, rows)]) into the LoRAContext before the forward and clears them
after; every adapted linear (`LinearBase.lora`) then adds, for each group whose adapter has weights
for it, (x[rows] At) Bt to its output rows. A step without adapter rows costs nothing more. On the CPU
(float32) the delta is our kernel (fused.c: lm_lora_add), which the CPU decode plan's C loops call too (so a
step with adapter rows keeps the plan, with the same bits as the module path); elsewhere it is two
matmuls, and a step with adapter rows runs without CUDA graphs.
"""

from __future__ import annotations

from typing import Any

import torch

from lmserve.layers import cpu_native
from lmserve.layers.linear import LinearBase, row_blocks
from lmserve.lora.adapter import LoRAAdapter

TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # our leaves LoRA applies to
MODELS = ("LlamaForCausalLM", "Gemma3ForCausalLM")  # (MLA's absorbed projections are not plain linears)


class LoRAContext:
    """The step's adapter rows in the flat batch: [(adapter, rows)], rows a slice or an index tensor, and
    row_group (N,) int64 on the host: each row's index in groups (-1: the base model). Written by the
    runner around each forward (`begin` / `end`), read by the LoRA points and the CPU decode plan."""

    def __init__(self) -> None:
        self.groups: list[tuple[LoRAAdapter, slice | torch.Tensor]] = []
        self.row_group: torch.Tensor | None = None

    @property
    def active(self) -> bool:
        return bool(self.groups)

    def begin(self, scheduled: list[tuple[Any, int]], device: torch.device) -> bool:
        """Group the step's rows by adapter (scheduled: [(seq, n)], each seq's n rows in a row, its
        adapter `seq.lora` or None); True when any row has one."""
        self.groups, self.row_group = [], None
        if not any(seq.lora is not None for seq, _ in scheduled):
            return False
        rows: dict[int, tuple[LoRAAdapter, list[int]]] = {}
        start, marks = 0, []
        for seq, n in scheduled:
            if seq.lora is not None:
                rows.setdefault(id(seq.lora), (seq.lora, []))[1].extend(range(start, start + n))
            marks.append((list(rows).index(id(seq.lora)) if seq.lora is not None else -1, n))
            start += n
        self.row_group = torch.tensor([g for g, n in marks for _ in range(n)], dtype=torch.long)  # (N,)
        for adapter, idx in rows.values():
            contiguous = idx[-1] - idx[0] + 1 == len(idx)
            self.groups.append((adapter, slice(idx[0], idx[-1] + 1) if contiguous
                                else torch.tensor(idx, dtype=torch.long, device=device)))
        return self.active

    def end(self) -> None:
        self.groups, self.row_group = [], None


class LoRAPoint:
    """One adapted projection: adds each of the step's adapters' low-rank delta to its rows."""

    def __init__(self, name: str, ctx: LoRAContext) -> None:
        self.name, self.ctx = name, ctx

    def __call__(self, x: torch.Tensor, y: torch.Tensor, invariant: bool) -> torch.Tensor:
        """x (N, in), y (N, out) the base output -> y with the deltas added (in place). invariant
        (deterministic mode): the matmuls over fixed row blocks, as the base linear's (the CPU kernel
        takes each row on its own already)."""
        native = x.device.type == "cpu" and x.dtype == torch.float32 and y.is_contiguous() and cpu_native.available()
        for g, (adapter, rows) in enumerate(self.ctx.groups):
            ab = adapter.weights.get(self.name)
            if ab is None:
                continue
            at, bt, spans = ab  # (in, S*r), (S*r, out), (S, 2)
            if native:
                cpu_native.lora_add(x, y, at, bt, self.ctx.row_group, g, spans)
                continue
            delta = lambda t: (t @ at) @ bt  # noqa: E731 - (R, in) -> (R, out)
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
    fills each step (also kept as model.lora, which the CPU decode plan reads for the deltas it adds)."""
    ctx = LoRAContext()
    for name, layer in lora_targets(model).items():
        layer.lora = LoRAPoint(name, ctx)
    model.lora = ctx
    return ctx
