"""The model's recommended sampling defaults, as vLLM applies them (`--generation-config`): the
sampling fields of the checkpoint's generation_config.json that differ from transformers' defaults
(temperature, top_p, top_k, min_p, repetition_penalty, and max_new_tokens, which caps max_tokens),
then `override_generation_config` on top. They fill what a request leaves unset, on the server and
for `LLM.generate` without SamplingParams; "vllm" turns them off (the library's own defaults)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from lmserve.config import EngineConfig

FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")
# transformers' GenerationConfig defaults: a file that repeats one sets nothing (vLLM reads its diff)
HF_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}


def _file(config: EngineConfig) -> Path | None:
    """The generation_config.json to read: the model folder's (auto; a GGUF file has none), or the one
    in the folder `generation_config` names; None for 'vllm'."""
    if config.generation_config == "vllm":
        return None
    if config.generation_config == "auto":
        from lmserve.models.loader import resolve_model
        src = resolve_model(config.model)
        return src.path / "generation_config.json" if src.kind == "hf" else None
    path = Path(config.generation_config)
    path = path / "generation_config.json" if path.is_dir() else path
    if not path.is_file():
        raise ValueError(f"generation_config: {config.generation_config!r} is not 'auto', 'vllm', or a folder "
                         "holding generation_config.json")
    return path


def sampling_defaults(config: EngineConfig) -> dict[str, Any]:
    """{SamplingParams field: value} the model recommends (max_new_tokens as max_tokens); ValueError
    naming the field for a value no request could take."""
    found: dict[str, Any] = {}
    path = _file(config)
    if path is not None and path.is_file():
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"generation_config: {path} is not readable JSON ({e})") from None
        found = {k: raw[k] for k in FIELDS if raw.get(k) is not None and raw[k] != HF_DEFAULTS.get(k)}
    override = config.override_generation_config or {}
    unknown = sorted(set(override) - set(FIELDS))
    if unknown:
        raise ValueError(f"override_generation_config: {unknown[0]!r} is not one of {', '.join(FIELDS)}")
    found |= override
    out = {("max_tokens" if k == "max_new_tokens" else k): v for k, v in found.items()}
    from lmserve.sequence import SamplingParams  # (checks every value as a request's would be)
    for k, v in out.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"generation_config.{k}: {v!r} is not a number")
        try:
            SamplingParams(**{k: v})
        except ValueError as e:
            raise ValueError(f"generation_config.{e}") from None
    return out
