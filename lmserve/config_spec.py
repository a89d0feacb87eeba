"""vLLM's `speculative_config` dict read into EngineConfig's speculation fields."""

from __future__ import annotations

from typing import Any


# vLLM's speculative_config keys -> EngineConfig fields; its methods -> ours
_SPEC_KEYS = {"method": "speculative_method", "model": "draft_model", "num_speculative_tokens": "num_speculative_tokens",
              "prompt_lookup_max": "ngram_max", "prompt_lookup_min": "ngram_min"}
_SPEC_METHODS = {"ngram": "ngram", "draft_model": "draft", "draft": "draft", "eagle": "eagle"}


def speculative_fields(spec: Any, method_given: str | None) -> dict[str, Any]:
    """The EngineConfig fields a vLLM speculative_config dict sets; ValueError naming the key."""
    if not isinstance(spec, dict):
        raise ValueError(f"speculative_config must be a dict, got {spec!r}")
    if method_given is not None:
        raise ValueError("speculative_config: give it or speculative_method, not both")
    unknown = sorted(set(spec) - set(_SPEC_KEYS) - {"draft_tensor_parallel_size"})
    if unknown:
        raise ValueError(f"speculative_config.{unknown[0]}: not supported (keys: {', '.join(_SPEC_KEYS)})")
    if spec.get("draft_tensor_parallel_size", 1) != 1:
        raise ValueError("speculative_config.draft_tensor_parallel_size: the draft runs on one rank (1)")
    method = spec.get("method") or ("draft" if spec.get("model") else None)  # (vLLM: a model alone is a draft)
    if method not in _SPEC_METHODS:
        raise ValueError(f"speculative_config.method: {method!r} is not one of {', '.join(_SPEC_METHODS)}")
    out = {_SPEC_KEYS[k]: v for k, v in spec.items() if k in _SPEC_KEYS}
    out["speculative_method"] = _SPEC_METHODS[method]
    return out
