"""Build the proposer an EngineConfig asks for."""

from __future__ import annotations

import torch

from lmserve.config import EngineConfig, ModelConfig


def build_proposer(config: EngineConfig, target: ModelConfig, kv_budget: int,
                   draft: tuple[ModelConfig, torch.nn.Module] | None = None):  # type: ignore[no-untyped-def]
    """The n-gram proposer, or the draft-model proposer over the draft (config, model) the engine
    loaded, with a KV cache of kv_budget bytes (the draft's share of the engine's one budget)."""
    if config.speculative_method == "ngram":
        from lmserve.spec.ngram import NgramProposer
        return NgramProposer(config.ngram_min, config.ngram_max)
    if config.speculative_method == "draft":
        from lmserve.spec.draft import DraftModelProposer
        if draft is None:
            raise ValueError("speculative_method='draft' needs the draft model loaded by the engine")
        cfg, model = draft
        if cfg.vocab_size != target.vocab_size:
            raise ValueError(f"draft_model: vocabulary {cfg.vocab_size} differs from the target's {target.vocab_size}")
        return DraftModelProposer(model, cfg, kv_budget, config)
    raise ValueError(f"unknown speculative_method {config.speculative_method!r}")
