"""Small helpers shared by the runner, the graphs, the attention backends and the sampler."""

from __future__ import annotations

import functools
import importlib.util
import os
from pathlib import Path

import torch


def cache_root() -> Path:
    """Where lmserve keeps what it builds once per machine (LMSERVE_CACHE, default ~/.cache/lmserve):
    kernels/ (the compiled C kernels), models/ (models joined from part packages), tokenizers/."""
    return Path(os.environ.get("LMSERVE_CACHE", Path.home() / ".cache" / "lmserve"))


@functools.cache
def triton_available() -> bool:
    """Whether Triton can be imported (looked up once, without importing it)."""
    return importlib.util.find_spec("triton") is not None


def tensor_version(t: torch.Tensor) -> int:
    """t._version (bumped by every in-place change), or -1 for a tensor made under inference_mode, which
    tracks none (then only its address identifies it)."""
    try:
        return t._version
    except RuntimeError:
        return -1


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device`. To CUDA it goes through pinned memory without blocking, so
    building a step's inputs never waits for the device (the caching host allocator keeps the
    pinned buffer until the copy is done); the step's one sync is reading its tokens back."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
