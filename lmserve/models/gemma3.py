"""Gemma 3 (text): the Llama-family blocks with Gemma's differences, on the same flattened tokens.

- local and global layers (`ModelConfig.layer_types`): local layers attend to the last
  `sliding_window` tokens and rotate with their own rope base (`rope_local_theta`), global layers see
  the whole context with `rope_theta` (and its scaling);
- "sandwich" norms: each block's output is normed before it joins the residual stream (four RMSNorms a
  layer), and q / k are normed per head;
- Gemma's RMSNorm multiplies by (1 + weight): stored here as an ordinary RMSNorm weight with the 1
  added at load (HF checkpoints; llama.cpp's GGUF files already hold 1 + weight);
- embeddings scaled by sqrt(hidden_size) (the tied LM head reads the unscaled table);
- GeGLU (tanh-approximate GELU) in the MLP; attention scaled by query_pre_attn_scalar ** -0.5; an
  optional soft cap on the final logits.
"""

from __future__ import annotations

import math
import torch
from torch import nn

from lmserve.attention import AttentionBackend, AttentionMetadata
from lmserve.config import ModelConfig
from lmserve.layers.norm import RMSNorm
from lmserve.layers.rotary import RotaryEmbedding
from lmserve.models.cpu_decode import GemmaDecodePlan
from lmserve.models.llama import MLP, Attention, LlamaForCausalLM, norm_into_stream

# norms whose Gemma weight w means (1 + w): the HF names' last two parts
NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm",
         "q_norm", "k_norm", "norm")


class Gemma3DecoderLayer(nn.Module):
    """norm -> attention -> norm, added; norm -> GeGLU -> norm, added. With the fused residual form
    (forward takes the previous block's normed output and the residual stream) the add of one block
    and the input norm of the next are one add_rmsnorm."""

    def __init__(self, cfg: ModelConfig, i: int, rotary: RotaryEmbedding, backend: AttentionBackend) -> None:
        super().__init__()
        scale = cfg.query_pre_attn_scalar ** -0.5 if cfg.query_pre_attn_scalar else None
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, rotary, backend, cfg.layer_window(i), scale)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = norm_into_stream(self.input_layernorm, x, residual)  # (N, hidden) each
        h = self.post_attention_layernorm(self.self_attn(h, positions, kv_cache, meta))
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3 text model (Gemma3ForCausalLM), weights named as HF names them."""

    plan_class = GemmaDecodePlan
    offset_norms, norm_offset = NORMS, 1.0  # HF's w is our weight - 1 (quant/checkpoint.model_state writes w)

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        if cfg.layer_types is None:
            raise ValueError("Gemma 3 needs layer_types (which layers are local)")
        super().__init__(cfg, backend)
        self.embed_scale = math.sqrt(cfg.hidden_size)

    def make_layers(self, cfg: ModelConfig, backend: AttentionBackend) -> nn.ModuleList:
        rope_global = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        rope_local = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings,
                                     cfg.rope_local_theta or cfg.rope_theta, None)
        return nn.ModuleList(Gemma3DecoderLayer(cfg, i, rope_local if cfg.layer_window(i) else rope_global, backend)
                             for i in range(cfg.num_layers))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # (N, hidden)
        return x * torch.tensor(self.embed_scale, dtype=x.dtype)  # HF: the scale cast to the weights' dtype

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)  # (B, vocab) float32
        cap = self.cfg.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def load_weights(self, weights) -> None:  # type: ignore[no-untyped-def]
        """HF's names and conventions (GGUF files' 1 + w come back as w in GGUFFile.weights): 1 is added
        to every norm weight."""
        def shifted():  # type: ignore[no-untyped-def]
            for name, tensor in weights:
                parts = name.split(".")
                if len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in NORMS:
                    tensor = tensor.float() + 1
                yield name, tensor
        super().load_weights(shifted())
