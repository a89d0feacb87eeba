"""Gemma 3 (models/gemma3.py) against HF transformers on a tiny random config: local and global layers
(window 8, far shorter than the sequences), q/k norms, (1 + w) norms, the embedding scale, GeGLU,
query_pre_attn_scalar and a final-logit soft cap; logits, and greedy generation with chunked prefill,
prefix caching and preemption."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # the static decode path's Triton kernels on the CPU

from lmserve import LLM, SamplingParams  # noqa: E402
from tests.test_models_vs_hf import CONFIGS, greedy_matches_hf, hf_greedy  # noqa: E402

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


@pytest.mark.parametrize("mode", list(CONFIGS))
def test_greedy_matches_hf_past_the_window(gemma, mode):  # type: ignore[no-untyped-def]
    greedy_matches_hf(*gemma, mode, n_new=30)  # every sequence ends several windows past its start


def test_a_truncated_copy_drafts_for_it(gemma):  # type: ignore[no-untyped-def]
    """The default draft (the target, its first N layers) of a model with layer kinds: its layer_types
    are cut with its layers (before: 'layer_types has 3 entries for 1 layers', no draft at all)."""
    path, _ = gemma
    llm = LLM(str(path), speculative_method="draft", draft_num_layers=2, num_speculative_tokens=3,
              spec_max_batch=1000, spec_min_acceptance=0.0)
    assert llm.engine.spec.proposer.cfg.layer_types == ("sliding_attention", "full_attention")
    prompts = [[(5 * i + j) % 100 + 3 for j in range(20)] for i in range(3)]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    ref = LLM(str(path)).generate(prompts, params, use_tqdm=False)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert llm.stats().spec["proposed"] > 0


def test_awq_keeps_the_float_model_and_saves_what_hf_reads(gemma, tmp_path):  # type: ignore[no-untyped-def]
    """AWQ on Gemma 3: the gate/up scale folds into pre_feedforward_layernorm, the norm the MLP reads
    (it went into post_attention_layernorm, which norms the attention's output: logits moved by half
    their size), and norms are saved as HF's w, not our 1 + w (loading added 1 twice: 12% top-1)."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    from lmserve.quant.awq import awq_calibrate, fake_quantize_model
    from lmserve.quant.checkpoint import dequantized_weights, save_awq_checkpoint
    from tests.test_awq import calib_sequences
    path, hf = gemma
    llm = LLM(str(path), kv_cache_memory="16MiB")
    model = llm.engine.model
    probe = calib_sequences(128, 1, 40, seed=9)[0]
    before = llm.score(probe)
    awq_calibrate(model, lambda s: llm.score(s, last_only=True), calib_sequences(128), group=32, n_grid=10)
    assert (llm.score(probe) - before).abs().max() < 1e-4 * before.abs().max()
    out = tmp_path / "awq"
    save_awq_checkpoint(model, llm.engine.model_config, out, 32, source=path)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    assert torch.allclose(tensors["model.norm.weight"], hf.state_dict()["model.norm.weight"])  # HF's w, no fold
    flat = tmp_path / "flat"
    flat.mkdir()
    save_file({n: t.contiguous() for n, t in dequantized_weights(tensors.items())}, str(flat / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    config.pop("quantization_config")
    (flat / "config.json").write_text(json.dumps(config))
    fake_quantize_model(model, 32)
    ref = llm.score(probe)
    got = LLM(str(flat), kv_cache_memory="16MiB").score(probe)
    assert (got - ref).abs().max() < 1e-4 * ref.abs().max()


def _run_long(llm, prompts, n_new, on_step=None):  # type: ignore[no-untyped-def]
    """Greedy requests stepped by hand: (token ids per request, the most sequences running at once)."""
    eng = llm.engine
    params = SamplingParams(max_tokens=n_new, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, params)
    done, peak = {}, 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        peak = max(peak, len(eng.scheduler.running))
        if on_step is not None:
            on_step(eng)
    return [done[str(i)] for i in range(len(prompts))], peak


def test_local_layers_hold_only_their_window(gemma):  # type: ignore[no-untyped-def]
    """A sequence 8x the window (8 tokens, blocks of 4): at every step each local layer's KV group holds
    at most window / block_size + 1 = 3 blocks, the global layer's all of them; tokens equal HF's."""
    path, hf = gemma
    llm = LLM(str(path), block_size=4, kv_cache_memory="8MiB")
    eng = llm.engine
    assert eng.kv_cache.groups.windows == (None, WINDOW, WINDOW)  # 3 layers, one each: g = gcd(1, 2) = 1
    seen = []

    def check(eng):  # type: ignore[no-untyped-def]
        for seq in eng.scheduler.running:
            full, *local = seq.block_tables
            assert -1 not in full and len(full) == -(-seq.num_computed_tokens // 4)
            for table in local:
                held = [b for b in table if b >= 0]
                assert len(held) <= WINDOW // 4 + 1, table
                seen.append((len(full), len(held)))

    prompt = PROMPTS[0]
    toks, _ = _run_long(llm, [prompt], 8 * WINDOW - len(prompt), check)
    assert toks[0] == hf_greedy(hf, prompt, 8 * WINDOW - len(prompt))
    assert max(f for f, _ in seen) == 16 and max(h for _, h in seen) == 3  # 64 tokens: 16 global blocks
    st = llm.stats()
    assert st.used_blocks == 0 and st.free_blocks == st.num_blocks


def test_more_long_sequences_fit_than_window_blind(gemma):  # type: ignore[no-untyped-def]
    """One KV budget (27 window-blind blocks of 16 tokens: three 128-token sequences), eight requests
    that grow to 16x the window: the hybrid cache holds more of them at full length at once than the
    window-blind cache (every layer keeping every block), with the same tokens."""
    path, _ = gemma
    prompts = [[3 + i] + PROMPTS[1][:15] for i in range(8)]  # 16-token prompts
    budget = 27 * 16 * 3 * 2 * 2 * 16 * 4  # blocks x tokens x layers x (K, V) x kv heads x head_dim x fp32
    runs = {}
    for blind in (False, True):
        llm = LLM(str(path), block_size=16, kv_cache_memory=budget, max_num_batched_tokens=64,
                  disable_hybrid_kv_cache_manager=blind)
        assert llm.engine.kv_cache.groups.num_groups == (1 if blind else 3)
        held = [0]

        def count(eng, held=held):  # type: ignore[no-untyped-def]
            held[0] = max(held[0], sum(s.num_computed_tokens >= 120 for s in eng.scheduler.running))
        toks, _ = _run_long(llm, prompts, 128 - 16, count)
        runs[blind] = (toks, held[0], llm.stats().num_preemptions)
    (hy_toks, hy_held, hy_pre), (blind_toks, blind_held, blind_pre) = runs[False], runs[True]
    assert hy_toks == blind_toks
    print(f"8 requests growing to 128 tokens (window 8), one budget: {hy_held} held at >= 120 tokens at once "
          f"with the hybrid cache ({hy_pre} preemptions), {blind_held} window-blind ({blind_pre} preemptions)")
    assert blind_held <= 3 and hy_held >= 2 * blind_held and hy_pre < blind_pre


def test_static_decode_path_with_kv_groups(gemma):  # type: ignore[no-untyped-def]
    """The padded static decode path (what CUDA graphs replay) with three KV groups, one block table
    and slot column each, through the Triton kernels (interpreter): the torch reference's tokens, past
    the window, where the local groups' tables start with freed (NULL) blocks."""
    pytest.importorskip("triton")
    path, _ = gemma
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[1][:20]]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (20, 6, 12)]
    ref = LLM(str(path), attention_backend="torch", block_size=4).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(path), attention_backend="triton", block_size=4)
    llm.engine.runner.enable_graphs([1, 2, 4], llm.engine.max_model_len, capture=False)
    out = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    graphs = llm.engine.runner.graphs
    assert graphs.num_groups == 3 and graphs.replays >= 19 and graphs.padded_rows > 0


@pytest.fixture(scope="module")
def gemma_270m():  # type: ignore[no-untyped-def]
    """The real gemma-3-270m GGUF (joined from its part packages on first use), HF transformers
    loading the same file (model and tokenizer, one parse of the file: conftest.hf_from_gguf; shared by
    the tests below), and our engine on it with float weights."""
    from lmserve.models.loader import resolve_model
    from tests.conftest import hf_from_gguf
    hf_tok, hf = hf_from_gguf(resolve_model("gemma-3-270m").path, dtype=torch.float32)
    llm = LLM("gemma-3-270m", quantization="none", kv_cache_memory="256MiB")
    return hf, hf_tok, llm


LONG = [2, 818, 5279, 529, 7001, 563, 236743, 108, 9259, 1902, 531, 1345, 496, 1161, 236761] + list(range(1000, 1600))
TEXTS = ["Hello world", "The capital of France is Paris.", "  two  spaces   three\n\nnewlines\ttab",
         "unicode: café naïve 日本語 🙂 emoji", "digits 1234567890 and 3.14159", "<start_of_turn>user\nhi<end_of_turn>\n",
         "def f(x):\n    return x ** 2  # comment", "   leading", "trailing   ", "a" * 50]


def test_real_gemma_270m_matches_hf_past_its_window(gemma_270m):  # type: ignore[no-untyped-def]
    """615 tokens (the local layers' window is 512): float weights give HF's logits; greedy decoding
    gives HF's tokens; the default (the GGUF's own blocks, int8 activations) stays close."""
    hf, _, llm = gemma_270m
    with torch.no_grad():
        ref = hf(torch.tensor([LONG])).logits[0].float()  # (615, 262144)
        want = hf.generate(torch.tensor([LONG]), max_new_tokens=12, do_sample=False)[0, len(LONG):].tolist()
        want_short = hf.generate(torch.tensor([LONG[:15]]), max_new_tokens=12, do_sample=False)[0, 15:].tolist()
    assert (llm.score(LONG) - ref).abs().max() < 2e-4
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate([LONG, LONG[:15]], params, use_tqdm=False)]
    assert got == [want, want_short]
    default = LLM("gemma-3-270m", kv_cache_memory="256MiB")  # quantization auto
    agree = (default.score(LONG).argmax(-1) == ref.argmax(-1)).float().mean().item()
    del default
    assert agree > 0.9, agree  # measured 0.95 (Q4_K / Q5_0 / Q6_K blocks, int8 activations)


def test_real_gemma_270m_kv_groups_and_planner_shape(gemma_270m):  # type: ignore[no-untyped-def]
    """18 layers, 15 local (window 512) and 3 global: six KV groups of three layers (one global), a
    pool block covering three layers; the planner's named shape is the loaded model's."""
    import dataclasses

    from lmserve.config import ModelConfig
    from lmserve.models.shapes import SHAPES
    _, _, llm = gemma_270m
    eng = llm.engine
    groups = eng.kv_cache.groups
    assert groups.windows == (None,) + (512,) * 5 and groups.layers[0] == (5, 11, 17)
    assert len(eng.kv_cache.tensors) == 3 and eng.kv_cache.layers[5] is eng.kv_cache.tensors[0]
    cfg, named = eng.model_config, ModelConfig(**SHAPES["gemma-3-270m"])
    fields = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
              "rope_theta", "rope_local_theta", "sliding_window", "layer_types", "tie_word_embeddings")
    assert {f: getattr(cfg, f) for f in fields} == {f: getattr(named, f) for f in fields}
    scale = lambda c: (c.query_pre_attn_scalar or c.head_dim) ** -0.5  # noqa: E731 (the GGUF leaves it implied)
    assert scale(cfg) == scale(named)
    assert dataclasses.replace(named, architecture=cfg.architecture).kv_elems_per_token == cfg.kv_elems_per_token


def test_real_gemma_270m_tokenizer_and_chat_equal_hf(gemma_270m):  # type: ignore[no-untyped-def]
    """The SentencePiece tokenizer built from the GGUF (merges recovered from the vocabulary order)
    encodes and decodes as HF's does; a chat turn through the built-in Gemma template generates HF's
    greedy tokens."""
    hf, hf_tok, llm = gemma_270m
    tok = llm.tokenizer
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == hf_tok.encode(text), text
        assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)
    assert tok.eos_token_ids == (1, 106)  # <eos> and <end_of_turn>
    msgs = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "What colour is the sky?"}]
    prompt = tok.apply_chat_template(msgs)
    assert prompt == ("<bos><start_of_turn>user\nAnswer in one word.\n\nWhat colour is the sky?<end_of_turn>\n"
                      "<start_of_turn>model\n")
    ids = tok.encode(prompt)
    assert ids.count(2) == 1  # one BOS (the template's)
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=[1, 106])[0, len(ids):]
    out = llm.chat(msgs, SamplingParams(max_tokens=16, temperature=0))[0].outputs[0]
    assert out.token_ids == [t for t in want.tolist() if t not in (0,)][:len(out.token_ids)]
    assert out.text == hf_tok.decode(out.token_ids, skip_special_tokens=True)
    assert out.finish_reason == "stop" or len(out.token_ids) == 16


def test_real_gemma_270m_through_the_server(gemma_270m):  # type: ignore[no-untyped-def]
    """The OpenAI chat route on gemma-3-270m returns what the library does."""
    from starlette.testclient import TestClient

    from lmserve.server.app import build_app
    from lmserve.server.async_engine import AsyncEngine
    _, _, llm = gemma_270m
    msgs = [{"role": "user", "content": "Name a fruit."}]
    want = llm.chat(msgs, SamplingParams(max_tokens=12, temperature=0))[0].outputs[0].text
    with TestClient(build_app(AsyncEngine(llm.engine), "gemma-3-270m")) as c:
        r = c.post("/v1/chat/completions", json={"model": "gemma-3-270m", "messages": msgs, "max_tokens": 12,
                                                   "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == want


def test_the_sentencepiece_tokenizer_is_built_once(gemma_270m, tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    """Recovering the merges of a 262K vocabulary takes seconds: the built tokenizer is cached under
    LMSERVE_CACHE/tokenizers, keyed by the file, and read back equal."""
    from lmserve import tokenizer as tk
    from lmserve.models.gguf_file import GGUFFile
    from lmserve.models.loader import resolve_model
    _, hf_tok, llm = gemma_270m
    monkeypatch.setenv("LMSERVE_CACHE", str(tmp_path))
    g = GGUFFile(resolve_model("gemma-3-270m").path)
    fresh = tk.Tokenizer.from_gguf(g, (1, 106))
    assert len(list((tmp_path / "tokenizers").glob("*.json"))) == 1
    monkeypatch.setattr(tk, "_sentencepiece_bpe", lambda *a: pytest.fail("rebuilt despite the cache"))
    cached = tk.Tokenizer.from_gguf(g, (1, 106))
    for text in TEXTS:
        assert cached.encode(text) == fresh.encode(text) == hf_tok.encode(text)


def test_score_holds_only_the_window_it_reads(gemma):  # type: ignore[no-untyped-def]
    """LLM.score with decode_from (teacher-forced decode steps, as the eval and naive baselines use it)
    on a 64-token sequence in a 30-block pool (blocks of 4, three groups): the local groups let go of
    what their window left behind step by step, so it fits (before, every group took the whole
    sequence's 16 blocks up front: 48 > 30, 'not enough free KV blocks'); the logits equal HF's."""
    path, hf = gemma
    llm = LLM(str(path), block_size=4, kv_cache_memory=30 * 1024, max_model_len=128)
    assert llm.engine.block_manager.num_blocks == 30
    ids = (PROMPTS[3] * 2)[:64]
    got = llm.score(ids, decode_from=16)  # (64, V)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]  # (64, V)
    assert (got - ref).abs().max() < 1e-4
    assert llm.engine.block_manager.num_free_blocks == 30
    with pytest.raises(RuntimeError, match="^score: 64 tokens in one forward .* pass decode_from"):
        llm.score(ids)  # one forward holds every group's 16 blocks: the error says what to do
    assert llm.engine.block_manager.num_free_blocks == 30


def test_completions_add_special_tokens_false_leaves_out_bos(gemma_270m):  # type: ignore[no-untyped-def]
    """vLLM's add_special_tokens on /v1/completions: false leaves out Gemma's BOS (it was ignored: the
    prompt always began with <bos>, as /tokenize did not)."""
    from starlette.testclient import TestClient

    from lmserve.server.app import build_app
    from lmserve.server.async_engine import AsyncEngine
    _, hf_tok, llm = gemma_270m
    with TestClient(build_app(AsyncEngine(llm.engine), "gemma-3-270m")) as c:
        for add in (True, False):
            body = {"prompt": "Hello", "max_tokens": 0, "echo": True, "logprobs": 0, "add_special_tokens": add}
            r = c.post("/v1/completions", json=body).json()
            want = hf_tok("Hello", add_special_tokens=add).input_ids
            assert r["usage"]["prompt_tokens"] == len(want) and (r["choices"][0]["logprobs"]["tokens"][0] == "<bos>") == add
