"""DeepSeek-V2 / V3 (text): multi-head latent attention over the paged latent cache, DeepSeek MoE.

- attention (`MLAttention`): the query through q_a_proj -> q_a_layernorm -> q_b_proj (or one q_proj
  when q_lora_rank is None); kv_a_proj_with_mqa gives the latent c_kv (normed by kv_a_layernorm) and
  one rope key k_pe shared by the heads. The cache row of a token is [c_kv, rotated k_pe]
  (ModelConfig.kv_entry_shape: (1, 1, kv_lora_rank + qk_rope_head_dim)), written with
  attention/mla.store. kv_b_proj's rows per head are W_UK (nope, L) and W_UV (v, L): decode steps
  attend in the latent (absorbed: W_UK folded into the query, W_UV after), prefill chunks expand
  per-head K / V for the step only (attention/mla.py); with the Triton backend, steps of decodes only
  run the latent decode kernel (attention/triton_mla.py), CUDA-graph batches included.
- rope on the qk_rope_head_dim channels: pairs (2i, 2i + 1) (V2; V3 with rope_interleave) or
  (i, i + d/2); yarn frequencies and their cos/sin factor as transformers computes them, and the
  softmax scale times mscale(factor, mscale_all_dim)^2.
- MLP: dense for the first first_k_dense_replace layers, else routed experts with DeepSeek's routing
  plus shared experts (models/moe.py).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from lmserve.attention import AttentionBackend, AttentionMetadata, mla
from lmserve.config import ModelConfig
from lmserve.layers.linear import Linear, MergedLinear, row_blocks
from lmserve.layers.norm import RMSNorm
from lmserve.models.cpu_decode import CpuDecodePlan
from lmserve.models.llama import MLP, LlamaForCausalLM, norm_into_stream
from lmserve.models.moe import KeepFloat32, SparseMoE

LORA_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: transformers builds them with the default eps


def _mscale(factor: float, mscale: float = 1.0) -> float:
    """Yarn's magnitude correction for a context stretched `factor` times."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(cfg: ModelConfig) -> dict | None:
    """The yarn rope_scaling dict, or None (default rope)."""
    sc = cfg.rope_scaling or {}
    return sc if sc.get("rope_type", sc.get("type")) == "yarn" else None


def _yarn_factor(cfg: ModelConfig, sc: dict) -> float:
    return float(sc.get("factor") or cfg.max_position_embeddings / sc["original_max_position_embeddings"])


def rope_frequencies(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """inv_freq (R/2,) float32 and the factor on cos / sin, for R = qk_rope_head_dim, in transformers'
    float32 arithmetic (default rope, or yarn: frequencies blended between interpolation and
    extrapolation by a linear ramp over the channels between beta_fast and beta_slow rotations)."""
    dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)  # (R/2,)
    sc = _yarn(cfg)
    if sc is None:
        return 1.0 / pos_freqs, 1.0
    factor, orig = _yarn_factor(cfg, sc), sc["original_max_position_embeddings"]
    attn = sc.get("attention_factor")
    if attn is None:
        m, m_all = sc.get("mscale"), sc.get("mscale_all_dim")
        attn = _mscale(factor, m) / _mscale(factor, m_all) if m and m_all else _mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(sc.get("beta_fast") or 32), correction_dim(sc.get("beta_slow") or 1)
    if sc.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / ((high + 0.001 if low == high else high) - low))
    extrapolate = 1 - ramp.clamp(0, 1)  # (R/2,): 1 keeps the original frequency
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv, float(attn)


def softmax_scale(cfg: ModelConfig) -> float:
    """(qk_nope + qk_rope) ** -0.5, times mscale(factor, mscale_all_dim)^2 under yarn (transformers'
    yarn_apply_mscale)."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    sc = _yarn(cfg)
    if sc is not None and sc.get("mscale_all_dim"):
        scale *= _mscale(_yarn_factor(cfg, sc), sc["mscale_all_dim"]) ** 2
    return scale


class MLARotary(KeepFloat32):
    """Rope on the rope channels of q and k, cos / sin computed per step from the positions in float32
    (inv_freq stays float32 in a bf16 model, as transformers keeps it)."""

    batch_invariant = False  # deterministic mode: cos / sin over fixed row blocks (layers.linear.row_blocks)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        inv, self.factor = rope_frequencies(cfg)
        self.register_buffer("inv_freq", inv, persistent=False)  # (R/2,)
        self.interleave = cfg.rope_interleave

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each (N, R/2) float32, yarn's factor included. Once per step, shared by all layers."""
        def table(pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            freqs = pos.float()[:, None] * self.inv_freq[None, :]  # (n, R/2)
            return freqs.cos() * self.factor, freqs.sin() * self.factor
        return row_blocks(table, positions) if self.batch_invariant else table(positions)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x (..., R) with cos / sin broadcasting to (..., R/2) -> rotated, in x's dtype. Interleaved
        pairs come out as [first of each pair, second of each pair] (transformers' V3 layout; V2's
        complex product keeps them interleaved): q and k are permuted alike, so q . k is the same."""
        xf = x.float()
        x1, x2 = (xf[..., 0::2], xf[..., 1::2]) if self.interleave else xf.chunk(2, dim=-1)  # (..., R/2) each
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class MLAttention(nn.Module):
    """Multi-head latent attention over the paged latent cache (see the module docstring)."""

    float_linears = ("kv_b_proj",)  # read as W_UK / W_UV: kept float under weight quantization

    def __init__(self, cfg: ModelConfig, rotary: MLARotary, backend: AttentionBackend) -> None:
        super().__init__()
        self.h, self.nope, self.r = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.v, self.l = cfg.v_head_dim, cfg.kv_lora_rank
        q_width = self.h * (self.nope + self.r)
        lora = cfg.q_lora_rank
        # the two projections of the layer input, fused: q_a_proj (or q_proj) | kv_a_proj_with_mqa
        self.qkv_a_proj = MergedLinear(cfg.hidden_size, [lora or q_width, self.l + self.r])
        self.q_a_layernorm = RMSNorm(lora, LORA_NORM_EPS) if lora else None
        self.q_b_proj = Linear(lora, q_width) if lora else None
        self.kv_a_layernorm = RMSNorm(self.l, LORA_NORM_EPS)
        self.kv_b_proj = Linear(self.l, self.h * (self.nope + self.v))
        self.o_proj = Linear(self.h * self.v, cfg.hidden_size)
        self.rotary = rotary
        self.scale = softmax_scale(cfg)
        # deterministic mode (a backend with every step as token rows, cpu or triton's invariant one): each
        # token attends alone, in torch ops whose shapes follow the token only (no CUDA-graph batch then)
        self.token_at_a_time = getattr(backend, "rows_per_seq", 0) is None
        # the Triton backend (the one that takes CUDA-graph batches): decode steps run the latent kernel
        self.triton = bool(getattr(backend, "supports_cuda_graphs", False)) and not self.token_at_a_time

    def latent_cache(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """The layer's cache (1, S, 1, L + R) as (S, L + R) rows (a view)."""
        if not isinstance(kv_cache, torch.Tensor) or kv_cache.dim() != 4 or kv_cache.shape[0] != 1 \
                or tuple(kv_cache.shape[2:]) != (1, self.l + self.r):
            got = tuple(kv_cache.shape) if isinstance(kv_cache, torch.Tensor) else type(kv_cache).__name__
            raise ValueError(f"MLA needs a latent cache (1, slots, 1, {self.l + self.r}) (ModelConfig.kv_entry_shape), "
                             f"got {got}; a quantized kv_cache_dtype is not supported with MLA")
        return kv_cache[0, :, 0]

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        q, kv = self.qkv_a_proj.split(self.qkv_a_proj(x))  # (N, q_lora or H (nope + R)), (N, L + R)
        if self.q_b_proj is not None:
            q = self.q_b_proj(self.q_a_layernorm(q))  # (N, H (nope + R))
        q = q.view(n, self.h, self.nope + self.r)
        q_nope, q_pe = q.split([self.nope, self.r], dim=-1)  # (N, H, nope), (N, H, R)
        c_kv = self.kv_a_layernorm(kv[:, :self.l])  # (N, L)
        cos, sin = meta.memo(("mla_rope", id(self.rotary)), lambda: self.rotary.lookup(positions))  # (N, R/2) each
        q_pe = self.rotary.rotate(q_pe, cos[:, None], sin[:, None])  # (N, H, R)
        k_pe = self.rotary.rotate(kv[:, self.l:], cos, sin)  # (N, R)
        cache = self.latent_cache(kv_cache)  # (S, L + R)
        w = self.kv_b_proj.weight.view(self.h, self.nope + self.v, self.l)
        w_uk, w_uv = w[:, :self.nope], w[:, self.nope:]  # (H, nope, L), (H, v, L)
        if self.triton and (meta.static_decode or meta.all_decode):  # one token a sequence: row i = sequence i
            from lmserve.attention import triton_mla
            triton_mla.store(cache, c_kv, k_pe, meta.slot_mapping)
            q_lat = torch.einsum("nhd,hdl->nhl", q_nope, w_uk)  # (B, H, L)
            o_lat = triton_mla.decode(q_lat, q_pe, cache, meta.block_tables, meta.seq_lens, self.scale,
                                      meta.block_size)  # (B, H, L)
            o = torch.einsum("nhl,hvl->nhv", o_lat, w_uv)  # (B, H, v)
        else:
            if meta.static_decode:  # (the engine then serves eagerly: graphs.py)
                raise ValueError("MLA runs a static (CUDA-graph) decode batch on the Triton backend only, "
                                 "not in deterministic mode")
            mla.store(cache, c_kv, k_pe, meta.slot_mapping)
            o = mla.mla_attention(q_nope, q_pe, cache, meta, w_uk, w_uv, self.scale,
                                  token_at_a_time=self.token_at_a_time)  # (N, H, v)
        return self.o_proj(o.reshape(n, self.h * self.v))  # (N, hidden)


class DeepseekDecoderLayer(nn.Module):
    """norm -> MLA -> add; norm -> dense MLP or DeepSeek MoE -> add (the fused residual form of llama.py)."""

    def __init__(self, cfg: ModelConfig, rotary: MLARotary, backend: AttentionBackend, i: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAttention(cfg, rotary, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module = SparseMoE(cfg) if cfg.layer_is_moe(i) else MLP(cfg)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = norm_into_stream(self.input_layernorm, x, residual)  # (N, hidden) each
        h = self.self_attn(h, positions, kv_cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class NoDecodePlan(CpuDecodePlan):
    """The CPU decode plan runs Llama-shaped layers; MLA layers take the module path."""

    @classmethod
    def build(cls, model):  # type: ignore[no-untyped-def]
        return None


class DeepseekForCausalLM(LlamaForCausalLM):
    """DeepSeek-V2 / V3 causal LM (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM), HF names."""

    stacked = {
        "q_a_proj": ("qkv_a_proj", 0), "q_proj": ("qkv_a_proj", 0), "kv_a_proj_with_mqa": ("qkv_a_proj", 1),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }
    plan_class = NoDecodePlan

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        if not cfg.is_mla:
            raise ValueError(f"{cfg.architecture}: kv_lora_rank must be positive (DeepSeek's MLA)")
        super().__init__(cfg, backend)
        # graphs.graphs_wanted: deterministic mode attends a token at a time on host lengths (no graph)
        self.cuda_graphs = getattr(backend, "rows_per_seq", 0) is not None

    def make_layers(self, cfg: ModelConfig, backend: AttentionBackend) -> nn.ModuleList:
        rotary = MLARotary(cfg)
        return nn.ModuleList(DeepseekDecoderLayer(cfg, rotary, backend, i) for i in range(cfg.num_layers))

    def load_weights(self, weights) -> None:  # type: ignore[no-untyped-def]
        """HF names (fused expert tensors, transformers 5's state_dict, split by the Llama loader); layers past
        num_layers (V3's multi-token-prediction module, model.layers.61) skipped, as transformers does."""
        def renamed():  # type: ignore[no-untyped-def]
            for name, tensor in weights:
                parts = name.split(".")
                if name.startswith("model.layers.") and int(parts[2]) >= self.cfg.num_layers:
                    continue
                yield name, tensor  # (fused experts: split by LlamaForCausalLM.load_weights)
        super().load_weights(renamed())

    def _expected_loads(self) -> set[str]:
        out = super()._expected_loads()
        out.update(f"{name}.e_score_correction_bias.0" for name, m in self.named_modules()
                   if getattr(m, "e_score_correction_bias", None) is not None)
        return out
