"""Named real-model shapes, for the planner and for random-weight speed runs (no download needed)."""

from __future__ import annotations

from lmserve.config import ModelConfig

# name -> ModelConfig kwargs (architecture facts as published in each model's config.json)
SHAPES: dict[str, dict] = {
    "smollm2-135m": dict(architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576,
                         intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                         rope_theta=100000.0, rms_norm_eps=1e-5, max_position_embeddings=8192,
                         tie_word_embeddings=True),
    "qwen3-0.6b": dict(architecture="Qwen3ForCausalLM", vocab_size=151936, hidden_size=1024,
                       intermediate_size=3072, num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=40960,
                       tie_word_embeddings=True, qk_norm=True),
    "qwen2.5-1.5b": dict(architecture="Qwen2ForCausalLM", vocab_size=151936, hidden_size=1536,
                         intermediate_size=8960, num_layers=28, num_heads=12, num_kv_heads=2, head_dim=128,
                         rope_theta=1000000.0, max_position_embeddings=32768, tie_word_embeddings=True,
                         qkv_bias=True),
    "llama-3.2-1b": dict(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=2048,
                         intermediate_size=8192, num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
                         rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=True),
    "llama-3.1-8b": dict(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096,
                         intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                         rope_theta=500000.0, max_position_embeddings=131072),
    "llama-2-13b": dict(architecture="LlamaForCausalLM", vocab_size=32000, hidden_size=5120,
                        intermediate_size=13824, num_layers=40, num_heads=40, num_kv_heads=40, head_dim=128,
                        max_position_embeddings=4096),
    "mistral-7b": dict(architecture="MistralForCausalLM", vocab_size=32000, hidden_size=4096,
                       intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                       max_position_embeddings=32768),
    "gemma-3-270m": dict(architecture="Gemma3ForCausalLM", vocab_size=262144, hidden_size=640,
                         intermediate_size=2048, num_layers=18, num_heads=4, num_kv_heads=1, head_dim=256,
                         rope_theta=1000000.0, rope_local_theta=10000.0, rms_norm_eps=1e-6,
                         max_position_embeddings=32768, tie_word_embeddings=True, qk_norm=True,
                         sliding_window=512, query_pre_attn_scalar=256, hidden_act="gelu_pytorch_tanh",
                         layer_types=tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                           for i in range(18))),
    # not a real model: a 2-layer Qwen3-like shape for dry runs of GPU scripts on a CPU
    "debug-tiny": dict(architecture="Qwen3ForCausalLM", vocab_size=512, hidden_size=64, intermediate_size=128,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=2048,
                       tie_word_embeddings=True, qk_norm=True),
}

# latent-KV (MLA) models for the planner only: layers, heads, kv_lora_rank, rope dims, params
MLA_SHAPES: dict[str, dict] = {
    "deepseek-v2-lite": dict(num_layers=27, num_heads=16, kv_lora_rank=512, qk_rope_head_dim=64,
                             qk_nope_head_dim=128, v_head_dim=128, params=15.7e9, active_params=2.4e9,
                             vocab_size=102400, hidden_size=2048),
    "deepseek-v3": dict(num_layers=61, num_heads=128, kv_lora_rank=512, qk_rope_head_dim=64,
                        qk_nope_head_dim=128, v_head_dim=128, params=671e9, active_params=37e9,
                        vocab_size=129280, hidden_size=7168),
}


def shape_config(name: str) -> ModelConfig:
    if name not in SHAPES:
        raise ValueError(f"model shape {name!r} is unknown; known: {', '.join(sorted(SHAPES))}")
    return ModelConfig(**SHAPES[name])
