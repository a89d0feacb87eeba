"""DeepSeek-V2 / V3 (models/deepseek.py) against HF transformers on tiny random configs: MLA with and
without q LoRA, interleaved and rotate-half rope, yarn scaling with mscale / mscale_all_dim, dense
first layers, routed experts with group-limited (V2) and bias-corrected grouped (V3) routing plus
shared experts; logits, greedy generation with chunked prefill, prefix caching and preemption; a
cache of kv_lora_rank + qk_rope_head_dim per token and layer; decode steps in the latent (absorbed)
form; the Triton latent decode kernel in the engine (TRITON_INTERPRET=1), padded static batches included."""

from __future__ import annotations

import os
import shutil

os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton MLA decode kernel on the CPU

import pytest  # noqa: E402
import torch  # noqa: E402

from lmserve import LLM, SamplingParams  # noqa: E402
from lmserve.attention import mla  # noqa: E402
from lmserve.models import moe  # noqa: E402
from tests.test_models_vs_hf import CONFIGS, PROMPTS, greedy_matches_hf, hf_greedy  # noqa: E402

L, R = 16, 8  # kv_lora_rank, qk_rope_head_dim
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}


def _config(name: str):  # type: ignore[no-untyped-def]
    import transformers as tf
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=L, qk_nope_head_dim=16,
                  qk_rope_head_dim=R, v_head_dim=12, max_position_embeddings=256, first_k_dense_replace=1,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    if name == "v2":  # V2-Lite's shape: no q LoRA; 2 groups of 2 experts, the best group kept; yarn
        return tf.DeepseekV2Config(**common, q_lora_rank=None, n_routed_experts=4, n_shared_experts=1,
                                   num_experts_per_tok=2, topk_method="group_limited_greedy", n_group=2, topk_group=1,
                                   routed_scaling_factor=1.5, rope_parameters=YARN)
    if name == "v3":  # q LoRA; 4 groups of 2 experts, 2 kept, sigmoid + correction bias; interleaved rope
        return tf.DeepseekV3Config(**common, q_lora_rank=32, n_routed_experts=8, n_shared_experts=2,
                                   num_experts_per_tok=2, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                   norm_topk_prob=True, rope_interleave=True)
    # V3 with rotate-half rope, one expert group, every layer sparse, no renormalisation
    return tf.DeepseekV3Config(**{**common, "first_k_dense_replace": 0}, q_lora_rank=24, n_routed_experts=4,
                               n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
                               norm_topk_prob=False, rope_interleave=False)


def make_deepseek(name: str, path):  # type: ignore[no-untyped-def]
    """A tiny random HF DeepSeek model saved to `path` (all weights random, norms around 1, the V3
    correction bias non-zero); returns the HF model."""
    import transformers as tf
    torch.manual_seed({"v2": 0, "v3": 1}.get(name, 2))
    model = tf.AutoModelForCausalLM.from_config(_config(name), attn_implementation="eager").float().eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.normal_(1.0, 0.2) if p.dim() == 1 else p.normal_(0, 0.08)
        for bname, b in model.named_buffers():
            if "e_score_correction_bias" in bname:
                b.uniform_(-0.3, 0.3)
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.fixture(scope="module")
def built(tmp_path_factory):  # type: ignore[no-untyped-def]
    """name -> (folder, HF model), each built once for the module."""
    done: dict = {}

    def get(name: str):  # type: ignore[no-untyped-def]
        if name not in done:
            path = tmp_path_factory.mktemp(name)
            done[name] = (path, make_deepseek(name, path))
        return done[name]
    return get


@pytest.fixture(params=["v2", "v3", "v3_neox"])
def ds(request, built):  # type: ignore[no-untyped-def]
    return (request.param, *built(request.param))


@pytest.fixture
def v3(built):  # type: ignore[no-untyped-def]
    return built("v3")


def test_config_and_layers(ds):  # type: ignore[no-untyped-def]
    from lmserve.models.loader import hf_config
    name, path, _ = ds
    cfg = hf_config(path)
    assert cfg.is_mla and cfg.kv_entry_shape == (1, 1, L + R) and cfg.kv_elems_per_token == 3 * (L + R)
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.v_head_dim) == (4, 24, 12)
    want = {"v2": (None, "softmax", "group_limited_greedy", 2, 1, 1.5, False, True),
            "v3": (32, "sigmoid", "noaux_tc", 4, 2, 2.5, True, True),
            "v3_neox": (24, "sigmoid", "noaux_tc", 1, 1, 2.5, False, False)}[name]
    assert (cfg.q_lora_rank, cfg.scoring_func, cfg.topk_method, cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor,
            cfg.norm_topk_prob, cfg.rope_interleave) == want
    model = LLM(str(path), kv_cache_memory="4MiB").engine.model
    kinds = [type(layer.mlp).__name__ for layer in model.layers]
    assert kinds == (["SparseMoE"] * 3 if name == "v3_neox" else ["MLP", "SparseMoE", "SparseMoE"])
    assert model.layers[1].mlp.shared_experts is not None
    assert model.cpu_plan() is None  # the CPU decode plan steps aside
    gate = model.layers[1].mlp.gate
    assert (gate.e_score_correction_bias is not None) == name.startswith("v3")


# the real checkpoints' config.json (DeepSeek-V2-Lite, DeepSeek-V3), rope_scaling in the legacy format
V2_LITE = {"architectures": ["DeepseekV2ForCausalLM"], "vocab_size": 102400, "hidden_size": 2048,
           "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
           "num_attention_heads": 16, "num_key_value_heads": 16, "n_shared_experts": 2, "n_routed_experts": 64,
           "routed_scaling_factor": 1.0,
           "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
           "topk_method": "greedy", "n_group": 1, "topk_group": 1, "num_experts_per_tok": 6, "moe_layer_freq": 1,
           "first_k_dense_replace": 1, "norm_topk_prob": False, "scoring_func": "softmax", "hidden_act": "silu",
           "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "rope_theta": 10000,
           "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                            "original_max_position_embeddings": 4096, "type": "yarn"}}
V3 = {**V2_LITE, "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 7168, "intermediate_size": 18432,
      "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
      "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5, "q_lora_rank": 1536,
      "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
      "norm_topk_prob": True, "scoring_func": "sigmoid", "vocab_size": 129280,
      "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                       "original_max_position_embeddings": 4096, "type": "yarn"}}


@pytest.mark.parametrize("raw", [V2_LITE, V3], ids=["v2-lite", "v3"])
def test_real_config_json(raw):  # type: ignore[no-untyped-def]
    """The real configs parse; yarn's frequencies, cos / sin factor and softmax scale equal transformers'."""
    import transformers as tf
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import yarn_apply_mscale

    from lmserve.config import ModelConfig
    from lmserve.models.deepseek import rope_frequencies, softmax_scale
    cfg = ModelConfig.from_hf(raw)
    v3 = raw is V3
    assert cfg.kv_entry_shape == (1, 1, 576) and cfg.kv_elems_per_token * 2 == (70_272 if v3 else 27 * 576 * 2)
    assert [cfg.layer_is_moe(i) for i in range(4)] == ([False] * 3 + [True] if v3 else [False] + [True] * 3)
    assert (cfg.q_lora_rank, cfg.topk_method, cfg.scoring_func) == \
        ((1536, "noaux_tc", "sigmoid") if v3 else (None, "greedy", "softmax"))
    hf_cls = tf.DeepseekV3Config if v3 else tf.DeepseekV2Config
    hf = hf_cls(**{k: v for k, v in raw.items() if k not in ("architectures", "moe_layer_freq", "scoring_func",
                                                             "topk_method")})
    inv, factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    ours, our_factor = rope_frequencies(cfg)
    assert torch.equal(ours, inv) and our_factor == factor
    assert softmax_scale(cfg) == pytest.approx(yarn_apply_mscale(hf.rope_parameters, 192 ** -0.5), rel=1e-12)
    assert softmax_scale(cfg) > 1.4 * 192 ** -0.5  # mscale_all_dim's correction is there


def test_config_validation():
    from lmserve.config import ModelConfig
    base = dict(architecture="DeepseekV3ForCausalLM", vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=2,
                num_heads=2, num_kv_heads=2, head_dim=8, kv_lora_rank=4, qk_nope_head_dim=4, qk_rope_head_dim=4,
                v_head_dim=4, num_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1, topk_method="noaux_tc")
    ModelConfig(**base)
    for bad, field in [(dict(qk_rope_head_dim=3), "qk_rope_head_dim"), (dict(v_head_dim=0), "v_head_dim"),
                       (dict(q_lora_rank=0), "q_lora_rank"), (dict(n_group=3), "n_group"),
                       (dict(topk_group=3), "topk_group"), (dict(num_experts_per_tok=3), "num_experts_per_tok"),
                       (dict(topk_method="best"), "topk_method"), (dict(scoring_func="relu"), "scoring_func"),
                       (dict(n_group=4, topk_group=2), "noaux_tc"),
                       (dict(rope_scaling={"rope_type": "llama3"}), "rope_scaling"),
                       (dict(qkv_bias=True), "attention_bias")]:
        with pytest.raises(ValueError, match=field):
            ModelConfig(**{**base, **bad})
    with pytest.raises(ValueError, match="shared experts"):  # still refused outside DeepSeek
        ModelConfig.from_hf({"architectures": ["Qwen2MoeForCausalLM"], "num_attention_heads": 2, "hidden_size": 8,
                             "vocab_size": 8, "intermediate_size": 8, "num_hidden_layers": 1, "num_experts": 4,
                             "num_experts_per_tok": 2, "shared_expert_intermediate_size": 8})


def test_logits_match_hf(ds):  # type: ignore[no-untyped-def]
    _, path, hf = ds
    llm = LLM(str(path), kv_cache_memory="16MiB")
    for prompt in PROMPTS:
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0]  # (T, V)
        assert (llm.score(prompt) - ref).abs().max() < 1e-4, len(prompt)
    decoded = llm.score(PROMPTS[3], decode_from=4)  # one absorbed decode step a token after 4 prefilled
    assert (decoded - ref).abs().max() < 1e-4
    assert llm.stats().used_blocks == 0


@pytest.mark.parametrize("mode", list(CONFIGS))
@pytest.mark.parametrize("name", ["v2", "v3"])
def test_greedy_matches_hf(built, name, mode):  # type: ignore[no-untyped-def]
    greedy_matches_hf(*built(name), mode, n_new=16)


def test_cache_holds_the_latent_only(v3):  # type: ignore[no-untyped-def]
    """The engine's KV tensors: one (1, slots, 1, L + R) row a token and layer, and the budget divides by
    exactly (L + R) x layers x 4 bytes a token."""
    from lmserve.kv.cache import KVCache
    path, _ = v3
    llm = LLM(str(path), kv_cache_memory="1MiB", block_size=16)
    kv = llm.engine.kv_cache
    slots = kv.num_blocks * 16
    assert [tuple(t.shape) for t in kv.layers] == [(1, slots, 1, L + R)] * 3
    per_token = (L + R) * 3 * 4
    assert sum(t.numel() * t.element_size() for t in kv.layers) == slots * per_token
    assert KVCache.bytes_per_block(llm.engine.model_config, 16, torch.float32) == 16 * per_token
    assert per_token == mla.latent_bytes_per_token(3, L, R, 4) and kv.num_blocks == 2**20 // (16 * per_token)
    with pytest.raises(ValueError, match="kv_cache_dtype"):  # a quantized cache holds K / V per head, not latents
        LLM(str(path), kv_cache_memory="1MiB", kv_cache_dtype="int8").generate([[5, 6, 7]], use_tqdm=False)


def test_decode_steps_attend_in_the_latent(v3, monkeypatch):  # type: ignore[no-untyped-def]
    """Per-head K / V are built for prefill chunks only: every one-token step takes the absorbed form."""
    path, hf = v3
    calls: list[tuple[str, int]] = []
    for form in ("absorbed_attention", "expanded_attention"):
        real = getattr(mla, form)
        monkeypatch.setattr(mla, form, lambda qn, *a, _f=form, _r=real: calls.append((_f, qn.shape[0])) or _r(qn, *a))
    llm = LLM(str(path), kv_cache_memory="4MiB")
    prompt = PROMPTS[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(hf, prompt, 6)
    assert calls.count(("expanded_attention", len(prompt))) == 3  # the prompt, once a layer
    assert calls.count(("absorbed_attention", 1)) == 5 * 3  # every decode step, every layer
    assert len(calls) == 3 + 15


def test_routing_exercises_groups_and_bias(v3):  # type: ignore[no-untyped-def]
    """The tiny configs really test what they claim: group limiting and the correction bias change
    which experts some tokens get (else the HF comparisons could not tell them apart)."""
    path, _ = v3
    gate = LLM(str(path), kv_cache_memory="1MiB").engine.model.layers[1].mlp.gate
    x = torch.randn(200, 64, generator=torch.Generator().manual_seed(0))
    logits = gate(x)  # (200, E) float32
    _, ids = moe.route(logits, 2, True, "sigmoid", "noaux_tc", 4, 2, 2.5, gate.e_score_correction_bias)
    _, no_bias = moe.route(logits, 2, True, "sigmoid", "noaux_tc", 4, 2, 2.5, None)
    _, no_groups = moe.route(logits, 2, True, "sigmoid", "greedy", 4, 2, 2.5, gate.e_score_correction_bias)
    same = lambda a, b: (a.sort(-1).values == b.sort(-1).values).all(-1)  # noqa: E731
    assert (~same(ids, no_bias)).any() and (~same(ids, no_groups)).any()
    _, v2_ids = moe.route(logits[:, :4], 2, False, "softmax", "group_limited_greedy", 2, 1)
    assert (v2_ids // 2 == v2_ids[:, :1] // 2).all()  # both experts from the one group kept
    assert (~same(v2_ids, moe.route(logits[:, :4], 2, False)[1])).any()


def test_fused_expert_checkpoint(v3, tmp_path):  # type: ignore[no-untyped-def]
    """A checkpoint holding transformers 5's fused expert tensors (its state_dict as is) loads too."""
    from safetensors.torch import save_file
    path, hf = v3
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert state["model.layers.1.mlp.experts.gate_up_proj"].shape == (8, 64, 64)  # (E, 2I, hidden)
    shutil.copy(path / "config.json", tmp_path / "config.json")
    save_file(state, str(tmp_path / "model.safetensors"))
    llm = LLM(str(tmp_path), kv_cache_memory="4MiB")
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPTS[1]])).logits[0]
    assert (llm.score(PROMPTS[1]) - ref).abs().max() < 1e-4


def test_int8_keeps_router_and_kv_b_float(v3):  # type: ignore[no-untyped-def]
    from lmserve.layers.linear import Linear
    from lmserve.layers.quant import Int8Linear
    from lmserve.models.moe import Float32Router
    path, hf = v3
    llm = LLM(str(path), kv_cache_memory="4MiB", quantization="int8")
    layer = llm.engine.model.layers[1]
    assert type(layer.mlp.gate) is Float32Router and type(layer.self_attn.kv_b_proj) is Linear
    assert type(layer.self_attn.qkv_a_proj) is Int8Linear and type(layer.mlp.experts[0].down_proj) is Int8Linear
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPTS[1]])).logits[0]
    rel = (llm.score(PROMPTS[1]) - ref).norm(dim=-1) / ref.norm(dim=-1)  # (T,) per position
    # top-k routing is discontinuous: a position whose experts flip under rounding moves far (one of 44
    # here, by 0.66); the rest stay within int8's few percent
    assert rel.median() < 0.05 and (rel < 0.1).float().mean() > 0.9, rel


def test_bf16_keeps_router_and_rope_float32(v3):  # type: ignore[no-untyped-def]
    path, hf = v3
    model = LLM(str(path), kv_cache_memory="4MiB", dtype="bfloat16").engine.model
    gate, rotary = model.layers[1].mlp.gate, model.layers[0].self_attn.rotary
    assert model.layers[1].mlp.experts[0].down_proj.weight.dtype == torch.bfloat16
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == rotary.inv_freq.dtype == torch.float32
    assert torch.equal(gate.e_score_correction_bias, hf.model.layers[1].mlp.gate.e_score_correction_bias)


def test_triton_latent_decode_in_the_engine(v3, monkeypatch):  # type: ignore[no-untyped-def]
    """attention_backend='triton': decode steps run the Triton latent kernel (under the interpreter
    here), also through the padded static batches CUDA graphs replay; greedy tokens equal HF's."""
    pytest.importorskip("triton", reason="triton is not installed: the MLA decode kernel is not tested")
    from lmserve.attention import triton_mla
    path, hf = v3
    launches: list[int] = []
    real = triton_mla.decode
    monkeypatch.setattr(triton_mla, "decode", lambda q, *a, **k: launches.append(q.shape[0]) or real(q, *a, **k))
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[1][:9]]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (5, 3, 4)]
    llm = LLM(str(path), kv_cache_memory="4MiB", attention_backend="triton")
    out = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [hf_greedy(hf, p, sp.max_tokens) for p, sp in zip(prompts, params)]
    assert launches and set(launches) <= {1, 2, 3}
    launches.clear()
    llm.engine.runner.enable_graphs([1, 4], llm.engine.max_model_len, capture=False)
    out = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [hf_greedy(hf, p, sp.max_tokens) for p, sp in zip(prompts, params)]
    graphs = llm.engine.runner.graphs
    assert graphs.replays > 0 and graphs.padded_rows > 0 and 4 in launches
