"""Rotary position embeddings (HF 'rotate_half' layout), looked up by absolute position."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def _inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))  # (d/2,)
    if not scaling:
        return inv
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "freq_factors":  # llama.cpp's rope_freqs tensor: one divisor per frequency
        factors = torch.tensor(scaling["freq_factors"], dtype=torch.float64)  # (d/2,)
        if factors.shape != inv.shape:
            raise ValueError(f"rope_scaling freq_factors: expected {inv.numel()} (head_dim / 2), got {factors.numel()}")
        return inv / factors
    if kind == "llama3":
        factor = float(scaling["factor"])
        lo, hi = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        smooth = ((old / wavelen) - lo) / (hi - lo)
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        mid = (wavelen <= old / lo) & (wavelen >= old / hi)
        return torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: default, linear, llama3, freq_factors)")


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables; forward rotates q and k at the given positions."""

    def __init__(self, head_dim: int, max_position: int, theta: float,
                 scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        inv = _inv_freq(head_dim, theta, scaling)  # (d/2,)
        t = torch.arange(max_position, dtype=torch.float64)
        freqs = torch.outer(t, inv)  # (P, d/2)
        emb = torch.cat([freqs, freqs], dim=-1)  # (P, d)
        self.register_buffer("cos", emb.cos().float(), persistent=False)
        self.register_buffer("sin", emb.sin().float(), persistent=False)

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([-x2, x1], dim=-1)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) rows for the positions: (N, 1, d) each. Done once per step, shared by all layers."""
        return (self.cos.index_select(0, positions).unsqueeze(1),
                self.sin.index_select(0, positions).unsqueeze(1))

    def rotate(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x: (N, heads, d) rotated with lookup()'s rows, in float32, returned in its dtype."""
        cos, sin = cos_sin  # (N, 1, d) each
        xf = x.float()
        return (xf * cos + self._rotate_half(xf) * sin).to(x.dtype)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """q: (N, H, d), k: (N, Hkv, d), positions: (N,) -> rotated (q, k) in their dtype."""
        cos_sin = cos_sin if cos_sin is not None else self.lookup(positions)
        return self.rotate(q, cos_sin), self.rotate(k, cos_sin)
