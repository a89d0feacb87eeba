"""config.json read as transformers reads it (lmserve/config_hf.py): layers that slide only from
max_window_layers on, the defaults a checkpoint leaves out (its architecture's, from transformers' own
config class), and options our layers do not implement refused by name. Each case compares logits
or greedy tokens with HF transformers on the same saved checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lmserve import LLM, SamplingParams
from lmserve.config import ModelConfig

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)
IDS = [(i * 37 + 11) % 120 + 3 for i in range(30)]


def build(cfg, path: Path, seed: int = 0):  # type: ignore[no-untyped-def]
    """A seeded random HF model saved at path (weights at a scale where attention is not uniform)."""
    import transformers as tf
    torch.manual_seed(seed)
    cfg._attn_implementation = "eager"
    model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(path)
    return model


def without(path: Path, *keys: str):  # type: ignore[no-untyped-def]
    """Drop keys from the saved config.json (as transformers drops its class defaults when it saves);
    returns HF's model loaded back from that file (which then takes the class defaults)."""
    import transformers as tf
    f = path / "config.json"
    cfg = json.loads(f.read_text())
    for k in keys:
        cfg.pop(k, None)
    f.write_text(json.dumps(cfg))
    return tf.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()


def assert_logits_equal(path: Path, hf) -> None:  # type: ignore[no-untyped-def]
    ours = LLM(str(path), kv_cache_memory="16MiB").score(IDS)  # (T, V)
    with torch.no_grad():
        ref = hf(torch.tensor([IDS])).logits[0].float()
    assert (ours - ref).abs().max().item() < 1e-4


def test_qwen2_slides_only_from_max_window_layers(tmp_path):  # type: ignore[no-untyped-def]
    """Qwen2, use_sliding_window, window 8, max_window_layers 1: layer 0 attends to everything, layer 1
    to its window, as HF's layer_types say (before, both slid: greedy wrong from the first token on a
    37-token prompt)."""
    import transformers as tf
    cfg = tf.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    hf = build(cfg, tmp_path)
    mc = ModelConfig.from_hf(json.loads((tmp_path / "config.json").read_text()))
    assert [mc.layer_window(i) for i in range(2)] == [None, 8]
    prompt = list(range(3, 40))
    out = LLM(str(tmp_path), kv_cache_memory="16MiB", block_size=4).generate(
        [prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert out.outputs[0].token_ids == ref
    # the same without layer_types in the file: read from max_window_layers (28 by default: no layer slides)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.pop("layer_types", None)
    assert [ModelConfig.from_hf(raw).layer_window(i) for i in range(2)] == [None, 8]
    raw.pop("max_window_layers")
    assert ModelConfig.from_hf(raw).sliding_window is None


def test_qwen3_moe_without_norm_topk_prob_keeps_raw_router_weights(tmp_path):  # type: ignore[no-untyped-def]
    """Qwen3MoeConfig's default is not to renormalise the k router weights (before: renormalised,
    logits off by 5e-3 from the first position)."""
    import transformers as tf
    cfg = tf.Qwen3MoeConfig(**{**COMMON, "intermediate_size": 96}, num_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=32, head_dim=16, norm_topk_prob=False, tie_word_embeddings=False)
    build(cfg, tmp_path, seed=5)
    hf = without(tmp_path, "norm_topk_prob")
    assert hf.config.norm_topk_prob is False
    assert_logits_equal(tmp_path, hf)


@pytest.mark.parametrize("key", ["query_pre_attn_scalar", "tie_word_embeddings"])
def test_gemma3_without_a_key_takes_gemma3s_default(tmp_path, key):  # type: ignore[no-untyped-def]
    """Gemma3TextConfig's defaults: attention scale 256 ** -0.5 (before: head_dim ** -0.5, logits off
    by 1.6), tied embeddings (before: "checkpoint is missing lm_head.weight")."""
    import transformers as tf
    cfg = tf.Gemma3TextConfig(**{**COMMON, "intermediate_size": 96}, head_dim=16, sliding_window=8,
                              query_pre_attn_scalar=256, layer_types=["sliding_attention", "full_attention"])
    cfg.architectures = ["Gemma3ForCausalLM"]
    build(cfg, tmp_path, seed=1)
    hf = without(tmp_path, key)
    assert_logits_equal(tmp_path, hf)


@pytest.mark.parametrize("arch,key", [("LlamaForCausalLM", "attention_bias"), ("LlamaForCausalLM", "mlp_bias"),
                                      ("Qwen3ForCausalLM", "attention_bias")])
def test_biases_our_layers_lack_are_refused_by_name(arch, key):  # type: ignore[no-untyped-def]
    """Llama's and Qwen3's attention_bias biases o_proj too, mlp_bias the MLP: refused naming the option
    (before: "Linear has no bias" from deep in the loader)."""
    raw = {"architectures": [arch], **{k: v for k, v in COMMON.items() if k != "pad_token_id"}, key: True}
    with pytest.raises(ValueError, match=f"^{key}"):
        ModelConfig.from_hf(raw)
    assert ModelConfig.from_hf({**raw, "architectures": ["Qwen2ForCausalLM"], key: key == "attention_bias"}).qkv_bias


def test_deepseek_v2_router_renormalisation_is_refused(tmp_path):  # type: ignore[no-untyped-def]
    """transformers' DeepseekV2 router never reads norm_topk_prob, DeepSeek's own code honours it: a V2 file
    saying true is refused by name (before, renormalised silently: logits off HF's); false loads and
    equals HF; V3's default (true) stays."""
    import transformers as tf

    from tests.test_deepseek import V2_LITE, V3, make_deepseek
    with pytest.raises(ValueError, match="^norm_topk_prob"):
        ModelConfig.from_hf({**V2_LITE, "norm_topk_prob": True})
    make_deepseek("v2", tmp_path)
    hf = tf.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager", dtype=torch.float32).eval()
    assert_logits_equal(tmp_path, hf)
    v3 = {k: v for k, v in V3.items() if k != "norm_topk_prob"}
    assert ModelConfig.from_hf(v3).norm_topk_prob is True and tf.DeepseekV3Config().norm_topk_prob is True


@pytest.mark.parametrize("change,key", [({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
                                        ({"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0},
                                                              "full_attention": {"rope_type": "default"}}},
                                         "rope_parameters.sliding_attention")])
def test_gemma3_options_our_layers_lack_are_refused(change, key):  # type: ignore[no-untyped-def]
    """Gemma 3 options that change the math and that gemma3.py does not implement (before: ignored)."""
    raw = {"architectures": ["Gemma3ForCausalLM"], **{k: v for k, v in COMMON.items() if k != "pad_token_id"},
           "head_dim": 16, "sliding_window": 8}
    ModelConfig.from_hf(raw)
    with pytest.raises(ValueError, match=f"^{key}"):
        ModelConfig.from_hf({**raw, **change})


LONG_IDS = list(range(3, 40))  # past the window of 8


@pytest.mark.parametrize("case", ["qwen3_moe_on", "qwen3_key_missing", "llama_with_a_window_key", "mistral_key_missing",
                                  "gemma3_all_global"])
def test_windows_are_where_transformers_code_has_them(tmp_path, case):  # type: ignore[no-untyped-def]
    """Qwen3-MoE with use_sliding_window windows every layer (we followed Qwen3's max_window_layers: none);
    a Qwen config without use_sliding_window has no window (its default is false; we windowed from
    max_window_layers on); Llama's code has no window whatever its config says (we windowed every
    layer); Mistral without the key takes 4096; a Gemma 3 with no local layer runs (refused before)."""
    import transformers as tf
    small = dict(COMMON, num_hidden_layers=3)
    if case == "qwen3_moe_on":
        cfg = tf.Qwen3MoeConfig(**small, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                use_sliding_window=True, sliding_window=8)
        drop: tuple[str, ...] = ()
    elif case == "qwen3_key_missing":
        cfg, drop = tf.Qwen3Config(**small, sliding_window=8, max_window_layers=1), ("use_sliding_window", "layer_types")
    elif case == "llama_with_a_window_key":
        cfg, drop = tf.LlamaConfig(**small), ()
        cfg.sliding_window = 8
    elif case == "mistral_key_missing":
        cfg, drop = tf.MistralConfig(**small, sliding_window=4096), ("sliding_window",)
    else:
        cfg = tf.Gemma3TextConfig(**small, head_dim=16, layer_types=["full_attention"] * 3, sliding_window=8)
        cfg.architectures, drop = ["Gemma3ForCausalLM"], ()
    build(cfg, tmp_path)
    if case == "qwen3_key_missing":  # a window in the file, but no switch: transformers' default (off)
        raw = json.loads((tmp_path / "config.json").read_text())
        (tmp_path / "config.json").write_text(json.dumps({**raw, "sliding_window": 8, "max_window_layers": 1}))
    hf = without(tmp_path, *drop)
    ours = LLM(str(tmp_path), kv_cache_memory="16MiB")
    windows = [ours.engine.model_config.layer_window(i) for i in range(3)]
    assert windows == {"qwen3_moe_on": [8] * 3, "mistral_key_missing": [4096] * 3}.get(case, [None] * 3)
    with torch.no_grad():
        ref = hf(torch.tensor([LONG_IDS])).logits[0].float()
    assert (ours.score(LONG_IDS) - ref).abs().max().item() < 1e-4


SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4)
CLASSES = {  # each architecture's transformers config, as a small model of it would save it
    "LlamaForCausalLM": ("LlamaConfig", {}), "MistralForCausalLM": ("MistralConfig", {"num_key_value_heads": 2}),
    "Qwen2ForCausalLM": ("Qwen2Config", {"num_key_value_heads": 2, "use_sliding_window": True, "sliding_window": 8,
                                         "max_window_layers": 2}),
    "Qwen3ForCausalLM": ("Qwen3Config", {"num_key_value_heads": 2, "use_sliding_window": True, "sliding_window": 8,
                                         "max_window_layers": 2}),
    "Gemma3ForCausalLM": ("Gemma3TextConfig", {}), "MixtralForCausalLM": ("MixtralConfig", {"num_key_value_heads": 2}),
    "Qwen3MoeForCausalLM": ("Qwen3MoeConfig", {}),
    "DeepseekV2ForCausalLM": ("DeepseekV2Config", {"num_key_value_heads": 4, "n_routed_experts": 8,
                                                   "num_experts_per_tok": 2}),
    "DeepseekV3ForCausalLM": ("DeepseekV3Config", {"num_key_value_heads": 4}),
}


@pytest.mark.parametrize("arch", sorted(CLASSES))
def test_a_missing_key_reads_as_transformers_class_default(arch):  # type: ignore[no-untyped-def]
    """Each key a config.json may leave out, left out: the same ModelConfig as transformers' class fills in.
    Gemma 3 without hidden_activation ran SiLU (HF: tanh-GELU; 0.52 off in the logits), Mixtral without
    rope_theta 1e4 (HF: 1e6), DeepSeek-V3 without n_group / topk_group routed with no group limit, Qwen3
    without head_dim used hidden / heads (HF: 128), a missing num_key_value_heads meant every head."""
    import transformers as tf
    cls_name, extra = CLASSES[arch]
    cls = getattr(tf, cls_name)
    full = cls(**SMALL, **extra).to_dict()
    full["architectures"] = [arch]
    shape = {"architectures", "model_type", "transformers_version", *SMALL}
    checked = 0
    for key in sorted(set(full) - shape):
        dropped = {k: v for k, v in full.items() if k != key}
        try:
            filled = cls.from_dict(dropped).to_dict()
        except Exception:  # noqa: BLE001 - transformers refuses the config itself: nothing to compare
            continue
        filled["architectures"] = [arch]
        try:
            want = ModelConfig.from_hf(filled)
        except ValueError:  # what transformers fills in, we refuse (a default our layers lack): refused both ways
            with pytest.raises(ValueError):
                ModelConfig.from_hf(dropped)
            continue
        assert ModelConfig.from_hf(dropped) == want, key
        checked += 1
    assert checked >= 15
