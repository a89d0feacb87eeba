"""Embeddings from a decoder model (vLLM's pooling runner, `LLM.embed`, `/v1/embeddings`).

A pooling request runs its prompt like any other (chunked, batched with generating requests, through
the prefix cache when it pools the last token) and the runner keeps the final hidden states (after the
model's final norm: HF's `last_hidden_state`) its pooling needs; when the prompt's last chunk has run,
the embedding is made (`embedding`) and the request ends. Pooling: `last` (the last prompt token's
state: decoder embedding models, Qwen3-Embedding, e5-mistral, gte-Qwen2, vLLM's default for them) or
`mean` (every prompt position's, averaged); then optionally the first `dimensions` (Matryoshka) and an
L2 normalisation (on by default, as vLLM's embed task does).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

POOLING_TYPES = ("last", "mean")


@dataclass
class PoolingParams:
    """How a request's prompt becomes one vector (vLLM's PoolingParams, embed task)."""

    pooling_type: str = "last"
    normalize: bool | None = True  # None: the default (True)
    dimensions: int | None = None  # keep the first this many (Matryoshka models), before normalising
    truncate_prompt_tokens: int | None = None  # run the prompt's last k tokens (as SamplingParams': -1 the context)

    def validate(self, hidden_size: int, matryoshka: bool = True, sizes: tuple[int, ...] = ()) -> None:
        """ValueError naming the field. matryoshka: the model was trained so that its embeddings may be
        cut (else `dimensions` is refused, as vLLM does: a cut vector would be a poor one); sizes: the
        cuts it was trained for (any, when empty)."""
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type: must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")
        if self.normalize is None:  # vLLM's None: the model's default (normalised)
            self.normalize = True
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize: must be true, false or None, got {self.normalize!r}")
        d = self.dimensions
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or not 1 <= d <= hidden_size):
            raise ValueError(f"dimensions: must be an integer in [1, {hidden_size}] (the model's hidden size), got {d!r}")
        if d is not None and not matryoshka:
            raise ValueError("dimensions: this model does not support Matryoshka embeddings (its config.json has no "
                             "is_matryoshka or matryoshka_dimensions): a cut embedding would be a poor one")
        if d is not None and sizes and d not in sizes:
            raise ValueError(f"dimensions: this model's embeddings may be cut to {', '.join(map(str, sizes))} only, "
                             f"got {d}")


class PoolingState:
    """One sequence's pooled hidden states while its prompt runs, owned by the runner: the last row, or the
    running sum of the rows (restarted when a recomputed prompt starts again at 0), then the embedding."""

    def __init__(self, params: PoolingParams, prompt_len: int) -> None:
        self.params, self.prompt_len = params, prompt_len
        self.pooled: torch.Tensor | None = None  # (H,): the last row; for mean the float64 sum of the rows so far
        self.embedding: list[float] | None = None

    def add(self, start: int, hidden: torch.Tensor) -> None:
        """hidden (n, H): the final states of prompt positions start .. start + n - 1 (a chunk). Chunks come
        in order; a prompt recomputed after a preemption starts again at 0 (mean pooling never takes a prefix
        -cache hit; a swapped-out one goes on where it was), which restarts the sum: no row counts twice."""
        n = min(hidden.shape[0], self.prompt_len - start)
        if n <= 0:
            return
        if self.params.pooling_type == "last":
            if start + n == self.prompt_len:
                self.pooled = hidden[n - 1].float().clone()
        else:
            part = hidden[:n].double().sum(dim=0)  # (H,)
            self.pooled = part if start == 0 or self.pooled is None else self.pooled + part
        if start + n == self.prompt_len:
            self.embedding = self.finish()

    def finish(self) -> list[float]:
        """The embedding: pooled (float32), cut to `dimensions`, L2-normalised."""
        assert self.pooled is not None
        v = self.pooled if self.params.pooling_type == "last" else (self.pooled / self.prompt_len).float()  # (H,)
        if self.params.dimensions is not None:
            v = v[:self.params.dimensions]
        if self.params.normalize:
            v = torch.nn.functional.normalize(v, dim=0)
        return v.cpu().tolist()
