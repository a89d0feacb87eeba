"""Build the proposer an EngineConfig asks for."""

from __future__ import annotations

import torch

from lmserve.config import EngineConfig, ModelConfig


def kv_share(config: EngineConfig, budget: int, target_bytes_per_token: float,
             draft: ModelConfig | None = None) -> int:
    """The bytes of the engine's one KV budget that the proposer's own cache takes: its share by bytes per
    position, so that it holds as many positions as the target's pool (a draft model's cache, an EAGLE
    head's KV); 0 for n-gram, which keeps none."""
    from pathlib import Path

    from lmserve.kv.cache import KVCache
    dtype = config.torch_dtype
    if config.speculative_method == "draft" and draft is not None:
        per = KVCache.bytes_per_block(draft, config.block_size, dtype) / config.block_size
    elif config.speculative_method == "eagle" and (Path(str(config.draft_model)) / "eagle_config.json").is_file():
        from lmserve.spec.eagle import head_config
        from lmserve.spec.eagle_native import HeadKV
        c = head_config(config.draft_model)
        per = HeadKV.bytes_per_position(c.num_kv_heads, c.head_dim, dtype)  # its one layer's K, V
        # beyond the target's positions (in blocks of the same size): a chain of drafts a running sequence
        # (their entries go after drafting)
        slack = min(budget // 8, int(config.max_num_seqs * (config.num_speculative_tokens + 1) * per))
        return slack + int((budget - slack) * per / (per + target_bytes_per_token))
    else:
        return 0
    return int(budget * per / (per + target_bytes_per_token))


def build_proposer(config: EngineConfig, target: ModelConfig, kv_budget: int,
                   draft: tuple[ModelConfig, torch.nn.Module] | None = None,
                   target_model: torch.nn.Module | None = None, max_model_len: int = 0):  # type: ignore[no-untyped-def]
    """The n-gram proposer; the draft-model proposer over the draft (config, model) the engine loaded,
    with a KV cache of kv_budget bytes (the draft's share of the engine's one budget); or the EAGLE
    proposer, its head read from config.draft_model, over target_model's features."""
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
    if config.speculative_method == "eagle":
        from pathlib import Path

        from lmserve.spec.eagle import load_head
        from lmserve.spec.eagle_proposer import EagleProposer
        path = Path(str(config.draft_model))
        if not (path / "eagle_config.json").is_file():
            raise ValueError(f"draft_model: {path} holds no EAGLE head (eagle_config.json); "
                             "make one with lmserve train-draft --method eagle")
        if target_model is None:
            raise ValueError("speculative_method='eagle' needs the target model")
        return EagleProposer(load_head(path), target_model, target, config, max_model_len, kv_budget)
    raise ValueError(f"unknown speculative_method {config.speculative_method!r}")
