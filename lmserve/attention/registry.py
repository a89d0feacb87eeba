"""The attention backend registry, beside the protocol (backend.py) that every backend implements:
backends import the protocol, only this module imports the backends."""

from __future__ import annotations

from lmserve.attention.backend import AttentionBackend


def get_backend(name: str, device: str = "cpu") -> AttentionBackend:
    """Backend registry: 'torch' (reference, any device), 'triton' (paged kernels; CUDA, or the CPU
    under TRITON_INTERPRET=1), 'auto' (triton on CUDA when it imports, else torch)."""
    if name == "auto":
        from lmserve.utils import triton_available
        name = "triton" if str(device).startswith("cuda") and triton_available() else "torch"
    if name == "torch":
        from lmserve.attention.torch_ref import TorchAttention
        return TorchAttention()
    if name == "triton":
        from lmserve.attention.triton_attn import TritonAttention
        return TritonAttention()
    raise ValueError(f"unknown attention backend {name!r} (available: auto, torch, triton)")
