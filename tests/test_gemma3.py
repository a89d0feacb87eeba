"""Gemma 3 (models/gemma3.py) against HF transformers on a tiny random config: local and global layers
(window 8, far shorter than the sequences), q/k norms, (1 + w) norms, the embedding scale, GeGLU,
query_pre_attn_scalar and a final-logit soft cap; logits, and greedy generation with chunked prefill,
prefix caching and preemption."""

from __future__ import annotations

import pytest
import torch

from lmserve import LLM, SamplingParams
from tests.test_models_vs_hf import hf_greedy

WINDOW = 8
PROMPTS = [[5, 17, 33, 9, 100, 3], list(range(20, 61)), [11, 12], list(range(64, 127)) + [1, 2, 3]]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):  # type: ignore[no-untyped-def]
    import transformers as tf
    torch.manual_seed(3)
    cfg = tf.Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=WINDOW,
                              layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                              query_pre_attn_scalar=24, final_logit_softcapping=3.0, max_position_embeddings=512,
                              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                               "full_attention": {"rope_type": "default", "rope_theta": 1e6}},
                              bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg.architectures = ["Gemma3ForCausalLM"]
    model = tf.Gemma3ForCausalLM(cfg).float().eval()
    with torch.no_grad():  # norms start at 0 (= scale 1): random, so that the (1 + w) offset matters
        for name, p in model.named_parameters():
            p.normal_(0, 0.3 if "norm" in name else 0.08)
    path = tmp_path_factory.mktemp("gemma3")
    model.save_pretrained(path, safe_serialization=True)
    return path, model


def test_config_reads_the_layer_kinds(gemma):  # type: ignore[no-untyped-def]
    from lmserve.models.loader import hf_config
    cfg = hf_config(gemma[0])
    assert cfg.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert [cfg.layer_window(i) for i in range(3)] == [WINDOW, None, WINDOW]
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.query_pre_attn_scalar) == (1e6, 1e4, 24)
    assert cfg.qk_norm and cfg.hidden_act == "gelu_pytorch_tanh" and cfg.final_logit_softcapping == 3.0


def test_logits_match_hf(gemma):  # type: ignore[no-untyped-def]
    path, hf = gemma
    llm = LLM(str(path), kv_cache_memory="64MiB")
    for prompt in PROMPTS:
        ours = llm.score(prompt)  # (T, V)
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].float()  # (T, V)
        assert (ours - ref).abs().max().item() < 1e-4, len(prompt)
        assert ref.abs().max() < 3.0  # the soft cap was applied (and matched)
    decoded = llm.score(PROMPTS[3], decode_from=4)  # the same logits one decode step at a time
    with torch.no_grad():
        assert (decoded - hf(torch.tensor([PROMPTS[3]])).logits[0]).abs().max() < 1e-4


@pytest.mark.parametrize("mode", ["default", "chunked", "prefix", "preempt"])
def test_greedy_matches_hf_past_the_window(gemma, mode):  # type: ignore[no-untyped-def]
    path, hf = gemma
    opts = {"default": {}, "chunked": dict(max_num_batched_tokens=7),
            "prefix": dict(enable_prefix_caching=True, block_size=4),
            "preempt": dict(block_size=4, max_num_batched_tokens=16)}[mode]
    n_new = 30  # every sequence ends several windows past its start
    if mode == "preempt":  # room for about two of the four at once
        from lmserve.kv.cache import KVCache
        from lmserve.models.loader import hf_config
        per_block = KVCache.bytes_per_block(hf_config(path), 4, torch.float32)
        opts["kv_cache_memory"] = per_block * (-(-(max(map(len, PROMPTS)) + n_new) // 4) + 12)
    llm = LLM(str(path), **opts)
    params = SamplingParams(max_tokens=n_new, temperature=0, ignore_eos=True)
    prompts = PROMPTS
    if mode == "prefix":  # a 40-token shared prefix (5 windows) cached by a first request
        shared = list(range(30, 70))
        llm.generate([shared + [3, 4]], params, use_tqdm=False)
        prompts = [shared + p for p in PROMPTS]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, n_new), (mode, len(prompt))
    st = llm.stats()
    if mode == "preempt":
        assert st.num_preemptions > 0
    if mode == "prefix":
        assert st.prefix_hit_tokens >= 40 * len(PROMPTS) // 4 * 4
    assert st.used_blocks == 0


@pytest.fixture(scope="module")
def gemma_270m():  # type: ignore[no-untyped-def]
    """The real gemma-3-270m GGUF (joined from its part packages on first use) and HF transformers
    loading the same file (~50 s: shared by the tests below)."""
    from transformers import AutoModelForCausalLM

    from lmserve.models.loader import resolve_model
    path = resolve_model("gemma-3-270m").path
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return path, hf


LONG = [2, 818, 5279, 529, 7001, 563, 236743, 108, 9259, 1902, 531, 1345, 496, 1161, 236761] + list(range(1000, 1600))


def test_real_gemma_270m_matches_hf_past_its_window(gemma_270m):  # type: ignore[no-untyped-def]
    """615 tokens (the local layers' window is 512): float weights give HF's logits; greedy decoding
    gives HF's tokens; the default (the GGUF's own blocks, int8 activations) stays close."""
    path, hf = gemma_270m
    with torch.no_grad():
        ref = hf(torch.tensor([LONG])).logits[0].float()  # (615, 262144)
        want = hf.generate(torch.tensor([LONG]), max_new_tokens=12, do_sample=False)[0, len(LONG):].tolist()
        want_short = hf.generate(torch.tensor([LONG[:15]]), max_new_tokens=12, do_sample=False)[0, 15:].tolist()
    llm = LLM("gemma-3-270m", quantization="none", kv_cache_memory="256MiB")
    assert (llm.score(LONG) - ref).abs().max() < 2e-4
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate([LONG, LONG[:15]], params, use_tqdm=False)]
    assert got == [want, want_short]
    del llm
    default = LLM("gemma-3-270m", kv_cache_memory="256MiB")  # quantization auto
    agree = (default.score(LONG).argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree > 0.9, agree  # measured 0.95 (Q4_K / Q5_0 / Q6_K blocks, int8 activations)
