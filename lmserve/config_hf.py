"""ModelConfig's fields from an HF config.json, read as transformers reads it.

A key a checkpoint leaves out takes the default of its architecture's transformers config class, not
a guess shared by all: transformers drops keys equal to the class default when it saves, so a missing
key means that default (Gemma 3's tied embeddings and attention scale 256 ** -0.5, Qwen3-MoE's
unnormalised router weights). An option that would change the math and that our layers do not
implement is refused here, naming it, never ignored.
"""

from __future__ import annotations

from typing import Any

QWEN_WINDOWED = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")  # max_window_layers: the layers from it on slide
_QWEN = {"max_position_embeddings": 32768, "num_key_value_heads": 32, "sliding_window": 4096}
_DEEPSEEK = {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}
# What each architecture's transformers config class fills in for a key config.json leaves out, where that
# is not the fallback model_fields gives every architecture (checked against the classes by
# tests/test_hf_config.py::test_a_missing_key_reads_as_transformers_class_default). rope_theta: the last resort,
# after config.json's own rope_parameters
CLASS_DEFAULTS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {"bos_token_id": 1, "eos_token_id": 2},
    "MistralForCausalLM": {"max_position_embeddings": 131072, "num_key_value_heads": 8, "bos_token_id": 1,
                           "eos_token_id": 2},
    "Qwen2ForCausalLM": _QWEN,
    "Qwen3ForCausalLM": {**_QWEN, "head_dim": 128},
    "Gemma3ForCausalLM": {"max_position_embeddings": 131072, "num_key_value_heads": 4, "head_dim": 256,
                          "hidden_activation": "gelu_pytorch_tanh", "bos_token_id": 2, "eos_token_id": 1},
    "MixtralForCausalLM": {"max_position_embeddings": 131072, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
                           "rope_theta": 1e6, "num_local_experts": 8, "num_experts_per_tok": 2, "bos_token_id": 1,
                           "eos_token_id": 2},
    "Qwen3MoeForCausalLM": {**_QWEN, "num_key_value_heads": 4, "num_local_experts": 128, "num_experts_per_tok": 8,
                            "moe_intermediate_size": 768},
    "DeepseekV2ForCausalLM": {**_DEEPSEEK, "n_routed_experts": 64, "n_shared_experts": 2, "moe_intermediate_size": 1407,
                              "bos_token_id": 1, "eos_token_id": 2},
    "DeepseekV3ForCausalLM": {**_DEEPSEEK, "max_position_embeddings": 4096, "n_routed_experts": 256, "n_shared_experts": 1,
                              "moe_intermediate_size": 2048, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4,
                              "first_k_dense_replace": 3, "bos_token_id": 0, "eos_token_id": 1},
}


def model_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig(**model_fields(cfg)) for an HF config.json dict; a config without a field the model's
    shapes need, or not an object, is a ValueError saying so (it was a KeyError / AttributeError)."""
    if not isinstance(cfg, dict):
        raise ValueError(f"config.json: must be a JSON object, got {type(cfg).__name__}")
    try:
        return _model_fields(cfg)
    except KeyError as e:
        raise ValueError(f"config.json: has no {e.args[0]!r}, which the model's shapes need") from None
    except (TypeError, AttributeError) as e:
        raise ValueError(f"config.json: a field of the wrong type ({e})") from None


def _model_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
    defaults = CLASS_DEFAULTS.get(arch, {})
    cfg = {**{k: v for k, v in defaults.items() if k != "rope_theta"}, **cfg}  # (an explicit null stays null)
    heads = cfg["num_attention_heads"]
    hidden = cfg["hidden_size"]
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    rope_theta = cfg.get("rope_theta")
    rope_params = cfg.get("rope_parameters") or {}
    if rope_theta is None:
        rope_theta = rope_params.get("rope_theta", defaults.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling")
    if scaling is None and rope_params.get("rope_type", "default") != "default":
        scaling = rope_params
    gemma = arch.startswith("Gemma3")
    window = _window(cfg, arch)
    extra: dict[str, Any] = {"layer_types": _layer_types(cfg, arch, window)}
    if gemma:  # local / global layers with their own rope bases (Gemma3TextConfig)
        per_type = rope_params if "full_attention" in rope_params else {}
        full, local = per_type.get("full_attention") or {}, per_type.get("sliding_attention") or {}
        rope_theta = full.get("rope_theta", cfg.get("rope_theta") or 1_000_000.0)
        scaling = full if full.get("rope_type", "default") != "default" else cfg.get("rope_scaling")
        extra.update(rope_local_theta=float(local.get("rope_theta", cfg.get("rope_local_base_freq", 10_000.0))),
                     query_pre_attn_scalar=cfg.get("query_pre_attn_scalar", 256),  # Gemma3TextConfig's default
                     final_logit_softcapping=cfg.get("final_logit_softcapping"))
        if cfg.get("attn_logit_softcapping") is not None:
            raise ValueError("attn_logit_softcapping is not supported (Gemma 2's attention soft cap)")
        if cfg.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention is not supported (causal attention only)")
        if local.get("rope_type", "default") != "default":
            raise ValueError("rope_parameters.sliding_attention: rope scaling on the local layers is not supported")
    if not gemma and extra["layer_types"] is not None and "sliding_attention" not in extra["layer_types"]:
        extra["layer_types"], window = None, None  # every layer attends to the whole context (Gemma 3's layer
        # kinds stay: they pick each layer's rope too)
    if cfg.get("mlp_bias"):
        raise ValueError("mlp_bias is not supported (MLPs without biases only)")
    qkv_bias = cfg.get("attention_bias", arch.startswith("Qwen2"))  # Qwen2: q, k, v biases, o_proj none
    if qkv_bias and not arch.startswith("Qwen2"):
        raise ValueError("attention_bias is not supported here (it biases o_proj too; only Qwen2's q / k / v "
                         "biases are implemented)")
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    mla = arch in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
    if mla:
        extra.update(_deepseek_fields(cfg, arch))
    elif experts:
        if cfg.get("shared_expert_intermediate_size") or cfg.get("n_shared_experts"):
            raise ValueError("MoE with shared experts is not supported yet")
        mixtral = arch.startswith("Mixtral")  # always renormalised; Qwen-MoE's default: not
        extra.update(num_experts=int(experts), num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                     moe_intermediate_size=cfg.get("moe_intermediate_size"),
                     norm_topk_prob=mixtral or bool(cfg.get("norm_topk_prob", False)),
                     decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
                     mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()))
    return dict(
        **extra,
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=heads if mla else cfg.get("num_key_value_heads") or heads,  # MLA: no K / V heads
        head_dim=extra["qk_nope_head_dim"] + extra["qk_rope_head_dim"] if mla  # MLA: q / k width a head
        else cfg.get("head_dim") or hidden // heads,
        rope_theta=float(rope_theta),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=cfg.get("tie_word_embeddings", gemma),  # Gemma3TextConfig ties by default
        qkv_bias=qkv_bias,
        qk_norm=arch.startswith(("Qwen3", "Gemma3")),
        is_matryoshka=bool(cfg.get("is_matryoshka") or cfg.get("matryoshka_dimensions")),
        matryoshka_dimensions=tuple(int(d) for d in cfg.get("matryoshka_dimensions") or ()),
        sliding_window=window,
        rope_scaling=scaling,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        hidden_act=cfg.get("hidden_act") or cfg.get("hidden_activation") or "silu",
    )


def _window(cfg: dict[str, Any], arch: str) -> int | None:
    """The attention window as arch's transformers code reads it (None: no layer slides): Mistral and
    Mixtral on every layer (Mistral's default 4096, Mixtral's none), Qwen2 / Qwen3 / Qwen3-MoE only with
    use_sliding_window (default false), Gemma 3 its local layers (default 4096); Llama's and DeepSeek's
    code has none (a sliding_window key there is ignored, as transformers ignores it)."""
    if arch.startswith(("Gemma3", "Mistral")):
        return cfg.get("sliding_window", 4096)
    if arch.startswith("Mixtral"):
        return cfg.get("sliding_window")
    if arch.startswith(("Qwen2", "Qwen3")):
        return cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
    return None


def _layer_types(cfg: dict[str, Any], arch: str, window: int | None) -> tuple[str, ...] | None:
    """Which layers use the sliding window: config.json's layer_types when it has them; else Gemma 3's
    pattern (every sliding_window_pattern-th layer global), or Qwen2 / Qwen3's (the layers from
    max_window_layers on, 28 by default; Qwen3-MoE windows every layer); else None (every layer alike)."""
    n = cfg["num_hidden_layers"]
    if cfg.get("layer_types"):
        return tuple(cfg["layer_types"])
    if arch.startswith("Gemma3"):
        every = cfg.get("sliding_window_pattern", 6)
        return tuple("full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n))
    if arch.startswith(QWEN_WINDOWED) and window is not None:
        first = cfg.get("max_window_layers", 28)
        return tuple("sliding_attention" if i >= first else "full_attention" for i in range(n))
    return None


def _deepseek_fields(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """ModelConfig's MLA and DeepSeek-MoE fields from a DeepseekV2 / V3 config.json (absent keys take
    transformers' defaults for the architecture; V2's router never renormalises, as transformers' does not)."""
    v3 = arch == "DeepseekV3ForCausalLM"
    if not v3 and cfg.get("norm_topk_prob"):  # DeepSeek's code would renormalise, transformers' never does
        raise ValueError("norm_topk_prob: true is not supported for DeepSeek-V2 (transformers' router ignores it)")
    return dict(
        q_lora_rank=cfg.get("q_lora_rank"), kv_lora_rank=int(cfg["kv_lora_rank"]),
        qk_nope_head_dim=int(cfg["qk_nope_head_dim"]), qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
        v_head_dim=int(cfg["v_head_dim"]), rope_interleave=bool(cfg.get("rope_interleave", True)) if v3 else True,
        num_experts=int(cfg.get("n_routed_experts") or 0),
        num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0),
        moe_intermediate_size=cfg.get("moe_intermediate_size"), n_shared_experts=int(cfg.get("n_shared_experts") or 0),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)) if v3 else False,
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 2.5 if v3 else 1.0)),
        scoring_func=cfg.get("scoring_func") or ("sigmoid" if v3 else "softmax"),
        topk_method=cfg.get("topk_method") or ("noaux_tc" if v3 else "greedy"),
        n_group=int(cfg.get("n_group") or 1), topk_group=int(cfg.get("topk_group") or 1),
        first_k_dense_replace=int(cfg.get("first_k_dense_replace") or 0), moe_layer_freq=int(cfg.get("moe_layer_freq") or 1))
