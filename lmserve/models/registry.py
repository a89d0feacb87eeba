"""Model registry: the checkpoint's `architectures` name -> our model class; and whole-model weight
quantization (`quantize_model`: every float Linear swapped for a layers/quant.py layer)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from lmserve.attention import AttentionBackend
from lmserve.config import ModelConfig
from lmserve.layers.linear import Linear, LinearBase
from lmserve.layers.quant import SCHEMES, Fp8Linear, GroupQuantLinear, Int4Linear, Int8Linear
from lmserve.models.deepseek import DeepseekForCausalLM
from lmserve.models.gemma3 import Gemma3ForCausalLM
from lmserve.models.llama import LlamaForCausalLM

_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "MixtralForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekForCausalLM,
}

# GGUF `general.architecture` -> HF architectures name
GGUF_ARCHS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
              "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM"}


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def build_model(cfg: ModelConfig, backend: AttentionBackend) -> nn.Module:
    """Instantiate the registered class for cfg.architecture (weights uninitialised)."""
    cls = _REGISTRY.get(cfg.architecture)
    if cls is None:
        raise ValueError(f"architecture {cfg.architecture!r} is not supported; "
                         f"supported: {', '.join(supported_architectures())}")
    return cls(cfg, backend)


class QuantEmbedding(nn.Module):
    """An embedding table [vocab, hidden] kept as a quantized linear, which also serves as the tied LM
    head (`head`): a lookup dequantizes only the rows it reads."""

    def __init__(self, head: LinearBase) -> None:
        super().__init__()
        self.head = head

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (N,) -> (N, hidden)
        return self.head.dequantize(ids)

    def load(self, tensor: Any, shard: int | None = None, kind: str = "weight") -> None:
        self.head.load(tensor, shard, kind)


def default_group_size(in_features: int, preferred: int = 128) -> int:
    """`preferred`, or the largest power of two below it (at least 32) that divides in_features; else
    in_features itself (one group per row)."""
    g = preferred
    while g > 32 and in_features % g:
        g //= 2
    return g if in_features % g == 0 else in_features


def make_quantized(scheme: str, in_features: int, sizes: int | Sequence[int], bias: bool = False,
                   group_size: int | None = None, outlier_cols: torch.Tensor | None = None) -> LinearBase:
    """An empty layer of `scheme` (int8, int4, fp8) with this shape; load() fills it. group_size: int8 /
    int4 scales per group of that many input columns, halved (down to 32) until it divides in_features
    (default_group_size), so that one value serves every layer; None: int8 one scale per output row
    (symmetric per channel), int4 groups of 128; -1: one group per row."""
    if scheme == "int8":
        group = None if group_size in (None, -1) else default_group_size(in_features, group_size)
        return Int8Linear(in_features, sizes, bias, group, outlier_cols=outlier_cols)
    if scheme == "int4":
        group = in_features if group_size == -1 else default_group_size(in_features, group_size or 128)
        return Int4Linear(in_features, sizes, bias, group)
    if scheme == "fp8":
        return Fp8Linear(in_features, sizes, bias)
    raise ValueError(f"quantization scheme must be one of {', '.join(SCHEMES)}, got {scheme!r}")


@torch.no_grad()
def quantize_model(model: nn.Module, scheme: str, group_size: int | None = None, *, head: str | None = "int8",
                   act_absmax: dict[str, torch.Tensor] | None = None, threshold: float = 6.0,
                   copy: bool = True) -> nn.Module:
    """Swap every float Linear of `model` for a `scheme` layer of the same shape, in place; the LM head
    (`lm_head`, or a tied `embed_tokens` table) gets `head` instead (None: it stays float). group_size
    (make_quantized) applies to every layer of `scheme`, the head included when it has the same scheme.

    act_absmax (int8): per-linear max |input| per column (`input_absmax`); columns above `threshold`
    stay float. copy: quantize the weights the float layers hold; False: leave the new layers empty,
    for load_weights to quantize each checkpoint tensor as it arrives."""
    # routers (SparseMoE.gate, as vLLM keeps them) and MLA's kv_b_proj (read as W_UK / W_UV) stay float
    keep = {f"{n}.{leaf}" for n, m in model.named_modules() for leaf in getattr(m, "float_linears", ())}
    for name, m in list(model.named_modules()):
        s = head if name == "lm_head" else scheme
        if not isinstance(m, Linear) or s is None or name in keep:
            continue
        cols = None
        if act_absmax is not None and s == "int8" and name in act_absmax:
            cols = torch.nonzero(act_absmax[name] > threshold).flatten()
        layer = make_quantized(s, m.in_features, m.sizes, m.bias is not None, group_size if s == scheme else None, cols)
        if copy:
            layer.load(m.weight.detach().float().cpu())
            if m.bias is not None:
                layer.load(m.bias.detach().float().cpu(), kind="bias")
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, layer.to(m.weight.device, m.weight.dtype))
    emb = getattr(model, "embed_tokens", None)
    if head is not None and getattr(model, "lm_head", 0) is None and isinstance(emb, nn.Embedding):
        group = group_size if head == scheme else None
        table = make_quantized(head, emb.embedding_dim, [emb.num_embeddings], group_size=group)
        if copy:
            table.load(emb.weight.detach().float().cpu())
        model.embed_tokens = QuantEmbedding(table.to(emb.weight.device, emb.weight.dtype))
    return model


def use_cpu_kernels(model: nn.Module, on: bool = True) -> None:
    """Let the integer layers of `model` multiply a few rows at a time with our CPU kernel (layers/cpu_native.py)."""
    for m in model.modules():
        if isinstance(m, GroupQuantLinear):
            m.cpu_kernel = on


@torch.no_grad()
def input_absmax(model: nn.Module, run: Callable[[], object]) -> dict[str, torch.Tensor]:
    """max |x| of each input column of every float Linear of `model` while `run()` runs (e.g. scoring
    calibration text): what quantize_model(..., act_absmax=) reads to find outlier columns."""
    seen: dict[str, torch.Tensor] = {}

    def hook(name: str) -> Callable[..., None]:
        def fn(module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
            a = args[0].detach().abs().reshape(-1, args[0].shape[-1]).amax(0).float().cpu()  # (in,)
            seen[name] = torch.maximum(seen[name], a) if name in seen else a
        return fn

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if isinstance(m, Linear)]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return seen
