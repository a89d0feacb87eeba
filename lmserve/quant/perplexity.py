"""Perplexity over a fixed text with a sliding window, and top-1 agreement with a reference model.

The standard HF recipe ("Perplexity of fixed-length models"): windows of `window` tokens start every
`stride` tokens; each window scores only the tokens the previous window did not reach, so with
stride < window every token after the first is scored exactly once, with at least window - stride
tokens of context (disjoint windows, stride = window, cannot score their own first token). Perplexity = exp(mean NLL) over the scored tokens. The
count is exact: a window scores its targets t in [max(previous end, begin + 1), end), each predicted
by the logits at t - 1 (HF's snippet weighs each window's mean loss by its target count minus one, an
approximation that this module does not copy).

Models are plain callables: token ids -> (T, V) logits (LLM.score), so this module needs no engine.
Top-1 agreement: at every scored position, does the model's argmax equal the reference's?
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

Scorer = Callable[[list[int]], torch.Tensor]  # token ids (T,) -> logits (T, V)


def sliding_windows(num_tokens: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored target) for each window over num_tokens tokens."""
    if window < 2:
        raise ValueError(f"window must be >= 2 tokens, got {window}")
    if not 1 <= stride <= window:
        raise ValueError(f"stride must be in [1, window={window}], got {stride}")
    if num_tokens < 2:
        raise ValueError(f"the text must have at least 2 tokens, got {num_tokens}")
    out, prev_end = [], 0
    for begin in range(0, num_tokens, stride):
        end = min(begin + window, num_tokens)
        out.append((begin, end, max(prev_end, begin + 1)))
        prev_end = end
        if end == num_tokens:
            break
    return out


@dataclass
class PerplexityResult:
    """One configuration's figures over the text."""

    name: str
    tokens: int = 0  # scored tokens
    nll_sum: float = 0.0
    agree: int | None = None  # scored positions whose argmax equals the reference's (None: no reference)
    windows: int = 0
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def nll(self) -> float:
        return self.nll_sum / self.tokens if self.tokens else float("nan")

    @property
    def perplexity(self) -> float:
        return float(torch.tensor(self.nll, dtype=torch.float64).exp())

    @property
    def top1_agreement(self) -> float | None:
        return None if self.agree is None or not self.tokens else self.agree / self.tokens

    def as_dict(self) -> dict[str, object]:
        return {"name": self.name, "perplexity": self.perplexity, "mean_nll": self.nll, "scored_tokens": self.tokens,
                "windows": self.windows, "top1_agreement": self.top1_agreement, **self.extra}


def window_nll(logits: torch.Tensor, ids: Sequence[int], begin: int, first: int, end: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-target NLL (float32 log-softmax, as HF's loss; summed in float64 by the caller) and argmax for targets first..end-1 of a window's logits (end-begin, V)."""
    rows = logits[first - 1 - begin:end - 1 - begin].float()  # the logits that predict each target
    targets = torch.tensor(list(ids[first:end]), dtype=torch.long, device=rows.device)
    nll = -torch.log_softmax(rows, dim=-1).gather(1, targets[:, None]).squeeze(1).double()
    return nll, rows.argmax(-1)


def evaluate_perplexity(models: dict[str, Scorer], token_ids: Sequence[int], window: int, stride: int,
                        reference: str | None = None,
                        progress: Callable[[int, int], None] | None = None) -> dict[str, PerplexityResult]:
    """Perplexity of every model over token_ids, windows of `window` tokens every `stride`; with
    `reference` (one of the names), each model's top-1 agreement with it, position by position."""
    if reference is not None and reference not in models:
        raise ValueError(f"reference {reference!r} is not one of the models {list(models)}")
    results = {name: PerplexityResult(name) for name in models}
    order = ([reference] if reference else []) + [n for n in models if n != reference]
    wins = sliding_windows(len(token_ids), window, stride)
    for i, (begin, end, first) in enumerate(wins):
        ref_top: torch.Tensor | None = None
        for name in order:
            logits = models[name](list(token_ids[begin:end]))
            nll, top = window_nll(logits, token_ids, begin, first, end)
            r = results[name]
            r.tokens += len(nll)
            r.nll_sum += float(nll.sum())
            r.windows += 1
            if name == reference:
                ref_top = top
            if ref_top is not None:
                r.agree = (r.agree or 0) + int((top.cpu() == ref_top.cpu()).sum())
            del logits
        if progress is not None:
            progress(i + 1, len(wins))
    return results
