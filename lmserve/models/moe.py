"""Mixture of experts for the Llama-family blocks (Mixtral, Qwen3-MoE): the plain, correct path.

The router scores every token against every expert (float32 softmax), keeps the k best, renormalises
them where the config says (Mixtral always; Qwen3-MoE when norm_topk_prob), and each token's output is
the weighted sum of its k experts' SwiGLU MLPs. Tokens are grouped by expert (one stable sort of the
N * k assignments) and each active expert runs one matmul over its tokens; results are scattered back
with index_add_. No capacity limit, no token dropped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lmserve.config import ModelConfig
from lmserve.layers.linear import Linear, MergedLinear


class Expert(nn.Module):
    """One expert: down(silu(gate(x)) * up(x)), gate and up fused."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden, [intermediate] * 2)
        self.down_proj = Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (n, hidden) -> (n, hidden)
        gate, up = self.gate_up_proj.split(self.gate_up_proj(x))  # (n, I) each
        return self.down_proj(F.silu(gate) * up)


class SparseMoE(nn.Module):
    """Top-k routed experts; `gate` is the router (HF's name for it)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.hidden_act not in ("silu", "swish"):
            raise ValueError(f"MoE experts with activation {cfg.hidden_act!r} are not supported (silu only)")
        self.k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = Linear(cfg.hidden_size, cfg.num_experts)
        self.experts = nn.ModuleList(Expert(cfg.hidden_size, cfg.moe_intermediate_size or cfg.intermediate_size)
                                     for _ in range(cfg.num_experts))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (N, hidden) -> (weights (N, k) in x's dtype, expert ids (N, k))."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)  # (N, E)
        weights, ids = torch.topk(probs, self.k, dim=-1)  # (N, k) each
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, hidden) -> (N, hidden)
        weights, ids = self.route(x)
        flat = ids.flatten()  # (N k,): assignment a is token a // k
        order = torch.argsort(flat, stable=True)  # assignments grouped by expert
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        out = torch.zeros_like(x)  # (N, hidden)
        start = 0
        for e, n in enumerate(counts):
            if n:
                picked = order[start:start + n]  # (n,) assignments of expert e
                tokens = picked // self.k
                y = self.experts[e](x.index_select(0, tokens))  # (n, hidden)
                out.index_add_(0, tokens, y * weights.flatten()[picked].unsqueeze(1))
                start += n
        return out
