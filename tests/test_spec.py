"""Speculative decoding: exact greedy equality, the output distribution, rollback without leaks."""

from __future__ import annotations

import random

import pytest
import torch

from lmserve import LLM, SamplingParams
from lmserve.sampling.rejection import verify, verify_greedy
from tests.test_sampling import chi2_pvalue, two_sample_pvalue

# repetitive prompts so that n-gram lookup finds continuations
PROMPTS = [[5, 6, 7, 8] * 6 + [5, 6], list(range(20, 40)) * 2 + [20, 21], [9, 9, 3] * 5, [11, 12, 13]]


def spec_llm(path, method: str, **kw):  # type: ignore[no-untyped-def]
    opts = dict(speculative_method=method, num_speculative_tokens=4, spec_max_batch=1000, spec_min_acceptance=0.0)
    if method == "draft":
        opts["draft_num_layers"] = 1
    return LLM(str(path), **{**opts, **kw})


def mode_kwargs(path, mode: str) -> dict:  # type: ignore[no-untyped-def]
    """Engine options for a speculation exactness run: plain; prefix (a small block size, prefix caching);
    preempt (a pool of 40 four-token blocks: preemptions); chunked (prompts in chunks of 8 tokens)."""
    if mode == "preempt":
        from lmserve.kv.cache import KVCache
        from lmserve.models.loader import hf_config
        per_block = KVCache.bytes_per_block(hf_config(path), 4, torch.float32)
        return dict(block_size=4, kv_cache_memory=per_block * 40, enable_prefix_caching=False)
    if mode == "prefix":
        return dict(block_size=4, enable_prefix_caching=True)
    if mode == "chunked":
        return dict(max_num_batched_tokens=8, max_num_seqs=4)
    return {}


@pytest.mark.parametrize("method", ["ngram", "draft"])
@pytest.mark.parametrize("mode", ["plain", "prefix", "preempt"])
def test_greedy_identical_to_plain(tiny_models, method, mode):  # type: ignore[no-untyped-def]
    path, _ = tiny_models["llama"]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    kw = mode_kwargs(path, mode)
    plain = LLM(str(path), **kw)
    llm = spec_llm(path, method, **kw)
    if mode == "prefix":  # warm the prefix cache, then ask again: the follow-ups hit what was cached
        for x in (plain, llm):
            x.generate(PROMPTS[:2], params, use_tqdm=False)
            x.generate([o.prompt_token_ids + o.outputs[0].token_ids + [3]
                        for o in x.generate(PROMPTS[:2], params, use_tqdm=False)], params, use_tqdm=False)
    ref = plain.generate(PROMPTS, params, use_tqdm=False)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for a, b in zip(outs, ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    st = llm.stats()
    if mode == "prefix":  # defect 4: blocks filled by accepted drafts are registered under their real hash
        assert st.prefix_hit_tokens == plain.stats().prefix_hit_tokens > 0
    assert st.spec["proposed"] > 0 and st.spec["accepted"] > 0
    assert st.used_blocks == 0 and st.free_blocks == st.num_blocks
    if mode == "preempt":
        assert st.num_preemptions > 0
    if method == "draft":
        bm = llm.engine.spec.proposer.bm
        assert bm.num_free_blocks == bm.num_blocks  # the draft's own cache is all free too


def test_rejection_two_tokens_exact():
    """V = {A, B}; draft p(A) = 0.8 > target q(A) = 0.3. Emitted token must be distributed as q."""
    q = torch.tensor([[0.3, 0.7], [0.5, 0.5]], dtype=torch.float64)
    p = torch.tensor([[0.8, 0.2]], dtype=torch.float64)
    g = torch.Generator().manual_seed(0)  # the draft's draws
    r = random.Random(0)  # the verifier's
    counts = torch.zeros(2, dtype=torch.float64)
    accepted = [0, 0]
    drafted = [0, 0]
    rejected_to = torch.zeros(2, dtype=torch.float64)  # what a rejection resamples
    for _ in range(20000):
        x = int(torch.multinomial(p[0], 1, generator=g))  # the draft samples from p
        toks, acc = verify(q, [x], p, r, greedy=False)
        counts[toks[0]] += 1
        drafted[x] += 1
        accepted[x] += acc
        if not acc:
            rejected_to[toks[0]] += 1
    assert chi2_pvalue(counts, q[0]) > 1e-3
    # P(accept | draft A) = q(A) / p(A) = 0.375; P(accept | draft B) = min(1, 0.7 / 0.2) = 1
    rate = accepted[0] / drafted[0]
    assert abs(rate - 0.375) < 4 * (0.375 * 0.625 / drafted[0]) ** 0.5
    assert accepted[1] == drafted[1] > 0
    # a rejection resamples from max(0, q - p) normalised = all mass on B
    assert rejected_to[0] == 0 and rejected_to[1] == drafted[0] - accepted[0] > 0


def test_rejection_multi_position_and_point_mass():
    torch.manual_seed(0)
    V, k = 6, 3
    q = torch.softmax(torch.randn(k + 1, V, dtype=torch.float64), -1)
    p = torch.softmax(torch.randn(k, V, dtype=torch.float64), -1)
    g = torch.Generator().manual_seed(1)  # the draft's draws
    r = random.Random(1)  # the verifier's
    first = torch.zeros(V, dtype=torch.float64)
    second = torch.zeros(V, dtype=torch.float64)
    for _ in range(20000):
        drafts = [int(torch.multinomial(p[i], 1, generator=g)) for i in range(k)]
        toks, _ = verify(q, drafts, p, r, greedy=False)
        first[toks[0]] += 1
        if len(toks) > 1:
            second[toks[1]] += 1
    assert chi2_pvalue(first, q[0]) > 1e-3
    assert chi2_pvalue(second, q[1]) > 1e-3  # given the first was accepted, the next is ~ q1
    # point-mass drafts (n-gram): the same law holds with p = one-hot
    pm = torch.zeros(V, dtype=torch.float64)
    for _ in range(20000):
        toks, _ = verify(q, [2, 4], None, r, greedy=False)
        pm[toks[0]] += 1
    assert chi2_pvalue(pm, q[0]) > 1e-3
    # greedy accepts exactly the drafts that equal the argmax
    best = q.argmax(-1).tolist()
    assert verify(q, best[:k], None, None, greedy=True) == (best, k)
    wrong = (best[1] + 1) % V
    assert verify(q, [best[0], wrong, best[2]], None, None, greedy=True) == ([best[0], best[1]], 1)


def test_a_position_no_token_can_pass_accepts_no_draft():
    """A row whose logits were all masked (a grammar and allowed_token_ids that leave nothing) has NaN
    probabilities: its draft is rejected, with a point-mass draft and with a draft distribution (before,
    min(1, nan) read as 1 and the draft, a token nothing allowed, was accepted)."""
    q = torch.tensor([[0.5, 0.5, 0.0], [float("nan")] * 3, [1.0, 0.0, 0.0]], dtype=torch.float64)  # (k+1, V): row 1 dead
    p = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]], dtype=torch.float64)
    for seed in range(20):
        for probs in (None, p):
            toks, n = verify(q, [0, 2], probs, random.Random(seed), greedy=False)
            assert n <= 1 and toks[:n] == [0, 2][:n], (toks, n)


@pytest.mark.parametrize("extra", [{}, {"repetition_penalty": 1.5, "logit_bias": {7: 3.0}}, {"min_tokens": 4}])
def test_greedy_verification_argmax_is_target_probs_argmax(extra: dict) -> None:
    """The runner's greedy verification reads the processed argmax directly (Sampler.target_argmax):
    the same tokens as verifying against target_probs' one-hot rows, penalties, biases, min_tokens (EOS
    masked) and a grammar bitmask included, position by position."""
    from lmserve.sampling.sampler import Sampler, TokenView
    from lmserve.sequence import Sequence

    V, k = 64, 4
    g = torch.Generator().manual_seed(3)
    sampler = Sampler()
    for trial in range(20):
        params = SamplingParams(temperature=0, max_tokens=20, **extra)
        seq = Sequence("r", [1, 2, 3, 7, 7, 9], params, eos_token_ids=(5,))
        seq.token_ids += torch.randint(0, V, (k,), generator=g).tolist()  # drafts after the prompt
        views = [TokenView(seq, 6 + i) for i in range(k + 1)]
        logits = torch.randn(k + 1, V, generator=g) * 2
        bitmask = None
        if trial % 2:  # allow about half the tokens (int32 words of 32 bits), never none
            bitmask = torch.randint(-2**31, 2**31 - 1, (k + 1, V // 32), generator=g, dtype=torch.int64).to(torch.int32)
            bitmask[:, 0] |= 1
        best = sampler.target_argmax(logits, views, bitmask)
        assert best == sampler.target_probs(logits, views, bitmask).argmax(-1).tolist()
        wrong = (best[2] + 1) % V  # drafts 1-2 the target's, draft 3 not: its own token there instead
        assert verify_greedy(best, best[:2] + [wrong, best[3]]) == (best[:3], 2)
        assert verify_greedy(best, best[:k]) == (best, k)  # all accepted: the bonus token is the last row's


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_sampling_distribution_unchanged(tiny_models, method):  # type: ignore[no-untyped-def]
    path, _ = tiny_models["qwen2"]
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    N = 1500
    # a bias toward the prompt's pattern makes the n-gram drafts plausible, so many are accepted
    # (and many rejected): both branches of the rejection rule are exercised
    bias = {5: 5.0, 6: 5.0, 7: 5.0, 8: 5.0}
    params = [SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, seed=i, logit_bias=bias)
              for i in range(N)]
    plain = LLM(str(path), max_num_seqs=256, max_num_batched_tokens=4096)
    spec = spec_llm(path, method, max_num_seqs=256, max_num_batched_tokens=4096)
    a = plain.generate([prompt] * N, params, use_tqdm=False)
    b = spec.generate([prompt] * N, params, use_tqdm=False)
    st = spec.stats().spec
    assert st["accepted"] > 100 and st["proposed"] - st["accepted"] > 100
    for pos in range(1, 4):  # tokens 2..4 are the ones speculation produces
        ca = torch.bincount(torch.tensor([o.outputs[0].token_ids[pos] for o in a]), minlength=128).double()
        cb = torch.bincount(torch.tensor([o.outputs[0].token_ids[pos] for o in b]), minlength=128).double()
        assert two_sample_pvalue(ca, cb) > 1e-3, pos


def test_opt_out_and_dynamic_rule(tiny_models):  # type: ignore[no-untyped-def]
    path, _ = tiny_models["llama"]
    greedy = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    off = spec_llm(path, "ngram")
    off.generate(PROMPTS, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, speculative=False),
                 use_tqdm=False)
    assert off.stats().spec["proposed"] == 0  # per-request opt-out
    big_batch = spec_llm(path, "ngram", spec_max_batch=0)
    big_batch.generate(PROMPTS, greedy, use_tqdm=False)
    assert big_batch.stats().spec["proposed"] == 0  # more running than spec_max_batch: k = 0
    picky = spec_llm(path, "ngram", spec_min_acceptance=1.01)
    picky.generate(PROMPTS[:1], greedy, use_tqdm=False)
    eager = spec_llm(path, "ngram")
    eager.generate(PROMPTS[:1], greedy, use_tqdm=False)
    # below the acceptance floor a request pauses speculation (16 steps) after each probe
    assert 0 < picky.stats().spec["verifications"] < eager.stats().spec["verifications"]


def scripted(engine, prompt: list[int], chunks: list[list[int]], params: SamplingParams, monkeypatch):  # type: ignore[no-untyped-def]
    """Run one request through the real scheduler and output processing, with the runner replaced by
    a script: each step that samples returns the next chunk of tokens, as a speculative step that
    accepted len(chunk) - 1 drafts would (a plain run is chunks of one). A token's logprob depends
    only on its position, so plain and speculative runs must report the same ones."""
    from lmserve.runner import RunnerOutput
    from lmserve.sequence import Logprob

    script = iter(chunks)

    def execute(out):  # type: ignore[no-untyped-def]
        res = RunnerOutput({})
        for seq, n in out.scheduled:
            if seq.num_computed_tokens + n == seq.num_tokens:
                toks = next(script)
                res.sampled[seq] = toks
                res.logprobs[seq] = [Logprob(t, -0.01 * (seq.num_tokens + i), {t: -0.01 * (seq.num_tokens + i)})
                                     for i, t in enumerate(toks)]
        return res

    monkeypatch.setattr(engine.runner, "execute", execute)
    engine.add_request("scripted", prompt, params)
    final = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            final = o
    monkeypatch.undo()
    return final.outputs[0]


def test_speculative_outputs_equal_plain_with_stops_and_logprobs(smol, monkeypatch):  # type: ignore[no-untyped-def]
    """Defects 2 and 3: several tokens arriving in one step (accepted drafts) must end a request
    exactly where one token per step would: a stop string completed before an EOS / stop token in
    the same step wins, and the tokens dropped after any stop take their logprobs (and their share
    of cumulative_logprob) with them, and leave the generation_tokens metric (they stayed counted)."""
    eng = smol.engine
    tok = smol.tokenizer
    eos = tok.eos_token_ids[0]
    body = tok.encode(' So 2 + 2 = 4." He said it twice: 2 + 2 = 4." and left.', add_special_tokens=False)
    prompt = tok.encode("Quote:", add_special_tokens=False)
    stop_tok = body[len(body) // 2]
    rng = random.Random(0)
    cases = [
        (dict(stop=['."']), body + [eos]),
        (dict(stop=['."']), body[:body.index(tok.encode('."', add_special_tokens=False)[-1]) + 1] + [eos]),
        (dict(), body[:6] + [eos] + body[6:]),  # EOS mid-chunk: what follows it is dropped
        (dict(stop_token_ids=[stop_tok]), body),
        (dict(stop=["twice"], stop_token_ids=[stop_tok]), body),
        (dict(stop=["4"], include_stop_str_in_output=True), body),
        (dict(max_tokens=7), body),
    ]
    for kw, stream in cases:
        params = SamplingParams(**{"max_tokens": len(stream) + 4, "logprobs": 1, "temperature": 0, **kw})
        plain = scripted(eng, prompt, [[t] for t in stream], params, monkeypatch)
        for _ in range(6):  # random speculative chunkings of the same token stream
            cuts = sorted(rng.sample(range(1, len(stream)), rng.randint(1, min(6, len(stream) - 1))))
            chunks = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)])]
            counted = smol.stats().generation_tokens
            spec = scripted(eng, prompt, chunks, params, monkeypatch)
            assert smol.stats().generation_tokens - counted == len(spec.token_ids), (kw, chunks)  # (the metric)
            assert (spec.text, spec.token_ids, spec.finish_reason, spec.stop_reason) == \
                (plain.text, plain.token_ids, plain.finish_reason, plain.stop_reason), (kw, chunks)
            assert [(lp.token_id, lp.logprob) for lp in spec.logprobs] == \
                [(lp.token_id, lp.logprob) for lp in plain.logprobs]
            assert len(spec.logprobs) == len(spec.token_ids)
            assert spec.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in plain.logprobs), abs=1e-9)
    assert not eng.has_unfinished_requests() and smol.stats().used_blocks == 0


def test_draft_model_shares_the_kv_budget(tiny_models, monkeypatch):  # type: ignore[no-untyped-def]
    """The draft model's cache comes out of the one KV budget (it used to come on top of it), and on
    CUDA the memory profile runs after the draft's weights are loaded, so it counts them."""
    import lmserve.engine as engine_mod
    from lmserve.config import EngineConfig
    path, _ = tiny_models["llama"]
    budget = 4 * 2**20
    eng = spec_llm(path, "draft", kv_cache_memory=budget).engine
    size = lambda kv: sum(t.numel() * t.element_size() for t in kv.layers)  # noqa: E731
    target, draft = size(eng.kv_cache), size(eng.spec.proposer.kv)
    assert 0 < draft < target and target + draft <= budget
    assert target > budget * 0.6  # the 2-layer target gets about 2/3 of it, the 1-layer draft 1/3
    loaded: list[str] = []
    seen: list[int] = []
    real = engine_mod.load_model
    monkeypatch.setattr(engine_mod, "load_model", lambda c, *a: loaded.append(c.model) or real(c, *a))
    monkeypatch.setattr(engine_mod, "profile_kv_budget", lambda *a: seen.append(len(loaded)) or budget)
    cfg = EngineConfig(model=str(path), speculative_method="draft", draft_num_layers=1)
    object.__setattr__(cfg, "kv_cache_memory", None)  # as on CUDA: measured by the profile
    engine_mod.Engine(cfg)
    assert seen == [2]  # target and draft both loaded before the profile


def test_a_windowed_draft_keeps_the_blocks_its_next_step_reads(tiny_models):  # type: ignore[no-untyped-def]
    """A draft model with a sliding window (tiny Mistral, window 24, blocks of 4): the draft rounds
    must not free window blocks as of their speculative positions, since a rejection rolls the mirror
    back and its next step reads from the committed length's window (before, those blocks were freed
    and read as the masked null block: wrong drafts, not wrong output)."""
    from lmserve.kv.block_manager import NULL_BLOCK
    path, _ = tiny_models["mistral"]
    llm = spec_llm(path, "draft", block_size=4)
    prop = llm.engine.spec.proposer
    assert prop.bm.windows[0] == 24
    real = prop._mirror
    checked, missing = [0], []

    def checking(seq):  # type: ignore[no-untyped-def]
        m = real(seq)
        start = m.num_computed_tokens  # the next draft step reads the window of this position
        for g, table in enumerate(m.block_tables):
            for i in range(prop.bm.first_needed(g, start), min(len(table), prop.bm.blocks_needed(start))):
                checked[0] += 1
                if table[i] == NULL_BLOCK:
                    missing.append((seq.request_id, start, i))
        return m

    prop._mirror = checking
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=60, temperature=0, ignore_eos=True), use_tqdm=False)
    st = llm.stats()
    assert st.spec["proposed"] > st.spec["accepted"] > 0  # some drafts were rejected
    assert checked[0] > 0 and not missing, missing[:5]
    ref = LLM(str(path), block_size=4).generate(PROMPTS, SamplingParams(max_tokens=60, temperature=0, ignore_eos=True),
                                                use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]


def test_a_draft_model_drafts_nothing_past_its_own_context(tiny_models, tmp_path):  # type: ignore[no-untyped-def]
    """A draft whose max_position_embeddings (64) is below the target's context: a sequence past 64
    tokens decodes without drafts and the output is plain decoding's (before, the draft's rotary table
    ran out: IndexError out of Engine.step, the whole engine down)."""
    import json
    import shutil
    path, _ = tiny_models["llama"]
    short = tmp_path / "short"
    shutil.copytree(path, short)
    cfg = json.loads((short / "config.json").read_text())
    cfg["max_position_embeddings"] = 64
    (short / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(path), speculative_method="draft", draft_model=str(short), num_speculative_tokens=4,
              spec_max_batch=1000, spec_min_acceptance=0.0)
    assert llm.engine.max_model_len > 64
    prompts = [[5, 6, 7], [5, 6, 7, 8] * 15]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    ref = LLM(str(path)).generate(prompts, params, use_tqdm=False)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert llm.stats().spec["proposed"] > 0


def test_deterministic_mode_seeded_sampling_with_speculation_ignores_the_batch(tiny_models):  # type: ignore[no-untyped-def]
    """deterministic=True with n-gram speculation: a seeded request sampled at temperature 1 gives the
    same tokens alone and among 10 greedy requests (before, its number of drafts followed the batch,
    here spec_max_batch, and the draws of rejection sampling with it); the greedy ones still speculate."""
    path, _ = tiny_models["llama"]
    llm = LLM(str(path), deterministic=True, speculative_method="ngram", num_speculative_tokens=4,
              spec_min_acceptance=0.0, spec_max_batch=4)
    needle = [5, 6, 7, 8] * 6 + [5, 6]
    p = SamplingParams(max_tokens=30, temperature=1.0, seed=123, ignore_eos=True,
                       logit_bias={5: 4.0, 6: 4.0, 7: 4.0, 8: 4.0})
    alone = llm.generate([needle], p, use_tqdm=False)[0].outputs[0].token_ids
    # 8 short requests end early: the batch then falls to spec_max_batch and the 2 long ones speculate
    others = [[5, 6, 7, 8] * 3] * 2 + [[11 + i, 12, 13, 14] for i in range(8)]
    greedy = [SamplingParams(max_tokens=30 if i < 2 else 4, temperature=0, ignore_eos=True) for i in range(10)]
    batch = llm.generate([needle] + others, [p] + greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert alone == batch
    assert llm.stats().spec["accepted"] > 0  # the greedy requests speculated


def test_a_finished_sample_lets_its_draft_state_go_at_once(tiny_models):  # type: ignore[no-untyped-def]
    """n = 2 sampled children with draft-model speculation: a child that stops before its sibling frees
    its draft mirror (blocks of the draft's KV) the step it ends (before, only when the whole request
    ended, so a long sibling kept a finished child's draft blocks)."""
    path, _ = tiny_models["llama"]
    eng = spec_llm(path, "draft").engine
    prop = eng.spec.proposer
    early = 0
    for seed in range(8):
        params = SamplingParams(n=2, temperature=1.0, seed=seed, max_tokens=40, stop_token_ids=list(range(0, 128, 9)))
        eng.add_request(f"r{seed}", [5, 6, 7, 8], params)
        while eng.has_unfinished_requests():
            had = {id(s) for seqs in eng.requests.values() for s in seqs if id(s) in prop.mirrors}
            eng.step()
            for seqs in eng.requests.values():  # requests still running after this step
                for s in seqs:
                    if s.is_finished:
                        assert id(s) not in prop.mirrors, (seed, s.index)
                        early += id(s) in had
    assert early > 0  # some child with a mirror ended before its sibling
    assert not prop.mirrors and eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_a_draft_catches_up_in_forwards_of_the_token_budget(tiny_models):  # type: ignore[no-untyped-def]
    """Four 60-token prompts under a budget of 16 tokens a step: the target prefills them in chunks of
    16, and the draft's first catch-up now does too (before, all 4 x 60 tokens went through the draft
    in one forward, whatever the budget: a memory spike on long prompts). Output is plain decoding's."""
    path, _ = tiny_models["llama"]
    prompts = [[(7 * j + i) % 50 + 3 for i in range(60)] for j in range(4)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    llm = spec_llm(path, "draft", max_num_batched_tokens=16, max_num_seqs=4)
    prop = llm.engine.spec.proposer
    sizes: list[int] = []
    real = prop.model.forward
    prop.model.forward = lambda ids, *a: sizes.append(ids.numel()) or real(ids, *a)  # type: ignore[method-assign]
    outs = llm.generate(prompts, params, use_tqdm=False)
    ref = LLM(str(path), max_num_batched_tokens=16, max_num_seqs=4).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert llm.stats().spec["proposed"] > 0
    assert sizes and max(sizes) <= 16 + 4, sizes  # a catch-up's budget, then a round's one row a mirror
    bm = prop.bm
    assert bm.num_free_blocks == bm.num_blocks


def test_a_draft_always_feeds_the_last_committed_token(tiny_models):  # type: ignore[no-untyped-def]
    """The target as its own draft, two requests under a budget of 6 tokens: drafts are cut by the
    budget, and when the next committed token equals the mirror's draft the mirror had computed every
    committed token: its first draft round fed 0 tokens and read another row's logits, or raised
    IndexError (that step's drafting dropped). Every draft of the target itself is accepted now."""
    path, _ = tiny_models["llama"]
    prompts = [[5, 6], [9, 10]]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    llm = LLM(str(path), speculative_method="draft", num_speculative_tokens=4, spec_max_batch=1000,
              spec_min_acceptance=0.0, max_num_batched_tokens=6, max_num_seqs=2)
    prop = llm.engine.spec.proposer
    rows: list[int] = []
    real = prop.runner.build_inputs
    prop.runner.build_inputs = lambda out: rows.extend(n for _, n in out.scheduled) or real(out)  # type: ignore[method-assign]
    outs = llm.generate(prompts, params, use_tqdm=False)
    ref = LLM(str(path), max_num_batched_tokens=6, max_num_seqs=2).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert rows and min(rows) >= 1
    st = llm.stats().spec
    assert st["proposed"] == st["accepted"] > 0


def test_vllm_speculative_config_sets_the_fields(tiny_models):  # type: ignore[no-untyped-def]
    """vLLM's speculative_config dict (LLM(speculative_config=...), --speculative-config JSON): read into our
    fields; the n-gram run it sets speculates and gives plain greedy's tokens; bad keys name themselves."""
    from lmserve import LLM, SamplingParams
    from lmserve.config import EngineConfig
    c = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
                                         "prompt_lookup_min": 2})
    assert (c.speculative_method, c.num_speculative_tokens, c.ngram_max, c.ngram_min) == ("ngram", 4, 3, 2)
    assert c.replace(seed=1).speculative_method == "ngram"  # (a copy keeps them)
    d = EngineConfig(speculative_config={"model": "some/draft", "num_speculative_tokens": 2})
    assert (d.speculative_method, d.draft_model, d.num_speculative_tokens) == ("draft", "some/draft", 2)
    for bad, name in (({"method": "medusa"}, "speculative_config.method"), ({"foo": 1}, "speculative_config.foo"),
                      ({"method": "ngram", "draft_tensor_parallel_size": 2}, "draft_tensor_parallel_size")):
        with pytest.raises(ValueError, match=name):
            EngineConfig(speculative_config=bad)
    with pytest.raises(ValueError, match="not both"):
        EngineConfig(speculative_config={"method": "ngram"}, speculative_method="ngram")
    path = tiny_models["llama"][0]
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6]  # (a copy task: n-gram drafts find matches)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    plain = LLM(str(path), kv_cache_memory="64MiB").generate([prompt], params, use_tqdm=False)[0]
    spec = LLM(str(path), kv_cache_memory="64MiB", speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    out = spec.generate([prompt], params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    assert spec.stats().spec and spec.stats().spec["proposed"] > 0, spec.stats().spec


def test_a_draft_mirror_replaced_for_another_request_frees_its_blocks(tiny_models):  # type: ignore[no-untyped-def]
    """A mirror kept under a sequence object's id that a new request's sequence took (CPython reuses ids)
    is replaced, and its draft-cache blocks go back (they leaked before; EAGLE's state freed them)."""
    from lmserve.sequence import Sequence
    path, _ = tiny_models["llama"]
    prop = spec_llm(path, "draft").engine.spec.proposer
    bm = prop.bm
    old = Sequence("old", list(range(3, 40)), SamplingParams(max_tokens=4), eos_token_ids=(2,))
    old.generator = random.Random(0)
    prop.propose([old], [2])
    assert bm.num_free_blocks < bm.num_blocks  # old's mirror holds the prompt's draft KV
    new = Sequence("new", [5, 6, 7], SamplingParams(max_tokens=4), eos_token_ids=(2,))
    new.generator = random.Random(1)
    prop.mirrors[id(new)] = prop.mirrors.pop(id(old))  # as if `new` had taken old's id
    assert prop._mirror(new).request_id == "new"
    assert bm.num_free_blocks == bm.num_blocks
