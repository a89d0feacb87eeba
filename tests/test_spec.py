"""Speculative decoding: exact greedy equality, the output distribution, rollback without leaks."""

from __future__ import annotations

import random

import pytest
import torch

from lmserve import LLM, SamplingParams
from lmserve.sampling.rejection import verify
from tests.test_sampling import chi2_pvalue

# repetitive prompts so that n-gram lookup finds continuations
PROMPTS = [[5, 6, 7, 8] * 6 + [5, 6], list(range(20, 40)) * 2 + [20, 21], [9, 9, 3] * 5, [11, 12, 13]]


def spec_llm(path, method: str, **kw):  # type: ignore[no-untyped-def]
    opts = dict(speculative_method=method, num_speculative_tokens=4, spec_max_batch=1000, spec_min_acceptance=0.0)
    if method == "draft":
        opts["draft_num_layers"] = 1
    return LLM(str(path), **{**opts, **kw})


@pytest.mark.parametrize("method", ["ngram", "draft"])
@pytest.mark.parametrize("mode", ["plain", "prefix", "preempt"])
def test_greedy_identical_to_plain(tiny_models, method, mode):  # type: ignore[no-untyped-def]
    path, _ = tiny_models["llama"]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    kw: dict = {}
    if mode == "preempt":
        from lmserve.kv.cache import KVCache
        from lmserve.models.loader import hf_config
        per_block = KVCache.bytes_per_block(hf_config(path), 4, torch.float32)
        kw = dict(block_size=4, kv_cache_memory=per_block * 40, enable_prefix_caching=False)
    if mode == "prefix":
        kw = dict(block_size=4, enable_prefix_caching=True)
    ref = LLM(str(path)).generate(PROMPTS, params, use_tqdm=False)
    llm = spec_llm(path, method, **kw)
    if mode == "prefix":
        llm.generate(PROMPTS[:2], params, use_tqdm=False)  # warm the prefix cache
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for a, b in zip(outs, ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    st = llm.stats()
    assert st.spec["proposed"] > 0 and st.spec["accepted"] > 0
    assert st.used_blocks == 0 and st.free_blocks == st.num_blocks
    if mode == "preempt":
        assert st.num_preemptions > 0
    if method == "draft":
        bm = llm.engine.proposer.bm
        assert bm.num_free_blocks == bm.num_blocks  # the draft's own cache is all free too


def test_rejection_two_tokens_exact():
    """V = {A, B}; draft p(A) = 0.8 > target q(A) = 0.3. Emitted token must be distributed as q."""
    q = torch.tensor([[0.3, 0.7], [0.5, 0.5]], dtype=torch.float64)
    p = torch.tensor([[0.8, 0.2]], dtype=torch.float64)
    g = torch.Generator().manual_seed(0)  # the draft's draws
    r = random.Random(0)  # the verifier's
    counts = torch.zeros(2, dtype=torch.float64)
    accepted_a = drafted_a = 0
    for _ in range(20000):
        x = int(torch.multinomial(p[0], 1, generator=g))  # the draft samples from p
        toks, acc = verify(q, [x], p, r, greedy=False)
        counts[toks[0]] += 1
        if x == 0:
            drafted_a += 1
            accepted_a += acc
    assert chi2_pvalue(counts, q[0]) > 1e-3
    # P(accept | draft A) = q(A) / p(A) = 0.375 exactly; P(accept | draft B) = 1
    rate = accepted_a / drafted_a
    assert abs(rate - 0.375) < 4 * (0.375 * 0.625 / drafted_a) ** 0.5
    # and the analytic total: p(A) min(1, q/p) + P(reject) * residual(A) = 0.8 * 0.375 + 0 = 0.3
    assert abs(0.8 * min(1, 0.3 / 0.8) + (1 - 0.8 * 0.375 - 0.2) * 0 - q[0, 0].item()) < 1e-12


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


def two_sample_pvalue(a: torch.Tensor, b: torch.Tensor) -> float:
    """Chi-square test of homogeneity for two count vectors."""
    keep = (a + b) > 0
    a, b = a[keep], b[keep]
    n_a, n_b = a.sum(), b.sum()
    tot = a + b
    ea, eb = tot * n_a / (n_a + n_b), tot * n_b / (n_a + n_b)
    stat = ((a - ea) ** 2 / ea).sum() + ((b - eb) ** 2 / eb).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


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
