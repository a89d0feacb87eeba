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


def hf_rope_scaling(divisors: list[float] | tuple[float, ...], theta: float) -> dict[str, Any] | None:
    """The HF rope_scaling that gives llama.cpp's per-frequency divisors (a Llama-3.x GGUF's rope_freqs
    tensor, our "freq_factors"), for a config.json that HF and vLLM read: llama3's (equal divisors: linear,
    or None for ones); ValueError when none gives them.

    In llama3's smooth band a divisor d is 1 / ((1 - s) / factor + s) with s = (L / wavelen - lo) / (hi - lo),
    linear in the frequency: s = a * inv + b, so the band fixes only a = L / (2 pi (hi - lo)) and
    b = -lo / (hi - lo); lo = 1 (every Llama 3.x's) then gives hi and L."""
    d = torch.tensor(divisors, dtype=torch.float64)  # (d/2,)
    inv = _inv_freq(2 * d.numel(), theta, None)  # (d/2,)
    factor = float(d.max())
    if torch.allclose(d, d[0].expand_as(d), rtol=1e-6, atol=0):  # one divisor for all: linear (or none)
        return None if abs(factor - 1) < 1e-6 else {"rope_type": "linear", "factor": factor}
    s = (1 / d - 1 / factor) / (1 - 1 / factor) if factor > 1 else torch.zeros_like(d)  # 1 kept, 0 divided
    band = (s > 1e-6) & (s < 1 - 1e-6)
    if int(band.sum()) >= 2:
        a, b = torch.linalg.lstsq(torch.stack([inv[band], torch.ones_like(inv[band])], 1),
                                  s[band].unsqueeze(1)).solution.squeeze(1).tolist()
        width = -1 / b if b < 0 else 0.0  # hi - lo
        old = a * 2 * math.pi * width
        if old > 0:
            params = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": round(1.0 + width, 6),
                      "original_max_position_embeddings": round(old) if abs(old - round(old)) < 1e-3 * old else old}
            got = _inv_freq(2 * d.numel(), theta, params)
            if torch.allclose(got, inv / d, rtol=1e-5, atol=0):
                return params
    raise ValueError("rope_scaling: these rope_freqs divisors are no llama3 scaling (no HF rope_type gives them)")


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
