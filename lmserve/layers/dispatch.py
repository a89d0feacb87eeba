"""Where fused kernels are used: on CUDA, the Triton ones (layers/fused.py) when Triton imports; on
the CPU, for float32 tensors, our C ones (layers/cpu_fused.py) when they build. Elsewhere the plain
torch ops run.

`use_fused(False)` turns them off everywhere (the torch reference in scripts/gpu_check.py and the
torch side of its fusion profile, and the eager reference on the CPU); `use_fused(True)` turns the
Triton ones on for any device (the CPU tests, under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

import torch

_forced: bool | None = None  # None: by device (CUDA only); True / False: everywhere / nowhere


def fused_ops(x: torch.Tensor) -> ModuleType | None:
    """The fused-kernel module for x: Triton's (lmserve.layers.fused) on CUDA, ours for float32 CPU
    tensors (lmserve.layers.cpu_fused), else None."""
    if _forced is False:
        return None
    if _forced is None and not x.is_cuda:
        return _cpu_module() if x.dtype == torch.float32 and x.device.type == "cpu" else None
    return _fused_module()


@functools.cache
def _cpu_module() -> ModuleType | None:
    from lmserve.layers import cpu_native
    if not cpu_native.available():
        return None
    from lmserve.layers import cpu_fused
    return cpu_fused


@functools.cache
def _fused_module() -> ModuleType | None:
    """Imported once: this sits on every layer's path, several times per step."""
    try:
        from lmserve.layers import fused
    except ImportError:
        return None
    return fused


@contextmanager
def use_fused(on: bool | None) -> Iterator[None]:
    """Within the block, fused kernels everywhere (True), nowhere (False) or by device (None)."""
    global _forced
    before, _forced = _forced, on
    try:
        yield
    finally:
        _forced = before



def cpu_fast_allowed() -> bool:
    """The CPU fast paths built on the fused ops (models/cpu_decode.py) may run: not forced either way
    (use_fused(False) asks for the torch reference, use_fused(True) for the Triton kernels)."""
    return _forced is None
