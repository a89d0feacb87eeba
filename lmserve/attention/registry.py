"""The attention backend registry, beside the protocol (backend.py) that every backend implements:
backends import the protocol, only this module imports the backends."""

from __future__ import annotations

from lmserve.attention.backend import AttentionBackend


def get_backend(name: str, device: str = "cpu", deterministic: bool = False) -> AttentionBackend:
    """Backend registry: 'torch' (reference, any device), 'cpu' (decode through our C kernel, the rest
    as torch), 'triton' (paged kernels; CUDA, or the CPU under TRITON_INTERPRET=1), 'auto' (triton on
    CUDA when it imports, cpu on the CPU when our kernels build, else torch).

    deterministic: every token's attention computed alone, the same way whatever else is in the step:
    on the CPU the cpu backend with every step as kernel rows, with triton (CUDA's default) the
    batch-invariant kernels of attention/triton_invariant.py; the torch reference has no such mode."""
    from lmserve.layers import cpu_native
    if name == "auto":
        from lmserve.utils import triton_available
        on_cuda = str(device).startswith("cuda")
        name = "triton" if on_cuda and triton_available() else "cpu" if not on_cuda and cpu_native.available() else "torch"
    if deterministic:
        if name == "triton":
            from lmserve.attention.triton_invariant import InvariantTritonAttention
            return InvariantTritonAttention()
        if name != "cpu" or str(device).startswith("cuda") or not cpu_native.available():
            raise ValueError(f"deterministic: needs batch-invariant attention: the cpu backend on the CPU (our C "
                             f"kernels) or triton, got {name!r} on {device}")
        from lmserve.attention.cpu_attn import CpuAttention
        return CpuAttention(rows_per_seq=None)
    if name == "cpu":
        from lmserve.attention.cpu_attn import CpuAttention
        return CpuAttention()
    if name == "torch":
        from lmserve.attention.torch_ref import TorchAttention
        return TorchAttention()
    if name == "triton":
        from lmserve.attention.triton_attn import TritonAttention
        return TritonAttention()
    raise ValueError(f"unknown attention backend {name!r} (available: auto, torch, cpu, triton)")
