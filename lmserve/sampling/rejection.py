"""Speculative verification by modified rejection sampling (Leviathan et al.; Chen et al.).

Draft token x_i came from the draft distribution p_i; the target's processed distribution at that
position is q_i. Accept x_i with probability min(1, q_i(x_i) / p_i(x_i)); at the first rejection,
emit a token drawn from the residual max(0, q_i - p_i) renormalised and stop; if all k drafts pass,
emit a bonus token drawn from q_k. The emitted tokens are distributed exactly as sampling from the
target one token at a time. A proposer without a distribution (n-gram lookup) is a point mass:
p_i = one-hot(x_i). Greedy requests accept exactly the drafts equal to the target's argmax.
"""

from __future__ import annotations

import random

import torch

from lmserve.layers.cpu_fused import argmax


def _uniform(gen: random.Random | None) -> float:
    return (gen or random).random()


def _sample(dist: torch.Tensor, gen: random.Random | None) -> int:
    """Inverse-CDF draw from an unnormalised (V,) float64 distribution."""
    cdf = dist.cumsum(0)
    u = _uniform(gen) * float(cdf[-1])
    return int(torch.searchsorted(cdf, torch.tensor([u], dtype=cdf.dtype, device=cdf.device), right=True)
               .clamp_(max=dist.shape[0] - 1))


def verify_greedy(best: list[int], drafts: list[int]) -> tuple[list[int], int]:
    """Greedy verification from the target's (processed) argmax at each of the k + 1 positions: the
    drafts equal to it, then the target's own token at the first mismatch (or the bonus token)."""
    j, k = 0, len(drafts)
    while j < k and drafts[j] == best[j]:
        j += 1
    return drafts[:j] + [best[j]], j


def verify(target: torch.Tensor, drafts: list[int], draft_probs: torch.Tensor | None,
           generator: random.Random | None, greedy: bool) -> tuple[list[int], int]:
    """target: (k+1, V) processed target probabilities; draft_probs: (k, V) or None (point mass).

    Returns (tokens to emit: accepted drafts + one corrected or bonus token, number accepted).
    """
    k = len(drafts)
    if greedy:
        return verify_greedy(argmax(target).tolist(), drafts)
    q = target.double()
    for i, x in enumerate(drafts):
        qx = float(q[i, x])
        px = 1.0 if draft_probs is None else float(draft_probs[i, x])
        if px > 0 and _uniform(generator) < qx / px:  # (q(x) / p(x) >= 1 always passes; NaN, a dead row's, never)
            continue
        if draft_probs is None:
            residual = q[i].clone()
            residual[x] = 0.0
        else:
            residual = (q[i] - draft_probs[i].double()).clamp_(min=0.0)
        if float(residual.sum()) <= 0:  # q == p exactly: any draw from q is correct
            residual = q[i]
        return drafts[:i] + [_sample(residual, generator)], i
    return drafts + [_sample(q[k], generator)], k
