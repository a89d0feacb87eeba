"""Llama-family decoder: Llama, Mistral, Qwen2 (qkv bias), Qwen3 (q/k RMSNorm), by flags.

The model sees the whole step as flattened tokens: input_ids (N,), positions (N,), and the step's
AttentionMetadata. Only attention looks at sequence boundaries; everything else is a plain
(N, hidden) computation. `forward` returns hidden states; `compute_logits` runs the LM head on the
rows the runner asks for (the last token of each sequence), never on every prompt token.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lmserve.attention import AttentionBackend, AttentionMetadata
from lmserve.config import ModelConfig
from lmserve.layers import dispatch
from lmserve.layers.linear import Linear, LinearBase, MergedLinear, check_shape, row_blocks
from lmserve.layers.norm import RMSNorm
from lmserve.layers.rotary import RotaryEmbedding
from lmserve.models.cpu_decode import CpuDecodePlan
from lmserve.models.moe import SparseMoE, expert_tensors


class Attention(nn.Module):
    """Self-attention with GQA/MQA over the paged cache."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend,
                 window: int | None, scale: float | None = None) -> None:
        """window: this layer's sliding window (None: the whole context; ModelConfig.layer_window);
        scale: the attention scale (default head_dim ** -0.5)."""
        super().__init__()
        self.h, self.hkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv_proj = MergedLinear(cfg.hidden_size, [self.h * self.d, self.hkv * self.d, self.hkv * self.d],
                                     bias=cfg.qkv_bias)
        self.o_proj = Linear(self.h * self.d, cfg.hidden_size)
        self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary = rotary
        self.backend = backend
        self.window = window
        self.scale = self.d ** -0.5 if scale is None else scale

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv_proj(x)  # (N, (H + 2 Hkv) d)
        q, k, v = self.qkv_proj.split(qkv)  # (N, H*d), (N, Hkv*d), (N, Hkv*d)
        q = q.view(n, self.h, self.d)  # (N, H, d)
        k = k.view(n, self.hkv, self.d)  # (N, Hkv, d)
        v = v.view(n, self.hkv, self.d)  # (N, Hkv, d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos_sin = meta.memo(("rope", id(self.rotary)), lambda: self.rotary.lookup(positions))
        fused = dispatch.fused_ops(q)
        if fused is not None:  # in place on the q/k views of the qkv output
            cos, sin = meta.memo(("rope2d", id(self.rotary)), lambda: (cos_sin[0].squeeze(1), cos_sin[1].squeeze(1)))
            if self.q_norm is None:  # q and k heads side by side in qkv: one call rotates both
                fused.rotary_(qkv[:, :(self.h + self.hkv) * self.d].view(n, self.h + self.hkv, self.d), cos, sin)
            else:
                q, k = fused.rotary_(q, cos, sin), fused.rotary_(k, cos, sin)
        else:
            q, k = self.rotary(positions, q, k, cos_sin)
        o = self.backend.forward(q, k, v, kv_cache, meta, self.scale, self.window)  # (N, H, d)
        return self.o_proj(o.reshape(n, self.h * self.d))  # (N, hidden)


ACTIVATIONS = {"silu": F.silu, "swish": F.silu,  # gated: down(act(gate(x)) * up(x))
               "gelu_pytorch_tanh": lambda t: F.gelu(t, approximate="tanh"),  # GeGLU (Gemma)
               "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}


class MLP(nn.Module):
    """SwiGLU (or GeGLU): down(act(gate(x)) * up(x)), gate and up fused into one matmul."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.hidden_act not in ACTIVATIONS:
            raise ValueError(f"activation {cfg.hidden_act!r} is not supported ({', '.join(ACTIVATIONS)})")
        self.act, self.silu = ACTIVATIONS[cfg.hidden_act], cfg.hidden_act in ("silu", "swish")
        self.gelu_tanh = cfg.hidden_act in ("gelu_pytorch_tanh", "gelu_tanh")
        self.gate_up_proj = MergedLinear(cfg.hidden_size, [cfg.intermediate_size] * 2)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # (N, 2I)
        fused = dispatch.fused_ops(gate_up)
        if fused is not None and self.silu:
            return self.down_proj(fused.silu_and_mul(gate_up))  # (N, hidden)
        if fused is not None and self.gelu_tanh and hasattr(fused, "gelu_tanh_and_mul"):  # the CPU module has it
            return self.down_proj(fused.gelu_tanh_and_mul(gate_up))
        gate, up = self.gate_up_proj.split(gate_up)  # (N, I) each
        return self.down_proj(self.act(gate) * up)  # (N, hidden)


def norm_into_stream(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A block's input norm in the fused residual form: x (the previous block's output) joins the
    residual stream (the first block starts it) -> (normed, stream), both (N, hidden)."""
    if residual is None:
        return norm(x), x
    return norm(x, residual)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend, i: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, rotary, backend, cfg.layer_window(i))
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module = SparseMoE(cfg) if cfg.layer_is_moe(i) else MLP(cfg)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = norm_into_stream(self.input_layernorm, x, residual)
        h = self.self_attn(h, positions, kv_cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    """Llama / Mistral / Qwen2 / Qwen3 causal LM over flattened tokens; Mixtral / Qwen3-MoE with routed
    experts in their sparse layers (models/moe.py)."""

    # checkpoint suffix -> (our module path suffix, shard index or None)
    stacked = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
        "w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1), "w2": ("down_proj", None),  # Mixtral's experts
    }

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = self.make_layers(cfg, backend)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size)

    def make_layers(self, cfg: ModelConfig, backend: AttentionBackend) -> nn.ModuleList:
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        return nn.ModuleList(DecoderLayer(cfg, rotary, backend, i) for i in range(cfg.num_layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: (N,) -> final hidden states (N, hidden)."""
        x = self.embed(input_ids)  # (N, hidden)
        plan = self.cpu_plan() if x.device.type == "cpu" and x.dtype == torch.float32 else None
        if plan is not None and plan.applies(x, kv_caches, meta):  # a decode step on the CPU: our kernels in a row
            x, residual = plan.run(x, positions, kv_caches, meta)
        else:
            residual = None
            for i, (layer, cache) in enumerate(zip(self.layers, kv_caches)):
                x, residual = layer(x, residual, positions, cache, meta.for_layer(i))  # its KV group's tables
        x, _ = self.norm(x, residual)
        return x

    plan_class: type[CpuDecodePlan] = CpuDecodePlan  # the CPU decode plan of this model's layer shape
    lora: Any = None  # with enable_lora: the step's adapter rows (lora.layers.LoRAContext, set by attach_lora;
    # the CPU plan reads it)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # (N,) -> (N, hidden)
        return self.embed_tokens(input_ids)

    def cpu_plan(self) -> CpuDecodePlan | None:
        """The CPU decode plan (models/cpu_decode.py), built on first use; None where it does not apply."""
        if not hasattr(self, "_cpu_plan"):
            self._cpu_plan = self.plan_class.build(self)
        return self._cpu_plan

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, hidden) -> (B, vocab) in float32: the LM head, or the tied embedding table (a quantized
        one, layers/quant.QuantEmbedding, is its own head)."""
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        if isinstance(self.embed_tokens, nn.Embedding):
            head = lambda h: F.linear(h, self.embed_tokens.weight)  # noqa: E731
            return (row_blocks(head, hidden) if getattr(self, "batch_invariant", False) else head(hidden)).float()
        return self.embed_tokens.head(hidden).float()

    def load_weights(self, weights) -> None:  # type: ignore[no-untyped-def]
        """Load (name, tensor) pairs named as HF checkpoints name them ('model.layers.0.self_attn.q_proj.weight');
        fused expert tensors (transformers 5's own MoE layout) split per expert first."""
        modules = dict(self.named_modules())
        seen: set[str] = set()
        for name, tensor in (pair for n, t in weights for pair in expert_tensors(n, t)):
            if "rotary_emb.inv_freq" in name:
                continue
            name = name.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.")  # Mixtral's MoE block
            if name == "embed_tokens.weight":
                if isinstance(self.embed_tokens, nn.Embedding):
                    check_shape(tensor, tuple(self.embed_tokens.weight.shape), "embed_tokens.weight", None)
                    self.embed_tokens.weight.data.copy_(tensor)
                else:  # a quantized table
                    self.embed_tokens.load(tensor)
                seen.add(name)
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding serves as the head
            path, kind = name.rsplit(".", 1)
            parent, leaf = path.rsplit(".", 1) if "." in path else ("", path)
            shard = None
            if leaf in self.stacked:
                leaf, shard = self.stacked[leaf]
            target = f"{parent}.{leaf}" if parent else leaf
            if not hasattr(modules.get(target), "load"):
                raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            module = modules[target]
            module.load(tensor, shard, kind)
            shards = [shard] if shard is not None else range(len(getattr(module, "sizes", [0])))
            seen.update(f"{target}.{kind}.{i}" for i in shards)
        missing = sorted(self._expected_loads() - seen)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:4]}")

    def _expected_loads(self) -> set[str]:
        out = {"embed_tokens.weight"}  # a quantized table (QuantEmbedding) is loaded under this name too
        for name, m in self.named_modules():
            if isinstance(m, (LinearBase, RMSNorm)) and not name.startswith("embed_tokens."):
                n = len(getattr(m, "sizes", [0]))
                out.update(f"{name}.weight.{i}" for i in range(n))
                if getattr(m, "bias", None) is not None:
                    out.update(f"{name}.bias.{i}" for i in range(n))
        return out
