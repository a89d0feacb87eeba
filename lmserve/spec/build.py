"""Build the proposer an EngineConfig asks for."""

from __future__ import annotations

from lmserve.config import EngineConfig, ModelConfig


def build_proposer(config: EngineConfig, target: ModelConfig, kv_budget: int):  # type: ignore[no-untyped-def]
    if config.speculative_method == "ngram":
        from lmserve.spec.ngram import NgramProposer
        return NgramProposer(config.ngram_min, config.ngram_max)
    if config.speculative_method == "draft":
        from lmserve.engine import load_model
        from lmserve.spec.draft import DraftModelProposer
        dcfg = config.replace(model=config.draft_model or config.model)
        cfg, model, _ = load_model(dcfg, config.draft_num_layers)
        if cfg.vocab_size != target.vocab_size:
            raise ValueError(f"draft_model: vocabulary {cfg.vocab_size} differs from the target's {target.vocab_size}")
        # the draft's cache holds about as many tokens as the target's
        budget = max(1, kv_budget * cfg.kv_elems_per_token // target.kv_elems_per_token)
        return DraftModelProposer(model, cfg, budget, config)
    raise ValueError(f"unknown speculative_method {config.speculative_method!r}")
