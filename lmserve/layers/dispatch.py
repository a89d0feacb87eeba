"""Where fused kernels are used: on CUDA, when Triton imports. Elsewhere the plain torch ops run."""

from __future__ import annotations

from types import ModuleType

import torch


def fused_ops(x: torch.Tensor) -> ModuleType | None:
    """The fused-kernel module (lmserve.layers.fused) for tensors on CUDA, else None."""
    if not x.is_cuda:
        return None
    try:
        from lmserve.layers import fused
    except ImportError:
        return None
    return fused
