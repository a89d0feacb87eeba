"""Model registry: the checkpoint's `architectures` name -> our model class."""

from __future__ import annotations

from torch import nn

from lmserve.attention import AttentionBackend
from lmserve.config import ModelConfig
from lmserve.models.llama import LlamaForCausalLM

_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}

# GGUF `general.architecture` -> HF architectures name
GGUF_ARCHS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
              "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def build_model(cfg: ModelConfig, backend: AttentionBackend) -> nn.Module:
    """Instantiate the registered class for cfg.architecture (weights uninitialised)."""
    cls = _REGISTRY.get(cfg.architecture)
    if cls is None:
        raise ValueError(f"architecture {cfg.architecture!r} is not supported; "
                         f"supported: {', '.join(supported_architectures())}")
    return cls(cfg, backend)
