"""LoRA adapters (lmserve/lora): PEFT's own adapters and PEFT's own forward as the reference."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from lmserve import LLM, LoRARequest, SamplingParams

peft = pytest.importorskip("peft")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT = [5, 17, 33, 9, 100, 3, 44, 12, 70, 71, 72, 20]


def make_adapter(hf, path: Path, targets=ALL, r: int = 4, alpha: float = 8, seed: int = 0, **kw):  # type: ignore[no-untyped-def]
    """A PEFT LoRA adapter on a copy of `hf` with random (seeded) A and B (PEFT starts B at zero), saved at
    path; returns the PeftModel, the reference."""
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, **kw)
    pm = peft.get_peft_model(copy.deepcopy(hf), cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    pm.save_pretrained(path)
    return pm.eval()


def peft_greedy(pm, prompt: list[int], n: int) -> list[int]:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        out = pm.generate(input_ids=torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def adapters(tiny_models, tmp_path_factory):  # type: ignore[no-untyped-def]
    """Two adapters on the tiny llama: A on every projection, B on q / v only with rsLoRA's scale."""
    root = tmp_path_factory.mktemp("lora")
    path, hf = tiny_models["llama"]
    a = make_adapter(hf, root / "a", seed=1)
    b = make_adapter(hf, root / "b", targets=["q_proj", "v_proj"], r=8, alpha=4, seed=2, use_rslora=True)
    return {"model": path, "hf": hf, "a": (LoRARequest("a", 1, str(root / "a")), a),
            "b": (LoRARequest("b", 2, str(root / "b")), b), "root": root}


@pytest.fixture(scope="module")
def llm(adapters):  # type: ignore[no-untyped-def]
    return LLM(str(adapters["model"]), kv_cache_memory="64MiB", enable_lora=True, block_size=4)


@pytest.mark.parametrize("family", ["llama", "qwen2", "llama_mqa"])
def test_logits_match_peft(tiny_models, tmp_path, family):  # type: ignore[no-untyped-def]
    """Every position's logits, prefilled and decoded one token a step, equal PEFT's forward with the adapter;
    the base model's stay the base model's (qwen2: q/k/v biases; llama_mqa: one KV head, tied embeddings)."""
    path, hf = tiny_models[family]
    pm = make_adapter(hf, tmp_path / "ad", seed=3)
    llm = LLM(str(path), kv_cache_memory="64MiB", enable_lora=True)
    lr = LoRARequest("ad", 1, str(tmp_path / "ad"))
    with torch.no_grad():
        ref = pm(torch.tensor([PROMPT])).logits[0].float()  # (T, V)
        with pm.disable_adapter():
            base = pm(torch.tensor([PROMPT])).logits[0].float()
    assert (ref - base).abs().max() > 0.5  # the adapter matters
    for kw in ({}, {"decode_from": 4}):
        assert (llm.score(PROMPT, lora_request=lr, **kw) - ref).abs().max() < 1e-4, kw
        assert (llm.score(PROMPT, **kw) - base).abs().max() < 1e-4, kw
    assert llm.stats().used_blocks == 0


def test_rank_padding_partial_targets_and_rslora(adapters, llm):  # type: ignore[no-untyped-def]
    """B: rank 8 on q and v only (k's rows of the fused qkv untouched), scale alpha / sqrt(r)."""
    lr, pm = adapters["b"]
    with torch.no_grad():
        ref = pm(torch.tensor([PROMPT])).logits[0].float()
    assert (llm.score(PROMPT, lora_request=lr) - ref).abs().max() < 1e-4


def test_mixed_batch_matches_peft_generate(adapters, llm):  # type: ignore[no-untyped-def]
    """One generate call mixing the base model, A and B (and A's n=2 children): each request's greedy tokens
    are PEFT's for its adapter."""
    (ra, pa), (rb, pb) = adapters["a"], adapters["b"]
    prompts = [PROMPT, PROMPT, [9, 8, 7, 6, 5, 4, 3], PROMPT[:5], PROMPT]
    loras = [None, ra, rb, ra, rb]
    params = [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)] * 5
    params[3] = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, n=2)
    outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    with pa.disable_adapter():
        base = peft_greedy(pa, PROMPT, 10)
    refs = [base, peft_greedy(pa, PROMPT, 10), peft_greedy(pb, prompts[2], 10), peft_greedy(pa, PROMPT[:5], 10),
            peft_greedy(pb, PROMPT, 10)]
    assert len({tuple(r) for r in refs}) >= 3  # the adapters change the output
    for out, ref in zip(outs, refs):
        assert all(c.token_ids == ref for c in out.outputs), (out.outputs[0].token_ids, ref)
    assert llm.stats().used_blocks == 0


def test_prefix_cache_keeps_adapters_apart(adapters, llm):  # type: ignore[no-untyped-def]
    """KV computed with the base model (or another adapter) is never reused for an adapter's request: the
    same prompt run first without, then with A, gives A's tokens and logprobs; A's second run hits A's cache."""
    ra, pa = adapters["a"]
    prompt = list(range(30, 70))
    p = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0)
    llm.reset_prefix_cache()
    llm.generate([prompt], p, use_tqdm=False)  # the base model's blocks, cached
    first = llm.generate([prompt], p, lora_request=ra, use_tqdm=False)[0]
    again = llm.generate([prompt], p, lora_request=ra, use_tqdm=False)[0]
    assert first.metrics.num_cached_tokens == 0 and again.metrics.num_cached_tokens > 0
    assert first.outputs[0].token_ids == peft_greedy(pa, prompt, 6) == again.outputs[0].token_ids
    with torch.no_grad():
        full = torch.tensor([prompt + first.outputs[0].token_ids])
        lps = pa(full).logits[0].float().log_softmax(-1)  # (T, V)
    for i, (tok, lp) in enumerate(zip(first.outputs[0].token_ids, first.outputs[0].logprobs)):
        want = lps[len(prompt) - 1 + i, tok].item()
        assert lp.token_id == tok and abs(lp.logprob - want) < 1e-4
        assert abs(again.outputs[0].logprobs[i].logprob - want) < 1e-4


def test_speculation_with_an_adapter_stays_exact(adapters):  # type: ignore[no-untyped-def]
    """n-gram drafts verified with the adapter's rows: greedy equals PEFT's."""
    ra, pa = adapters["a"]
    llm = LLM(str(adapters["model"]), kv_cache_memory="64MiB", enable_lora=True, speculative_method="ngram",
              num_speculative_tokens=3)
    prompt = [7, 8, 9, 10, 11, 7, 8, 9, 10, 11, 7, 8, 9]
    out = llm.generate([prompt, prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
                       lora_request=[ra, None], use_tqdm=False)
    assert out[0].outputs[0].token_ids == peft_greedy(pa, prompt, 16)
    with pa.disable_adapter():
        assert out[1].outputs[0].token_ids == peft_greedy(pa, prompt, 16)
    assert llm.stats().spec["accepted"] > 0  # drafts were verified (and some kept) with the adapter's rows


def test_deterministic_mode_an_adapter_request_alone_and_in_a_crowd(adapters):  # type: ignore[no-untyped-def]
    """deterministic: an adapter request's logprobs are bit-identical alone and among others (other adapters,
    the base model, other lengths)."""
    ra, rb = adapters["a"][0], adapters["b"][0]
    llm = LLM(str(adapters["model"]), kv_cache_memory="64MiB", enable_lora=True, deterministic=True)
    p = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3)
    alone = llm.generate([PROMPT], p, lora_request=ra, use_tqdm=False)[0].outputs[0]
    g = torch.Generator().manual_seed(0)
    crowd = [torch.randint(3, 120, (int(n),), generator=g).tolist() for n in torch.randint(3, 30, (9,), generator=g)]
    outs = llm.generate(crowd[:4] + [PROMPT] + crowd[4:], p, use_tqdm=False,
                        lora_request=[rb, None, ra, rb, ra, None, rb, ra, None, rb])
    mine = outs[4].outputs[0]
    assert mine.token_ids == alone.token_ids
    got = torch.tensor([[s.logprob, *s.top.values()] for s in mine.logprobs])  # (8, 4)
    want = torch.tensor([[s.logprob, *s.top.values()] for s in alone.logprobs])
    assert torch.equal(got, want)


def test_least_recently_used_adapters_are_let_go_and_reloaded(adapters):  # type: ignore[no-untyped-def]
    (ra, pa), (rb, pb) = adapters["a"], adapters["b"]
    llm = LLM(str(adapters["model"]), kv_cache_memory="64MiB", enable_lora=True, max_loras=1)
    p = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    for lr, pm in ((ra, pa), (rb, pb), (ra, pa)):
        assert llm.generate([PROMPT], p, lora_request=lr, use_tqdm=False)[0].outputs[0].token_ids == \
            peft_greedy(pm, PROMPT, 5)
        assert [x.name for x in llm.engine.lora.loaded()] == [lr.lora_name]


def write_adapter(src: Path, dst: Path, config: dict | None = None, drop: str | None = None,
                  rename: tuple[str, str] | None = None, raw_config: str | None = None) -> str:
    """A copy of the adapter at src with its config updated (None values: keys removed; or replaced
    by raw_config's text) and a tensor dropped or renamed."""
    from safetensors.torch import load_file, save_file
    dst.mkdir()
    cfg = json.loads((src / "adapter_config.json").read_text()) | (config or {})
    cfg = {k: v for k, v in cfg.items() if v is not None}
    (dst / "adapter_config.json").write_text(raw_config if raw_config is not None else json.dumps(cfg))
    t = load_file(str(src / "adapter_model.safetensors"))
    if drop:
        t = {k: v for k, v in t.items() if drop not in k}
    if rename:
        t = {k.replace(*rename): v for k, v in t.items()}
    save_file(t, str(dst / "adapter_model.safetensors"))
    return str(dst)


def test_bad_adapters_are_refused_naming_the_field(adapters, llm, tmp_path):  # type: ignore[no-untyped-def]
    a = adapters["root"] / "a"
    p = SamplingParams(max_tokens=2)
    cases = {
        "lora_path": [str(tmp_path / "missing"), write_adapter(a, tmp_path / "dora", {"use_dora": True}),
                      write_adapter(a, tmp_path / "bias", {"bias": "all"}),
                      # (an aLoRA was applied at every position: PEFT applies it from the invocation tokens on)
                      write_adapter(a, tmp_path / "alora", {"alora_invocation_tokens": [70, 71]}),
                      write_adapter(a, tmp_path / "params", {"target_parameters": ["mlp.experts.down_proj"]}),
                      # (taken before, its deltas on the wrong layers: PEFT stacks copies of the base's layers)
                      write_adapter(a, tmp_path / "replicated", {"layer_replication": [[0, 1], [0, 1]]}),
                      write_adapter(a, tmp_path / "half", drop="q_proj.lora_B"),
                      write_adapter(a, tmp_path / "head", rename=("layers.0.mlp.down_proj", "lm_head")),
                      write_adapter(a, tmp_path / "deep", raw_config="[" * 100000 + "]" * 100000)],
        "lora_request": [write_adapter(a, tmp_path / "big", {"r": 64})],
    }
    for i, (field, paths) in enumerate(cases.items()):
        for j, path in enumerate(paths):
            with pytest.raises(ValueError, match=f"^{field}"):
                llm.generate([PROMPT], p, lora_request=LoRARequest(f"bad{i}{j}", 100 + 10 * i + j, path))
    assert llm.generate([PROMPT], p, lora_request=adapters["a"][0], use_tqdm=False)  # id 1 is "a" now
    with pytest.raises(ValueError, match="^lora_request.lora_int_id"):
        llm.generate([PROMPT], p, lora_request=LoRARequest("other", 1, str(a)))
    with pytest.raises(ValueError, match="^lora_request.lora_int_id"):
        LoRARequest("x", 0, str(a))
    with pytest.raises(ValueError, match="^lora_request"):
        LLM(str(adapters["model"]), kv_cache_memory="64MiB").generate([PROMPT], p, lora_request=adapters["a"][0])
    assert llm.generate([PROMPT], p, lora_request=adapters["a"][0], use_tqdm=False)[0].outputs[0].token_ids
    assert llm.stats().used_blocks == 0


def test_default_model_quantized_adapter_rows_run_the_cpu_plan(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    """The default model as served (its GGUF blocks through the CPU decode plan): decode steps with adapter
    rows run the plan too (decode.c adds the deltas), with the module path's bits: the same tokens and
    logprobs with the plan off. An adapter with B = 0 (PEFT's initial one) gives the base model's, bit for
    bit; a trained one changes them, and a batch mixing both gives each its own alone-run's."""
    import transformers as tf
    llm = LLM(enable_lora=True)
    cfg = llm.engine.model_config
    hf = tf.LlamaForCausalLM(tf.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        tie_word_embeddings=True))  # (only the adapter's shapes come from it)
    peft.get_peft_model(hf, peft.LoraConfig(r=8, target_modules=ALL)).save_pretrained(tmp_path / "zero")
    del hf
    trained = write_adapter(tmp_path / "zero", tmp_path / "trained")
    from safetensors.torch import load_file, save_file
    t = load_file(trained + "/adapter_model.safetensors")
    g = torch.Generator().manual_seed(0)
    save_file({k: torch.randn(v.shape, generator=g) * 0.05 for k, v in t.items()}, trained + "/adapter_model.safetensors")
    zero, lora = LoRARequest("zero", 1, str(tmp_path / "zero")), LoRARequest("trained", 2, trained)
    model = llm.engine.model
    plan = model.cpu_plan()
    assert plan is not None
    from tests.test_cpu_decode import record_runs
    calls = record_runs(plan, monkeypatch)
    p = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    prompt = "The capital of France is"

    def run(req, plan_on=True):  # type: ignore[no-untyped-def]
        calls.clear()
        model._cpu_plan = plan if plan_on else None
        out = llm.generate([prompt], p, lora_request=req, use_tqdm=False)[0].outputs[0]
        assert (len(calls) >= 10) == plan_on  # the decode steps ran the plan, or not
        return out.token_ids, [(s.logprob, s.top) for s in out.logprobs]
    base = run(None)
    assert run(zero) == base
    with_plan = run(lora)
    assert with_plan[0] != base[0] and with_plan == run(lora, plan_on=False)
    mixed = llm.generate([prompt, prompt], p, lora_request=[lora, None], use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == with_plan[0] and mixed[1].outputs[0].token_ids == base[0]


def test_a_config_without_lora_alpha_takes_peft_default(adapters, llm, tmp_path):  # type: ignore[no-untyped-def]
    """PEFT's LoraConfig default lora_alpha is 8 (not r): a hand-written config without the key scales as PEFT
    reads it."""
    path = write_adapter(adapters["root"] / "a", tmp_path / "noalpha", {"lora_alpha": None})
    assert "lora_alpha" not in json.loads((Path(path) / "adapter_config.json").read_text())
    pm = peft.PeftModel.from_pretrained(copy.deepcopy(adapters["hf"]), path).eval()
    with torch.no_grad():
        ref = pm(torch.tensor([PROMPT])).logits[0].float()
    assert (llm.score(PROMPT, lora_request=LoRARequest("noalpha", 77, path)) - ref).abs().max() < 1e-4


def test_a_load_never_holds_up_lookups_or_unloads(adapters, monkeypatch):  # type: ignore[no-untyped-def]
    """While one adapter's files are read (held here until released), a loaded adapter is still looked up
    and another name unloaded: neither waits for the load (they ran under its lock, and the server's
    unload on the event loop, so every stream stopped for the load's length)."""
    import threading

    from lmserve.lora import registry
    from lmserve.server.async_engine import AsyncEngine
    from lmserve.server.lora_api import LoRAModules
    (ra, _), (rb, _) = adapters["a"], adapters["b"]
    llm = LLM(str(adapters["model"]), kv_cache_memory="16MiB", enable_lora=True)
    mods = LoRAModules(AsyncEngine(llm.engine), [("a2", ra.lora_path)], ("tiny",))  # id 1
    ra = mods.requests["a2"]
    gate, entered = threading.Event(), threading.Event()
    real = registry.load_adapter

    def held(*a, **k):  # type: ignore[no-untyped-def]
        entered.set()
        gate.wait(60)
        return real(*a, **k)
    monkeypatch.setattr(registry, "load_adapter", held)
    loader = threading.Thread(target=mods.add, args=("b2", rb.lora_path))
    loader.start()
    try:
        assert entered.wait(30)
        others = [threading.Thread(target=llm.engine.lora.get, args=(ra,)), threading.Thread(target=mods.remove,
                                                                                             args=("a2",))]
        for t in others:
            t.start()
        for t in others:
            t.join(30)
        assert not any(t.is_alive() for t in others) and loader.is_alive()  # done while the load is held
        assert "a2" not in mods.requests and "b2" not in mods.requests
    finally:
        gate.set()
        loader.join(30)
    assert "b2" in mods.requests


def test_cpu_kernel_matches_float64(tmp_path):  # type: ignore[no-untyped-def]
    """decode.c's lm_lora_add: the rows of one group get (x At) Bt added, the others are left as they were;
    against float64 (widths off the vector lengths, ranks 1..48)."""
    from lmserve.layers import cpu_native
    if not cpu_native.available():
        pytest.skip("no C compiler: the torch path serves")
    g = torch.Generator().manual_seed(0)
    for b, k, r, n in ((1, 64, 16, 96), (5, 37, 3, 11), (7, 576, 48, 960), (3, 9, 1, 5), (2, 40, 33, 700)):
        x, y = torch.randn(b, k, generator=g), torch.randn(b, n, generator=g)
        at, bt = torch.randn(k, r, generator=g), torch.randn(r, n, generator=g)
        groups = torch.tensor([i % 3 - 1 for i in range(b)])  # -1, 0, 1, -1, ...
        got = y.clone()
        cpu_native.lora_add(x, got, at, bt, groups, 0)
        want = y.double() + (groups == 0).double()[:, None] * (x.double() @ at.double() @ bt.double())
        assert (got.double() - want).abs().max() < 1e-4 * max(1.0, want.abs().max().item())
        assert torch.equal(got[groups != 0], y[groups != 0])
        every = y.clone()
        cpu_native.lora_add(x, every, at, bt, None, 0)
        assert torch.allclose(every.double(), y.double() + x.double() @ at.double() @ bt.double(), atol=1e-3)
        if r % 3 == 0:  # three shards of r / 3 rows, each reaching a third of the columns (the rest of Bt: 0)
            cut = [0, n // 3, 2 * n // 3, n]
            spans = torch.tensor([(cut[s], cut[s + 1]) for s in range(3)])
            block = bt.clone()
            for s in range(3):
                block[s * r // 3:(s + 1) * r // 3, :cut[s]] = 0
                block[s * r // 3:(s + 1) * r // 3, cut[s + 1]:] = 0
            skipped, full = y.clone(), y.clone()
            cpu_native.lora_add(x, skipped, at, bt, groups, 1, spans)  # bt's off-span entries are never read
            cpu_native.lora_add(x, full, at, block, groups, 1)
            assert torch.equal(skipped, full)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_cpu_plan_with_adapters_equals_the_module_path(tiny_models, tmp_path, family, monkeypatch):  # type: ignore[no-untyped-def]
    """A quantized tiny model's decode steps through the CPU plan (decode.c's Llama and Gemma loops) with
    adapter rows: the module path's logits bit for bit, and a batch mixing two adapters and the base model
    gives the module path's tokens."""
    from lmserve.layers import cpu_native
    if not cpu_native.available() or not cpu_native.int8_x():
        pytest.skip("the plan runs where our CPU kernels take the tile kernel (AVX2 or VNNI)")
    from tests.conftest import make_tiny_gemma
    from tests.test_cpu_decode import record_runs
    path, hf = (tmp_path / "g", make_tiny_gemma(tmp_path / "g")) if family == "gemma3" else tiny_models[family]
    make_adapter(hf, tmp_path / "a", seed=5)
    make_adapter(hf, tmp_path / "b", targets=["k_proj", "up_proj", "down_proj"], r=2, seed=6)
    ra, rb = LoRARequest("a", 1, str(tmp_path / "a")), LoRARequest("b", 2, str(tmp_path / "b"))
    llm = LLM(str(path), kv_cache_memory="16MiB", block_size=4, quantization="int4", enable_lora=True)
    model = llm.engine.model
    plan = model.cpu_plan()
    assert plan is not None
    runs = record_runs(plan, monkeypatch)
    ids = [5, 9, 2, 7, 1, 3, 8, 8, 4, 6, 11, 2, 9, 30, 31, 32]
    with_plan = llm.score(ids, decode_from=3, lora_request=ra)
    assert len(runs) >= 13
    model._cpu_plan = None
    assert torch.equal(with_plan, llm.score(ids, decode_from=3, lora_request=ra))
    assert not torch.equal(with_plan, llm.score(ids, decode_from=3))
    prompts = [[5, 9, 2, 7], [4, 4, 8, 4, 4, 8], [1, 2, 3], [5, 9, 2, 7]]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    loras = [ra, rb, None, rb]
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=loras, use_tqdm=False)]
    model._cpu_plan = plan
    runs.clear()
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=loras, use_tqdm=False)] == ref
    assert len(runs) >= 9


# ---------------------------------------------------------------- the server

@pytest.fixture(scope="module")
def served(adapters, tmp_path_factory):  # type: ignore[no-untyped-def]
    """The tiny llama with a character tokenizer, adapter A from --lora-modules, runtime updates allowed."""
    pytest.importorskip("fastapi")
    from lmserve.server.app import build_app
    from lmserve.server.async_engine import AsyncEngine
    from tests.conftest import char_tokenizer_model
    from tests.test_server import serving
    model = char_tokenizer_model(adapters["model"], tmp_path_factory.mktemp("chars") / "m")
    llm = LLM(str(model), kv_cache_memory="64MiB", enable_lora=True,
              chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    ae = AsyncEngine(llm.engine)
    app = build_app(ae, "tiny", lora_modules=[("a", adapters["a"][0].lora_path)], allow_runtime_lora=True)
    with serving(app) as (url, _):
        yield url, llm.tokenizer, app.state.server


def test_server_serves_adapters_by_model_name(adapters, served):  # type: ignore[no-untyped-def]
    import httpx
    import openai
    (_, pa), (rb, pb) = adapters["a"], adapters["b"]
    served, tok, srv = served
    prompt = "Hello there"
    ids = tok.encode(prompt)
    tids = {"extra_body": {"return_token_ids": True}}
    with pa.disable_adapter():
        base = peft_greedy(pa, ids, 8)
    client = openai.OpenAI(base_url=served + "/v1", api_key="x", max_retries=0)
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"tiny", "a"} and models["a"].parent == "tiny" and models["a"].root == adapters["a"][0].lora_path
    r = client.completions.create(model="a", prompt=prompt, max_tokens=8, temperature=0, **tids)
    assert r.model == "a" and r.choices[0].token_ids == peft_greedy(pa, ids, 8)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, **tids)
    assert r.model == "tiny" and r.choices[0].token_ids == base
    chat = client.chat.completions.create(model="a", messages=[{"role": "user", "content": prompt}], max_tokens=8,
                                          temperature=0, **tids)
    assert chat.model == "a" and chat.choices[0].token_ids == peft_greedy(pa, ids, 8)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="b", prompt=prompt, max_tokens=2)
    post = lambda path, body: httpx.post(served + path, json=body, timeout=60)  # noqa: E731
    assert post("/v1/load_lora_adapter", {"lora_name": "b", "lora_path": rb.lora_path}).status_code == 200
    assert "b" in {m.id for m in client.models.list().data}
    assert "b" in httpx.get(served + "/openapi.json").json()["components"]["schemas"]["CompletionRequest"][
        "properties"]["model"]["anyOf"][0]["enum"]
    r = client.completions.create(model="b", prompt=prompt, max_tokens=8, temperature=0, **tids)
    assert r.choices[0].token_ids == peft_greedy(pb, ids, 8)
    bad = post("/v1/load_lora_adapter", {"lora_name": "c", "lora_path": "/nonexistent"})
    assert bad.status_code == 404 and bad.json()["error"]["param"] == "lora_path"  # vLLM's "No adapter found"
    bad = post("/v1/load_lora_adapter", {"lora_name": "c", "lora_path": str(adapters["root"])})  # no adapter_config
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
    again = post("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": rb.lora_path})
    assert again.status_code == 400 and "already in use" in again.json()["error"]["message"]
    assert post("/v1/load_lora_adapter", {"lora_name": 3}).json()["error"]["param"] == "lora_name"
    assert post("/v1/unload_lora_adapter", {"lora_name": "b"}).status_code == 200
    assert post("/v1/unload_lora_adapter", {"lora_name": "b"}).status_code == 404
    from lmserve.server.errors import ApiError
    with pytest.raises(ApiError) as gone:  # a body read before the unload, run after it: a 404, not the base model
        srv.adapter("b")
    assert gone.value.status == 404 and srv.adapter("tiny") is None and srv.adapter("a").lora_name == "a"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="b", prompt=prompt, max_tokens=2)


def test_pooling_routes_name_the_adapter_unloaded_while_they_ran(adapters, served, monkeypatch):  # type: ignore[no-untyped-def]
    """/v1/embeddings, /score and /rerank named their model after the vectors were made: an adapter
    unloaded meanwhile made them, but the response named the base model (the generating routes fix the
    name when the request starts, as vLLM does)."""
    import httpx

    from lmserve.server import embeddings_api
    url, _, srv = served
    real = embeddings_api.embed_all

    async def then_unload(*a, **kw):  # type: ignore[no-untyped-def]
        out = await real(*a, **kw)
        srv.loras.remove("c")  # the unload lands while the request is finishing
        return out
    monkeypatch.setattr(embeddings_api, "embed_all", then_unload)
    for path, body in (("/v1/embeddings", {"input": "hi"}), ("/score", {"text_1": "a", "text_2": "b"}),
                       ("/rerank", {"query": "a", "documents": ["b", "c"]})):
        assert httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "c", "lora_path":
                                                               adapters["a"][0].lora_path}, timeout=60).status_code == 200
        r = httpx.post(url + path, json={"model": "c", **body}, timeout=60)
        assert r.status_code == 200 and r.json()["model"] == "c", (path, r.text)


def test_lora_modules_flag_forms_and_a_bad_adapter_at_start(adapters):  # type: ignore[no-untyped-def]
    from lmserve.server.lora_api import parse_lora_modules
    assert parse_lora_modules(["a=/x", '{"name": "b", "path": "/y=z", "base_model_name": "m"}']) == \
        [("a", "/x", None), ("b", "/y=z", "m")]  # (base_model_name was dropped: /v1/models's parent, vLLM's)
    from lmserve.server.lora_api import LoRAModules

    class Engine:  # loads nothing: the names and parents are what is checked
        load_lora = unload_lora = staticmethod(lambda *a: None)
    mods = LoRAModules(Engine(), [("a", "/x"), ("b", "/y", "org/base-7b")], ("tiny",))
    assert {c["id"]: c["parent"] for c in mods.cards("tiny", 64)} == {"a": "tiny", "b": "org/base-7b"}
    mods.remove("b")
    mods.add("b", "/z")  # a runtime load under the name: the served model's
    assert {c["id"]: c["parent"] for c in mods.cards("tiny", 64)} == {"a": "tiny", "b": "tiny"}
    with pytest.raises(ValueError, match="^lora_modules"):
        parse_lora_modules(['{"name": "c", "path": "/x", "base_model_name": 7}'])
    for bad in (["a"], ["=x"], ["a=/x", "a=/y"], ['{"name": 1}'], ["{oops"]):
        with pytest.raises(ValueError, match="^lora_modules"):
            parse_lora_modules(bad)
    from lmserve.server.app import build_app
    from lmserve.server.async_engine import AsyncEngine
    llm = LLM(str(adapters["model"]), kv_cache_memory="64MiB", enable_lora=True)
    with pytest.raises(ValueError, match="^lora_path"):
        build_app(AsyncEngine(llm.engine), "tiny", lora_modules=[("a", "/nonexistent")], manage_engine=False)


def test_lora_requests_info_metric(adapters, llm, served):  # type: ignore[no-untyped-def]
    """Engine stats name the adapters of waiting and running sequences; /metrics gives them as vLLM's
    vllm:lora_requests_info (labels max_lora, running_lora_adapters, waiting_lora_adapters), which LoRA-aware
    gateways route by."""
    import httpx
    eng = llm.engine
    eng.add_request("m1", PROMPT, SamplingParams(max_tokens=50), lora_request=adapters["b"][0])
    eng.add_request("m2", PROMPT, SamplingParams(max_tokens=50), lora_request=adapters["a"][0])
    eng.add_request("m3", PROMPT, SamplingParams(max_tokens=50))
    st = eng.stats()
    assert st.waiting_loras == ("a", "b") and st.running_loras == () and st.max_loras == 4
    eng.step()
    assert eng.stats().running_loras == ("a", "b") and eng.stats().waiting_loras == ()
    for rid in ("m1", "m2", "m3"):
        eng.abort_request(rid)
    url = served[0]

    def info() -> str:
        text = httpx.get(url + "/metrics").text
        assert any(x.startswith("lmserve_lora_requests_info{") for x in text.splitlines())
        return next(x for x in text.splitlines() if x.startswith("vllm:lora_requests_info{"))
    line = info()
    assert 'max_lora="4"' in line and 'running_lora_adapters=""' in line and 'model_name="tiny"' in line
    body = {"model": "a", "prompt": "Hello", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as stream:  # adapter a, running
        lines = stream.iter_lines()
        next(lines)
        seen = []
        for _ in range(100):  # (each scrape, then a few more tokens read: the stream is never starved)
            seen.append(info())
            for _ in range(5):
                next(lines)
    assert any('running_lora_adapters="a"' in x and 'waiting_lora_adapters=""' in x for x in seen), seen[-1]


def test_runtime_adapters_reach_every_replica_behind_the_router(adapters, tmp_path):  # type: ignore[no-untyped-def]
    """Two replicas behind a round-robin router (found by the router hunt: a load went to one replica, so
    every other request for the adapter was a 404): a load through the router reaches every replica, one
    that was down at the time gets it when it comes back, every request gets the adapter's tokens, and an
    unload reaches them all."""
    pytest.importorskip("fastapi")
    import time

    import httpx

    from lmserve.router.app import build_router_app
    from lmserve.router.policy import Replica, Router
    from lmserve.server.app import build_app
    from lmserve.server.async_engine import AsyncEngine
    from tests.conftest import char_tokenizer_model
    from tests.test_server import serving
    rb, pb = adapters["b"]
    model = char_tokenizer_model(adapters["model"], tmp_path / "m")
    apps = [build_app(AsyncEngine(LLM(str(model), kv_cache_memory="32MiB", enable_lora=True).engine), "tiny",
                      allow_runtime_lora=True) for _ in range(2)]
    with serving(apps[0]) as (a, _), serving(apps[1]) as (b, _):
        router = Router([Replica(a), Replica(b)], "round-robin")
        with serving(build_router_app(router, health_interval=0.3)) as (url, _):
            names = lambda base: {m["id"] for m in httpx.get(base + "/v1/models").json()["data"]}  # noqa: E731
            for _ in range(100):
                if all(r.healthy for r in router.replicas):
                    break
                time.sleep(0.05)
            # as if down, as a failed request marks it (flipping `healthy` alone, a health check that had started
            # before marked it up again without the replay): the load reaches the other alone
            router.replicas[1].mark_down()
            r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": rb.lora_path}, timeout=60)
            assert r.status_code == 200, r.text
            for _ in range(100):  # its next health check brings it back, with the adapter
                if router.replicas[1].healthy:
                    break
                time.sleep(0.05)
            assert "b" in names(a) and "b" in names(b)
            ids = [ord(c) for c in "Hello"]
            want = peft_greedy(pb, ids, 6)
            for _ in range(4):  # round-robin: twice to each
                r = httpx.post(url + "/v1/completions", json={"model": "b", "prompt": ids, "max_tokens": 6,
                                                              "temperature": 0, "return_token_ids": True}, timeout=60)
                assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == want, r.text
            assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "b"}, timeout=60).status_code == 200
            assert "b" not in names(a) and "b" not in names(b)
            # an unload a replica missed (one failed health check; it kept running): it was never sent, so
            # that replica served the old adapter, and refused a new one under the name (a defect hunt)
            ra, pa = adapters["a"]
            load = lambda r: httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": r.lora_path},  # noqa: E731
                                        timeout=60)
            assert load(rb).status_code == 200 and "x" in names(b)
            router.replicas[1].mark_down()
            assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "x"}, timeout=60).status_code == 200
            for _ in range(100):  # its next health check brings it back, and unloads x there first
                if router.replicas[1].healthy:
                    break
                time.sleep(0.05)
            assert "x" not in names(a) and "x" not in names(b)
            assert load(ra).status_code == 200
            want = peft_greedy(pa, ids, 6)
            for _ in range(4):
                r = httpx.post(url + "/v1/completions", json={"model": "x", "prompt": ids, "max_tokens": 6,
                                                              "temperature": 0, "return_token_ids": True}, timeout=60)
                assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == want, r.text
