"""Mixture of experts: Mixtral, Qwen3-MoE and DeepSeek-V2 / V3, the plain, correct path.

The router (`gate`) scores every token against every expert in float32 and `route` picks k of them:
- Mixtral / Qwen3-MoE: softmax, the k best, renormalised where the config says (Mixtral always;
  Qwen3-MoE when norm_topk_prob);
- DeepSeek-V2: softmax, the k best (greedy), or only among the topk_group groups (of n_group) whose
  best expert scores highest (group_limited_greedy);
- DeepSeek-V3 (noaux_tc): sigmoid scores; the choice is made on scores + e_score_correction_bias, a
  group scoring the sum of its best two, but the weights are the unbiased scores (renormalised when
  norm_topk_prob);
then the weights times routed_scaling_factor. Each token's output is the weighted sum of its k
experts' SwiGLU MLPs, plus the shared experts' MLP where the model has them (DeepSeek). Tokens are
grouped by expert (one stable sort of the N * k assignments) and each active expert runs one matmul
over its tokens; results are scattered back with index_add_. No capacity limit, no token dropped.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from lmserve.config import ModelConfig
from lmserve.layers.linear import Linear, MergedLinear, row_blocks


class Expert(nn.Module):
    """One expert: down(silu(gate(x)) * up(x)), gate and up fused."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden, [intermediate] * 2)
        self.down_proj = Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (n, hidden) -> (n, hidden)
        gate, up = self.gate_up_proj.split(self.gate_up_proj(x))  # (n, I) each
        return self.down_proj(F.silu(gate) * up)


class KeepFloat32(nn.Module):
    """Mixin: the module's own parameters and buffers stay float32 through dtype casts (`model.to(bf16)`);
    device moves apply. They come back from their float32 values, not from a rounded copy."""

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        kept = {n: t.data for n, t in [*self._parameters.items(), *self._buffers.items()] if t is not None}
        super()._apply(fn, recurse)
        for n, old in kept.items():
            if n in self._parameters:
                t = self._parameters[n]
                t.data = old.to(device=t.device, dtype=torch.float32)  # type: ignore[union-attr]
            else:
                device = self._buffers[n].device  # type: ignore[union-attr]
                self._buffers[n] = old.to(device=device, dtype=torch.float32)
        return self


class Float32Router(KeepFloat32, Linear):
    """DeepSeek's router: weight (E, hidden) and, for noaux_tc, e_score_correction_bias (E,), both kept
    in float32 whatever dtype the model is cast to (as transformers keeps them: the bias decides
    between scores a bf16 rounding would tie)."""

    def __init__(self, hidden: int, num_experts: int, correction_bias: bool) -> None:
        super().__init__(hidden, num_experts)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts), requires_grad=False) \
            if correction_bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, hidden) -> (N, E) float32 logits
        return F.linear(x.float(), self.weight)

    def load(self, tensor: torch.Tensor, shard: int | None = None, kind: str = "weight") -> None:
        if kind == "e_score_correction_bias" and self.e_score_correction_bias is not None:
            self.e_score_correction_bias.data.copy_(tensor)
        else:
            super().load(tensor, shard, kind)


def route(logits: torch.Tensor, k: int, renormalize: bool, scoring: str = "softmax", method: str = "greedy",
          n_group: int = 1, topk_group: int = 1, scale: float = 1.0, bias: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits (N, E) float32 -> (weights (N, k) float32, expert ids (N, k)); see the module
    docstring for the methods."""
    scores = torch.softmax(logits, dim=-1) if scoring == "softmax" else logits.sigmoid()  # (N, E)
    choice = scores if bias is None else scores + bias  # (N, E): what the selection ranks
    if method != "greedy" and n_group > 1:
        n, e = choice.shape
        grouped = choice.view(n, n_group, e // n_group)  # (N, G, E/G)
        group_scores = grouped.amax(-1) if method == "group_limited_greedy" else grouped.topk(2, -1).values.sum(-1)
        kept = torch.topk(group_scores, topk_group, dim=-1).indices  # (N, topk_group)
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)  # (N, G)
        choice = choice.masked_fill(~mask.repeat_interleave(e // n_group, dim=1), float("-inf"))
    if bias is None and choice is scores:
        weights, ids = torch.topk(scores, k, dim=-1)  # (N, k) each
    else:
        ids = torch.topk(choice, k, dim=-1).indices  # (N, k)
        weights = scores.gather(1, ids)  # (N, k): the unbiased scores
    if renormalize:
        denom = weights.sum(dim=-1, keepdim=True)
        weights = weights / (denom if scoring == "softmax" else denom + 1e-20)
    return (weights * scale if scale != 1.0 else weights), ids


class SparseMoE(nn.Module):
    """Top-k routed experts (plus DeepSeek's shared experts); `gate` is the router (HF's name for it)."""

    float_linears = ("gate",)  # kept float under weight quantization (registry.quantize_model), as vLLM keeps it
    batch_invariant = False  # deterministic mode: routing over fixed row blocks (layers.linear.row_blocks)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.hidden_act not in ("silu", "swish"):
            raise ValueError(f"MoE experts with activation {cfg.hidden_act!r} are not supported (silu only)")
        self.k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.routing = dict(scoring=cfg.scoring_func, method=cfg.topk_method, n_group=cfg.n_group,
                            topk_group=cfg.topk_group, scale=cfg.routed_scaling_factor)
        width = cfg.moe_intermediate_size or cfg.intermediate_size
        self.gate = Float32Router(cfg.hidden_size, cfg.num_experts, cfg.topk_method == "noaux_tc") if cfg.is_mla \
            else Linear(cfg.hidden_size, cfg.num_experts)
        self.experts = nn.ModuleList(Expert(cfg.hidden_size, width) for _ in range(cfg.num_experts))
        self.shared_experts = Expert(cfg.hidden_size, width * cfg.n_shared_experts) if cfg.n_shared_experts else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (N, hidden) -> (weights (N, k) in x's dtype, expert ids (N, k))."""
        def pick(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return route(logits, self.k, self.renormalize, bias=getattr(self.gate, "e_score_correction_bias", None),
                         **self.routing)
        logits = self.gate(x).float()  # (N, E)
        weights, ids = row_blocks(pick, logits) if self.batch_invariant else pick(logits)
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
                y = y * weights.flatten()[picked].unsqueeze(1)
                if out.is_cuda:
                    out.index_add_(0, tokens, y)
                else:  # the same sums (an expert's tokens are distinct): CPU index_add_ forks OpenMP even for a
                    # few rows (12-58 ms a call measured with the other core busy, against ~10 us)
                    out.index_put_((tokens,), y, accumulate=True)
                start += n
        return out if self.shared_experts is None else out + self.shared_experts(x)


def expert_tensors(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint tensor under per-expert names: transformers 5 holds a layer's experts fused,
    `...experts.gate_up_proj` (E, 2I, hidden: gate rows, then up) and `...experts.down_proj` (E, hidden,
    I), which come back as `...experts.{e}.gate_proj.weight` etc.; any other tensor passes as it is."""
    stem, _, leaf = name.removesuffix(".weight").rpartition(".")
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != 3 or not stem.endswith("experts") \
            or leaf not in ("gate_up_proj", "down_proj"):  # (a GGUF's quantized blocks pass as they are)
        yield name, tensor
        return
    for e in range(tensor.shape[0]):
        if leaf == "down_proj":
            yield f"{stem}.{e}.down_proj.weight", tensor[e]
        else:
            gate, up = tensor[e].chunk(2, dim=0)  # (I, hidden) each
            yield f"{stem}.{e}.gate_proj.weight", gate
            yield f"{stem}.{e}.up_proj.weight", up
