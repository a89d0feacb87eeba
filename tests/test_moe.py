"""Mixture of experts (models/moe.py) against HF transformers on tiny random Mixtral and Qwen3-MoE
configs: logits, and greedy generation with chunked prefill, prefix caching and preemption; the
router's top-k and renormalisation against a float64 reference."""

from __future__ import annotations

import pytest
import torch

from lmserve import LLM
from lmserve.models.moe import SparseMoE
from tests.test_models_vs_hf import CONFIGS, PROMPTS, greedy_matches_hf


def _config(family: str):  # type: ignore[no-untyped-def]
    import transformers as tf
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, num_experts_per_tok=2, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    if family == "mixtral":
        return tf.MixtralConfig(**common, num_local_experts=4)
    # Qwen3-MoE: 5 experts of width 32, k = 2 not renormalised; layer 1 dense (mlp_only_layers)
    return tf.Qwen3MoeConfig(**common, num_experts=5, moe_intermediate_size=32, head_dim=16, norm_topk_prob=False,
                             mlp_only_layers=[1])


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def moe_model(request, tmp_path_factory):  # type: ignore[no-untyped-def]
    import transformers as tf
    torch.manual_seed(5)
    model = tf.AutoModelForCausalLM.from_config(_config(request.param)).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path, safe_serialization=True)
    return request.param, path, model


def test_layers_and_router(moe_model):  # type: ignore[no-untyped-def]
    family, path, _ = moe_model
    llm = LLM(str(path), kv_cache_memory="32MiB")
    model = llm.engine.model
    kinds = [type(layer.mlp).__name__ for layer in model.layers]
    assert kinds == (["SparseMoE"] * 3 if family == "mixtral" else ["SparseMoE", "MLP", "SparseMoE"])
    moe = model.layers[0].mlp
    assert isinstance(moe, SparseMoE) and moe.renormalize == (family == "mixtral")
    x = torch.randn(9, 64)
    w, ids = moe.route(x)
    p = torch.softmax(x.double() @ moe.gate.weight.double().T, -1)  # (9, E) float64
    want_w, want_ids = p.topk(2, -1)
    if family == "mixtral":
        want_w = want_w / want_w.sum(-1, keepdim=True)
    assert torch.equal(ids, want_ids) and torch.allclose(w.double(), want_w, atol=1e-6)
    out = moe(x)  # against the dense sum over the chosen experts
    dense = torch.stack([torch.stack([moe.experts[int(e)](x[t:t + 1])[0] for e in ids[t]]) for t in range(9)])  # (9, 2, 64)
    assert torch.allclose(out, (dense * w.unsqueeze(-1)).sum(1), atol=1e-5)


def test_logits_match_hf(moe_model):  # type: ignore[no-untyped-def]
    _, path, hf = moe_model
    llm = LLM(str(path), kv_cache_memory="32MiB")
    for prompt in PROMPTS:
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].float()
        assert (llm.score(prompt) - ref).abs().max() < 1e-4


@pytest.mark.parametrize("mode", list(CONFIGS))
def test_greedy_matches_hf(moe_model, mode):  # type: ignore[no-untyped-def]
    _, path, hf = moe_model
    greedy_matches_hf(path, hf, mode, n_new=16)


def test_int8_keeps_the_router_float(moe_model):  # type: ignore[no-untyped-def]
    from lmserve.layers.linear import Linear
    from lmserve.layers.quant import Int8Linear
    _, path, hf = moe_model
    llm = LLM(str(path), kv_cache_memory="32MiB", quantization="int8")
    moe = llm.engine.model.layers[0].mlp
    assert type(moe.gate) is Linear and type(moe.experts[0].down_proj) is Int8Linear
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPTS[1]])).logits[0].float()
    rel = ((llm.score(PROMPTS[1]) - ref).norm() / ref.norm()).item()
    assert rel < 0.05, rel


def test_awq_refuses_a_mixture_of_experts_model_before_any_work(moe_model, tmp_path):  # type: ignore[no-untyped-def]
    """AWQ's scale groups are the dense Llama layer's: on an MoE model calibration failed with an
    IndexError (an expert sees only its routed tokens), and a checkpoint saved without it wrote the
    routers as int4, a folder that did not load. Both refuse now, naming the layer, writing nothing."""
    from lmserve.quant.awq import awq_calibrate
    from lmserve.quant.checkpoint import save_awq_checkpoint
    _, path, _ = moe_model
    llm = LLM(str(path), kv_cache_memory="32MiB")
    seqs = [[(i * 7 + j) % 120 + 3 for j in range(32)] for i in range(4)]
    with pytest.raises(ValueError, match="AWQ: layer 0's mlp is not dense"):
        awq_calibrate(llm.engine.model, lambda s: llm.score(s, last_only=True), seqs, group=32, n_grid=4)
    with pytest.raises(ValueError, match="AWQ: layer 0's mlp is not dense"):
        save_awq_checkpoint(llm.engine.model, llm.engine.model_config, tmp_path / "awq", 32, source=path)
    assert not (tmp_path / "awq").exists()


def test_a_fused_expert_checkpoint_loads(moe_model, tmp_path):  # type: ignore[no-untyped-def]
    """transformers 5's own state_dict holds a layer's experts fused (experts.gate_up_proj (E, 2I, hidden),
    experts.down_proj): the DeepSeek loader split them, the Mixtral / Qwen3-MoE one failed with an
    AttributeError ('ModuleList' object has no attribute 'load'). Logits are HF's on the same weights."""
    import shutil

    from safetensors.torch import save_file
    family, path, hf = moe_model
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert state["model.layers.0.mlp.experts.gate_up_proj"].dim() == 3
    shutil.copy(path / "config.json", tmp_path / "config.json")
    save_file(state, str(tmp_path / "model.safetensors"))
    llm = LLM(str(tmp_path), kv_cache_memory="32MiB")
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPTS[1]])).logits[0].float()
    assert (llm.score(PROMPTS[1]) - ref).abs().max() < 1e-4
