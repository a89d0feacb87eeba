"""The CPU decode plan (models/cpu_decode.py) runs exactly the module path's kernels: its logits equal
the module path's bit for bit, its tokens too, for one and several sequences, and it steps aside where
it does not apply."""

from __future__ import annotations

import pytest
import torch

from lmserve import LLM, SamplingParams
from lmserve.layers import cpu_native, dispatch
from lmserve.models.cpu_decode import CpuDecodePlan

pytestmark = pytest.mark.skipif(not cpu_native.available() or not cpu_native.int8_x(),
                                reason="the plan runs where our CPU kernels take the tile kernel (AVX2 or VNNI)")


@pytest.fixture(params=["vnni", "avx2int8"])
def tile_isa(request, monkeypatch):  # type: ignore[no-untyped-def]
    """Each variant of the tile kernel this CPU runs (a VNNI machine runs both)."""
    if cpu_native._level_for(request.param) != cpu_native.ISA_NAMES[request.param]:
        pytest.skip(f"this CPU has no {request.param}")
    monkeypatch.setenv("LMSERVE_ISA", request.param)
    return request.param


def record_runs(plan, monkeypatch) -> list[tuple[int, int]]:  # type: ignore[no-untyped-def]
    """The (rows, sequences) of every step the plan runs from now on, appended as they run."""
    runs: list[tuple[int, int]] = []
    real = plan.run
    monkeypatch.setattr(plan, "run", lambda x, p, c, meta: runs.append((x.shape[0], meta.num_seqs)) or real(x, p, c, meta))
    return runs


def _llm(path, **kw):  # type: ignore[no-untyped-def]
    return LLM(str(path), kv_cache_memory="16MiB", block_size=4, quantization="int4", **kw)


def test_plan_equals_the_module_path(tiny_models, monkeypatch, tile_isa):  # type: ignore[no-untyped-def]
    llm = _llm(tiny_models["llama"][0])
    model = llm.engine.model
    plan = model.cpu_plan()
    assert isinstance(plan, CpuDecodePlan)
    runs = record_runs(plan, monkeypatch)
    ids = [5, 9, 2, 7, 1, 3, 8, 8, 4, 6, 11, 2, 9]
    with_plan = llm.score(ids, decode_from=3)  # (T, V): the 3-token prompt and 10 decode steps through the plan
    assert [rows for rows, _ in runs] == [3] + [1] * 10
    model._cpu_plan = None  # the module path (same kernels, one module at a time)
    without = llm.score(ids, decode_from=3)
    assert torch.equal(with_plan, without)
    prompts = [[5, 9, 2, 7], [4, 4, 8], [1, 2, 3, 4, 5, 6, 7]]  # three sequences a step, blocks of 4
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    model._cpu_plan = plan
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == ref and (3, 3) in runs


def test_the_layer_loop_in_c_equals_the_python_loop(tiny_models, tile_isa):  # type: ignore[no-untyped-def]
    """decode.c's lm_llama_layers (the plan's default) and the plan's Python loop over the same kernels
    (kept for tensor parallelism) give the same logits bit for bit, decode and verification steps."""
    llm = _llm(tiny_models["llama"][0])
    plan = llm.engine.model.cpu_plan()
    assert plan.native is not None
    ids = [5, 9, 2, 7, 1, 3, 8, 8, 4, 6, 11, 2, 9]
    native = llm.score(ids, decode_from=3)  # (T, V)
    arrays, plan.native = plan.native, None
    python = llm.score(ids, decode_from=3)
    assert torch.equal(native, python)
    plan.native = arrays
    prompts = [[5, 9, 2, 7], [4, 4, 8], [1, 2, 3, 4, 5, 6, 7]]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    plan.native = None
    assert got == [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_plan_with_an_int8_cache_equals_the_module_path(tiny_models, monkeypatch, tile_isa):  # type: ignore[no-untyped-def]
    """kv_cache_dtype int8: decode steps run in the plan (its C loop and its Python loop), storing and
    reading the QuantizedKV in the attention kernel, with the module path's logits bit for bit."""
    llm = _llm(tiny_models["llama"][0], kv_cache_dtype="int8")
    model = llm.engine.model
    plan = model.cpu_plan()
    runs = record_runs(plan, monkeypatch)
    ids = [5, 9, 2, 7, 1, 3, 8, 8, 4, 6, 11, 2, 9]
    native = llm.score(ids, decode_from=3)  # (T, V)
    assert [rows for rows, _ in runs] == [3] + [1] * 10
    arrays, plan.native = plan.native, None
    python = llm.score(ids, decode_from=3)
    plan.native = arrays
    model._cpu_plan = None
    module = llm.score(ids, decode_from=3)
    assert torch.equal(native, module) and torch.equal(python, module)


def test_plan_steps_aside(tiny_models):  # type: ignore[no-untyped-def]
    assert _llm(tiny_models["qwen3"][0]).engine.model.cpu_plan() is None  # q/k norms
    assert LLM(str(tiny_models["llama"][0]), kv_cache_memory="16MiB", quantization="none").engine.model.cpu_plan() is None
    llm = _llm(tiny_models["llama"][0])
    plan = llm.engine.model.cpu_plan()
    assert plan is not None
    x = torch.zeros(1, 64)
    caches = llm.engine.runner.kv_cache.layers
    from lmserve.attention.testing import random_step
    meta, _, _ = random_step([5], [1], 4, 2, 16, seed=0)
    assert plan.applies(x, caches, meta)
    with dispatch.use_fused(False):  # the torch reference asked for
        assert not plan.applies(x, caches, meta)
    meta2, _, _ = random_step([5, 9], [1, 3], 4, 2, 16, seed=0)
    assert plan.applies(torch.zeros(4, 64), caches, meta2)  # a few tokens a sequence: a verification
    meta3, _, _ = random_step([5, 30], [1, 17], 4, 2, 16, seed=0)
    assert not plan.applies(torch.zeros(18, 64), caches, meta3)  # a prefill chunk in the step


def test_plan_steps_aside_when_a_weight_changes(tiny_models):  # type: ignore[no-untyped-def]
    """The plan multiplies the tiles it took when built: a weight written in place (a reload), or a
    linear's qweight rebound, sends the step to the module path (which repacks)."""
    from lmserve.attention.testing import random_step
    meta, _, _ = random_step([5], [1], 4, 2, 16, seed=0)
    x = torch.zeros(1, 64)
    for change in ("norm", "linear", "rebind"):
        llm = _llm(tiny_models["llama"][0])
        model, caches = llm.engine.model, llm.engine.runner.kv_cache.layers
        plan = model.cpu_plan()
        assert plan.applies(x, caches, meta)
        layer = model.layers[1]
        with torch.no_grad():
            if change == "norm":
                layer.post_attention_layernorm.weight.mul_(1.0)
            elif change == "linear":
                layer.mlp.down_proj.qweight.add_(0)
            else:
                layer.self_attn.o_proj.qweight = layer.self_attn.o_proj.qweight.clone()
        assert not plan.applies(x, caches, meta), change


def test_verification_steps_run_in_the_plan_with_the_module_paths_tokens(tiny_models, monkeypatch, tile_isa):  # type: ignore[no-untyped-def]
    """n-gram speculation verifies k + 1 tokens a sequence a step: through the plan (a token a row of
    the attention kernel) the greedy tokens equal the module path's and speculation's absence."""
    prompts = [[5, 9, 2, 7, 5, 9, 2, 7, 5, 9], [4, 4, 8, 4, 4, 8, 4, 4]]  # repeats: the n-gram drafter proposes
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in _llm(tiny_models["llama"][0]).generate(prompts, params)]
    llm = _llm(tiny_models["llama"][0], speculative_method="ngram", num_speculative_tokens=3)
    model = llm.engine.model
    plan = model.cpu_plan()
    runs = record_runs(plan, monkeypatch)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert any(n > seqs for n, seqs in runs)  # multi-token verification steps ran in the plan
    model._cpu_plan = None
    module = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == module == plain


def test_gemma_plan_equals_the_module_path(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    """Gemma 3's plan (q / k norms per head, sandwich norms, GeGLU, local and global layers), its C loop
    and its Python loop, gives the module path's logits bit for bit, and its tokens, decode and
    verification steps alike."""
    from lmserve.models.cpu_decode import GemmaDecodePlan
    from tests.conftest import make_tiny_gemma
    make_tiny_gemma(tmp_path)
    llm = _llm(tmp_path)
    model = llm.engine.model
    plan = model.cpu_plan()
    assert isinstance(plan, GemmaDecodePlan)
    runs = record_runs(plan, monkeypatch)
    ids = [5, 9, 2, 7, 1, 3, 8, 8, 4, 6, 11, 2, 9, 30, 31, 32]
    with_plan = llm.score(ids, decode_from=3)  # the 3-token prompt, then 13 decode steps (past the window)
    assert [rows for rows, _ in runs] == [3] + [1] * 13
    assert plan.native is not None  # that was decode.c's loop; its Python loop (tensor parallelism's) too:
    arrays, plan.native = plan.native, None
    assert torch.equal(with_plan, llm.score(ids, decode_from=3))
    plan.native = arrays
    model._cpu_plan = None
    assert torch.equal(with_plan, llm.score(ids, decode_from=3))
    prompts = [[5, 9, 2, 7], [4, 4, 8, 4, 4, 8, 4, 4]]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    model._cpu_plan = plan
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == ref


def test_default_model_plan_gives_the_module_paths_tokens(monkeypatch):  # type: ignore[no-untyped-def]
    """SmolLM2-135M as users run it (the GGUF's blocks, quantization auto): greedy tokens through the plan
    equal the module path's, plain and with n-gram verification steps; the logits bit for bit. No prefix
    cache: the second run's steps must be the first's (with the 45-token prompt's blocks cached, its prompt
    was 13 tokens, the 5-token prompt's prefill then ran as attention-kernel rows, not as a prefill, and
    a near tie at token 14 went the other way on a VNNI machine: not the plan's doing)."""
    llm = LLM(quantization="auto", kv_cache_memory="64MiB", speculative_method="ngram", enable_prefix_caching=False)
    model = llm.engine.model
    plan = model.cpu_plan()
    assert isinstance(plan, CpuDecodePlan)
    runs = record_runs(plan, monkeypatch)
    prompts = ["The capital of France is", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5,"]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    ids = llm.tokenizer.encode(prompts[0])
    scored = llm.score(ids + got[0][:8], decode_from=len(ids))
    assert any(n > seqs for n, seqs in runs) and any(n == seqs for n, seqs in runs)  # verification and decode
    model._cpu_plan = None
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == got
    assert torch.equal(llm.score(ids + got[0][:8], decode_from=len(ids)), scored)


def test_the_llama_plan_steps_aside_for_geglu(tmp_path):  # type: ignore[no-untyped-def]
    """The Llama plan multiplies with SiLU-and-mul: a Llama-shaped model with a GELU MLP keeps the
    module path (whose logits equal HF's)."""
    import transformers as tf
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, hidden_act="gelu_pytorch_tanh")
    hf = tf.LlamaForCausalLM(cfg).float().eval()
    hf.save_pretrained(tmp_path)
    llm = _llm(tmp_path)
    assert llm.engine.model.cpu_plan() is None
    ids = [5, 9, 2, 7, 1, 3, 8]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (llm.score(ids, decode_from=2) - ref).abs().max() < 0.1  # int4 weights, against HF's float
