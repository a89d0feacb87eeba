"""lmserve distill (spec/distill.py): the plain-torch student is the target's math (against HF
transformers), pruning keeps what it says it keeps, distillation lowers the KL on held-out text, the saved
folder loads (lmserve and transformers both give the student's logits), and as a draft it keeps
speculation exact (greedy identical, the sampling distribution unchanged)."""

from __future__ import annotations

import json
import random

import pytest
import torch

from lmserve import LLM, SamplingParams
from lmserve.spec import distill as D


@pytest.fixture(scope="module")
def target(tiny_models):  # type: ignore[no-untyped-def]
    """The tiny Llama target (float), its weights under HF names, and its own sampled text."""
    path, hf = tiny_models["llama"]
    llm = LLM(str(path), kv_cache_memory="16MiB")
    cfg = D.StudentConfig.of(llm.engine.model_config)
    state = D.teacher_state(llm.engine.model, llm.engine.model_config)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 128) for _ in range(4)] for _ in range(40)]
    outs = llm.generate(prompts, [SamplingParams(max_tokens=60, temperature=0.7, seed=i, ignore_eos=True)
                                  for i in range(40)], use_tqdm=False)
    seqs = [p + o.outputs[0].token_ids for p, o in zip(prompts, outs)]
    return llm, hf, cfg, state, seqs[:32], seqs[32:]


def test_the_student_is_the_targets_math(target):  # type: ignore[no-untyped-def]
    llm, hf, cfg, state, train, _ = target
    ids = train[0]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]  # (T, V) transformers on the same weights
        got = D.Student(cfg, state)(torch.tensor(ids))
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_pruning_keeps_the_strongest_parts_and_nothing_when_asked_for_all(target):  # type: ignore[no-untyped-def]
    llm, _, cfg, state, train, _ = target
    teacher = D.Student(cfg, state)
    imp = D.importance(teacher, train[:8])
    assert imp["influence"].shape == (cfg.num_layers,) and (imp["influence"] > 0).all()
    same, st, kept = D.prune(cfg, state, imp, cfg.num_layers, cfg.intermediate_size, cfg.num_kv_heads)
    assert kept == list(range(cfg.num_layers))
    ids = torch.tensor(train[1])
    with torch.no_grad():
        assert torch.equal(D.Student(same, st)(ids), teacher(ids))
    small, st, kept = D.prune(cfg, state, imp, 1, 48, 1)
    assert kept == [int(imp["influence"].argmax())]
    assert (small.num_layers, small.intermediate_size, small.num_kv_heads, small.num_heads) == (1, 48, 1, 2)
    old = f"model.layers.{kept[0]}."
    ch = torch.topk(imp[f"mlp{kept[0]}"], 48).indices.sort().values
    assert torch.equal(st["model.layers.0.mlp.gate_proj.weight"], state[old + "mlp.gate_proj.weight"][ch])
    g = int(imp[f"kv{kept[0]}"].argmax())  # the kept KV group and its two query heads
    d = cfg.head_dim
    assert torch.equal(st["model.layers.0.self_attn.k_proj.weight"], state[old + "self_attn.k_proj.weight"][g * d:(g + 1) * d])
    assert torch.equal(st["model.layers.0.self_attn.q_proj.weight"],
                       state[old + "self_attn.q_proj.weight"][2 * g * d:(2 * g + 2) * d])
    with pytest.raises(ValueError, match="num_layers"):
        D.prune(cfg, state, imp, cfg.num_layers + 1, 48, 1)


def test_distillation_lowers_the_held_out_kl_and_the_folder_loads(target, tmp_path):  # type: ignore[no-untyped-def]
    import transformers as tf
    llm, _, cfg, state, train, heldout = target
    imp = D.importance(D.Student(cfg, state), train[:8])
    small, st, _ = D.prune(cfg, state, imp, 1, 64, 1)
    student = D.Student(small, st)

    def held_kl() -> float:
        with torch.no_grad():
            return sum(D.kl_loss(student(torch.tensor(s)), llm.score(s), 1.0).item() for s in heldout) / len(heldout)

    before = held_kl()
    torch.manual_seed(0)
    curve = D.distill(student, train, lambda ids: llm.score(ids), steps=150, lr=3e-3, temperature=2.0,
                      progress=False)
    after = held_kl()
    assert len(curve) == 150 and after < 0.8 * before, (before, after)  # measured 0.242 -> 0.173
    D.save_student(student, tmp_path / "draft")
    ids = heldout[0]
    with torch.no_grad():
        mine = student(torch.tensor(ids))
        hf = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "draft").float().eval()(torch.tensor([ids])).logits[0]
    got = LLM(str(tmp_path / "draft"), kv_cache_memory="16MiB").score(ids)
    torch.testing.assert_close(got, mine, rtol=1e-4, atol=1e-4)  # lmserve serves the student it trained
    torch.testing.assert_close(hf, mine, rtol=1e-4, atol=1e-4)  # and so does transformers


def test_distill_command_makes_a_draft_that_keeps_speculation_exact(tiny_models, tmp_path):  # type: ignore[no-untyped-def]
    from lmserve.cli import main
    from tests.conftest import char_tokenizer_model
    from tests.test_sampling import two_sample_pvalue
    folder = char_tokenizer_model(tiny_models["llama"][0], tmp_path / "chars")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello there\nwhat is this\nonce upon a time\nabc def\n")
    out = tmp_path / "draft"
    assert main(["distill", "--model", str(folder), "--out", str(out), "--num-layers", "1", "--tokens", "800",
                 "--steps", "30", "--max-new-tokens", "40", "--prompts-file", str(prompts),
                 "--kv-cache-memory", "16MiB", "--no-progress"]) == 0
    meta = json.loads((out / "config.json").read_text())
    assert meta["num_hidden_layers"] == 1 and meta["lmserve_distill"]["trained_tokens"] > 0
    assert (out / "loss.png").is_file() and (out / "tokenizer.json").is_file()
    # greedy: identical with the distilled draft
    p = [[5, 6, 7, 8] * 3, list(range(20, 30)), [9, 9, 3] * 4]
    greedy = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    opts = dict(speculative_method="draft", draft_model=str(out), num_speculative_tokens=3, spec_max_batch=1000,
                spec_min_acceptance=0.0, max_num_seqs=256, max_num_batched_tokens=4096)
    plain, spec = LLM(str(folder)), LLM(str(folder), **opts)
    assert [o.outputs[0].token_ids for o in spec.generate(p, greedy, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in plain.generate(p, greedy, use_tqdm=False)]
    # sampling: the same distribution at the positions speculation produces
    N = 1500
    params = [SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, seed=i) for i in range(N)]
    a = plain.generate([p[0]] * N, params, use_tqdm=False)
    b = spec.generate([p[0]] * N, params, use_tqdm=False)
    st = spec.stats().spec
    assert st["accepted"] > 100 and st["proposed"] - st["accepted"] > 100, st
    for pos in range(1, 4):
        ca = torch.bincount(torch.tensor([o.outputs[0].token_ids[pos] for o in a]), minlength=128).double()
        cb = torch.bincount(torch.tensor([o.outputs[0].token_ids[pos] for o in b]), minlength=128).double()
        assert two_sample_pvalue(ca, cb) > 1e-3, pos
