"""Sampler: statistical checks against softmax(logits / T), filter sets, penalties, seeds, stops; and
the pooled chi-square helpers, one-sample (imported by tests/test_spec.py) and two-sample."""

from __future__ import annotations

import math
import os
import random

os.environ.setdefault("TRITON_INTERPRET", "1")  # the Gumbel kernel tests below; before anything imports triton

import pytest  # noqa: E402
import torch  # noqa: E402

from lmserve import LLM, SamplingParams  # noqa: E402
from lmserve.sampling.sampler import Sampler, apply_penalties  # noqa: E402
from lmserve.sequence import Sequence  # noqa: E402


def make_seqs(params: SamplingParams, n: int, seed0: int = 0, prompt=(1, 2, 3), eos=(0,)) -> list[Sequence]:  # type: ignore[no-untyped-def]
    seqs = []
    for i in range(n):
        s = Sequence(f"r{i}", list(prompt), params, eos_token_ids=eos)
        s.generator = random.Random(seed0 + i)
        seqs.append(s)
    return seqs


def pool_small_bins(expected: torch.Tensor, counts: torch.Tensor, least: float = 5.0
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge the bins whose expected count is below `least` into one bin (with as many of the next
    smallest as it takes to reach `least`): the chi-square approximation needs expected counts of
    about 5, and a hundred near-empty bins only add degrees of freedom. expected: (K,) used to order
    the bins; counts: (S, K). Returns (K',) and (S, K')."""
    small = int((expected < least).sum())
    if small == 0:
        return expected, counts
    order = expected.argsort()  # (K,) ascending
    exp_sorted, cnt_sorted = expected[order], counts[:, order]
    cum = exp_sorted.cumsum(0)  # (K,)
    m = small
    while m < len(cum) and cum[m - 1] < least:
        m += 1
    return (torch.cat([cum[m - 1:m], exp_sorted[m:]]),  # (K - m + 1,)
            torch.cat([cnt_sorted[:, :m].sum(1, keepdim=True), cnt_sorted[:, m:]], dim=1))  # (S, K - m + 1)


def _chi2_sf(stat: torch.Tensor, df: int) -> float:
    """Upper tail of the chi-square distribution: the regularized upper incomplete gamma."""
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat.double() / 2))


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit of counts (K,) to probs (K,), small bins pooled.
    A count in a bin of probability 0 is impossible: p = 0; a single possible bin: p = 1."""
    if counts[probs == 0].sum() > 0:
        return 0.0
    keep = probs > 0
    expected, obs = pool_small_bins(probs[keep].double() * counts.sum(), counts[keep].double().unsqueeze(0))
    if len(expected) == 1:  # one possible outcome (or one pooled bin): nothing to test
        return 1.0
    return _chi2_sf(((obs[0] - expected) ** 2 / expected).sum(), len(expected) - 1)


def two_sample_pvalue(a: torch.Tensor, b: torch.Tensor) -> float:
    """Chi-square test that two count vectors (K,) come from one distribution, small bins pooled."""
    obs = torch.stack([a, b]).double()[:, (a + b) > 0]  # (2, K)
    share = obs.sum(1) / obs.sum()  # (2,): each sample's part of all draws
    _, obs = pool_small_bins(obs.sum(0) * share.min(), obs)  # ordered by the smaller expected count
    expected = obs.sum(0) * share.unsqueeze(1)  # (2, K')
    return _chi2_sf(((obs - expected) ** 2 / expected).sum(), obs.shape[1] - 1)


def allowed_set(logits: torch.Tensor, params: SamplingParams) -> tuple[list[int], torch.Tensor]:
    """From the definitions, in float64: the tokens a row may emit under temperature, top-k, then
    top-p and min-p of the top-k distribution (the most likely token always stays), and the
    renormalised distribution over them (V,). Asserts that no token sits within 1e-4 of a cut, where
    the sampler's float32 could decide otherwise."""
    p = torch.softmax(logits.double() / params.temperature, dim=-1)  # (V,)
    order = p.argsort(descending=True)  # (V,)
    q = p[order].clone()  # (V,) sorted
    cuts = []  # (distance of each token from a cut,) per filter
    if params.top_k > 0:
        cuts.append(q[params.top_k - 1:params.top_k] - q[params.top_k:params.top_k + 1])
        q[params.top_k:] = 0
    q /= q.sum()
    live = q > 0
    before = q.cumsum(0) - q  # (V,) mass strictly before each token
    if params.top_p < 1:
        cuts.append((before - params.top_p)[live])
    if params.min_p > 0:
        cuts.append((q - params.min_p * q[0])[live])
    assert all(c.abs().min() > 1e-4 for c in cuts)
    keep = live & (before < params.top_p) & (q >= params.min_p * q[0])
    keep[0] = True
    allowed = order[keep]
    dist = torch.zeros_like(p)
    dist[allowed] = p[allowed] / p[allowed].sum()
    return sorted(allowed.tolist()), dist


def test_temperature_sampling_matches_softmax():
    torch.manual_seed(0)
    V, T = 12, 0.7
    logits = torch.randn(V, dtype=torch.float64) * 2
    expected = torch.softmax(logits / T, dim=-1)  # float64 reference
    params = SamplingParams(temperature=T, max_tokens=1)
    counts = torch.zeros(V, dtype=torch.float64)
    sampler = Sampler()
    seqs = make_seqs(params, 500, seed0=1234)
    for _ in range(40):  # 20,000 draws
        out = sampler(logits.float().expand(len(seqs), V).clone(), seqs)
        counts += torch.bincount(torch.tensor(out.token_ids), minlength=V).double()
    assert chi2_pvalue(counts, expected) > 1e-3
    # and the test has power: the same counts against the T=1 distribution are rejected
    assert chi2_pvalue(counts, torch.softmax(logits, dim=-1)) < 1e-6


FILTER_CASES = {  # per row of one batch: (temperature, top_k, top_p, min_p)
    "top_k": [(1.0, 1, 1.0, 0.0), (1.0, 2, 1.0, 0.0), (0.7, 3, 1.0, 0.0), (1.5, 5, 1.0, 0.0)],
    "top_p": [(1.0, -1, 0.1, 0.0), (1.0, -1, 0.3, 0.0), (0.7, -1, 0.5, 0.0), (1.5, -1, 0.35, 0.0)],
    "min_p": [(1.0, -1, 1.0, 0.9), (1.0, -1, 1.0, 0.5), (0.7, -1, 1.0, 0.3), (1.5, -1, 1.0, 0.6)],
    "combined": [(1.0, 6, 0.5, 0.0), (1.0, 4, 1.0, 0.4), (0.8, -1, 0.6, 0.3), (1.2, 5, 0.7, 0.2)],
}


@pytest.mark.parametrize("kind", list(FILTER_CASES))
def test_filters_never_emit_outside_allowed_set(kind):  # type: ignore[no-untyped-def]
    """Each row's samples fall exactly in its allowed set (computed from the definitions in float64):
    nothing outside it, every token of it with probability >= 1% seen, and the renormalised
    distribution within it. The sets are small (1 to ~6 of 40 tokens) and the logits flat, so a
    filter that lets one more token through emits it within a few dozen draws."""
    cases = FILTER_CASES[kind]
    R, V, copies = len(cases), 40, 250
    torch.manual_seed(1)
    logits = torch.randn(R, V)  # (R, V): one row per case
    params = [SamplingParams(temperature=t, top_k=k, top_p=tp, min_p=mp, max_tokens=1) for t, k, tp, mp in cases]
    allowed = [allowed_set(logits[r], params[r]) for r in range(R)]
    assert max(len(a) for a, _ in allowed) <= 8 and min(len(a) for a, _ in allowed) <= 2
    seqs = [s for r in range(R) for s in make_seqs(params[r], copies, seed0=1000 * r)]  # row r: copies of case r
    counts = torch.zeros(R, V, dtype=torch.float64)
    for _ in range(4):  # 1,000 draws per case
        out = torch.tensor(Sampler()(logits.repeat_interleave(copies, 0), seqs).token_ids).view(R, copies)
        for r in range(R):
            counts[r] += torch.bincount(out[r], minlength=V).double()
    for r, (tokens, dist) in enumerate(allowed):
        seen = torch.nonzero(counts[r]).flatten().tolist()
        assert set(seen) <= set(tokens), (cases[r], seen, tokens)
        assert set(seen) >= {t for t in tokens if dist[t] >= 0.01}, (cases[r], seen, tokens)
        assert chi2_pvalue(counts[r], dist) > 1e-3, cases[r]


def test_chi_square_pools_sparse_bins_and_has_power():
    """The spec distribution test's situation: 1,500 draws over 128 tokens, most of the mass on a few
    (a logit_bias), a long tail of nearly empty bins. Pooled, the same distribution passes and
    temperature 1 against 1.3 is rejected, one-sample and two-sample, and so is 1 against 1.15,
    which the test over all 128 bins would let through."""
    torch.manual_seed(2)
    V, N = 128, 1500
    logits = torch.randn(V, dtype=torch.float64) * 0.5
    logits[5:9] += 5.0
    g = torch.Generator().manual_seed(3)

    def sample(t: float) -> torch.Tensor:
        draws = torch.multinomial(torch.softmax(logits / t, -1), N, replacement=True, generator=g)
        return torch.bincount(draws, minlength=V).double()  # (V,)

    a, b, hot = sample(1.0), sample(1.0), sample(1.3)
    assert chi2_pvalue(a, torch.softmax(logits, -1)) > 1e-3
    assert chi2_pvalue(hot, torch.softmax(logits, -1)) < 1e-6
    assert two_sample_pvalue(a, b) > 1e-3
    assert two_sample_pvalue(a, hot) < 1e-6
    assert two_sample_pvalue(a, sample(1.15)) < 1e-6  # over all 128 bins: p = 6e-3, not rejected
    # pooling: every pooled bin expects at least 5 draws, and the counts keep their total
    expected, obs = pool_small_bins(torch.softmax(logits, -1) * N, a.unsqueeze(0))
    assert expected.min() >= 5 and len(expected) < 20 and obs.sum() == N


def test_penalties_match_reference():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 0.0, 1.0, -0.5, 0.25, 4.0]])
    params = SamplingParams(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.25,
                            logit_bias={4: 10.0}, max_tokens=5)
    s = Sequence("r", [0, 1, 3], params)
    s.token_ids += [3, 3, 6]  # outputs: 3 twice, 6 once
    out = apply_penalties(logits.clone(), [s])[0].double()
    ref = logits[0].double().clone()
    for t in {0, 1, 3, 6}:  # repetition over prompt + output
        ref[t] = ref[t] / 1.5 if ref[t] > 0 else ref[t] * 1.5
    ref[3] -= 0.25 * 2 + 0.5
    ref[6] -= 0.25 * 1 + 0.5
    ref[4] += 10.0
    assert torch.allclose(out, ref, atol=1e-6)


def test_logit_bias_comes_before_penalties():
    """As in vLLM v1: logit_bias first, then repetition, then frequency and presence, so a seen
    token with a bias gets penalty(logit + bias); the sign the repetition penalty sees is the biased one."""
    logits = torch.tensor([[0.5, -1.0, 2.0, 0.0, 0.0, 0.25]])
    params = SamplingParams(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.25,
                            logit_bias={1: 3.0, 2: -3.0, 5: 1.0}, max_tokens=5)
    s = Sequence("r", [0, 1], params)
    s.token_ids += [1, 2]  # outputs: 1 and 2 once each; 0 only in the prompt
    out = apply_penalties(logits.clone(), [s])[0].double()

    def rep(x: float) -> float:
        return x / 1.5 if x > 0 else x * 1.5

    ref = torch.tensor([rep(0.5), rep(-1.0 + 3.0) - (0.25 + 0.5), rep(2.0 - 3.0) - (0.25 + 0.5), 0.0, 0.0,
                        0.25 + 1.0], dtype=torch.float64)
    assert torch.allclose(out, ref, atol=1e-6)


def test_allowed_token_ids_and_bad_words_come_first():
    """vLLM's order: the allowed tokens mask the rest, a bad word's last token is banned where the output
    ends in its other tokens (a one-token word always), then logit_bias and penalties as before."""
    logits = torch.tensor([[0.5, -1.0, 2.0, 0.0, 3.0, 0.25, 1.0]])
    params = SamplingParams(allowed_token_ids=[1, 2, 4, 6], logit_bias={2: 1.0}, repetition_penalty=2.0, max_tokens=5)
    params.bad_words_token_ids = [[3, 4], [5, 6], [1]]  # [5, 6]: the output does not end in 5
    s = Sequence("r", [0], params)
    s.token_ids += [2, 3]  # outputs: 2, 3
    out = apply_penalties(logits.clone(), [s])[0].double()
    inf = float("-inf")
    ref = torch.tensor([inf, inf, (2.0 + 1.0) / 2.0, inf, inf, inf, 1.0], dtype=torch.float64)
    assert torch.equal(out, ref)


def test_bad_words_and_allowed_tokens_generate_as_a_reference_loop_does(tiny_models, tmp_path):  # type: ignore[no-untyped-def]
    """End to end on a character-level model: greedy decoding with bad_words equals a float64 loop over
    the model's own logits that bans each word's last character after the rest (alone, and after a
    space); sampled tokens stay inside allowed_token_ids, drawn as its renormalised distribution."""
    from lmserve import LLM
    from tests.conftest import char_tokenizer_model
    path = char_tokenizer_model(tiny_models["llama"][0], tmp_path / "llama")
    llm = LLM(str(path), kv_cache_memory="64MiB")
    bias = {ord("a"): 8.0, ord("b"): 8.0, ord(" "): 7.0}
    prompt = [ord(c) for c in "ab ab"]
    params = SamplingParams(max_tokens=16, temperature=0, logit_bias=bias, ignore_eos=True, bad_words=["aa", "b a"])
    got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    ids = list(prompt)
    words = [[ord(c) for c in w] for w in ("aa", "b a")]  # (" aa" is no word token of its own: vLLM's rule)
    for _ in range(16):
        row = llm.score(ids)[-1].double()  # (V,)
        for t, b in bias.items():
            row[t] += b
        out = ids[len(prompt):]
        for w in words:
            if len(w) == 1 or out[len(out) - len(w) + 1:] == w[:-1] and len(out) >= len(w) - 1:
                row[w[-1]] = float("-inf")
        ids.append(int(row.argmax()))
    assert got == ids[len(prompt):]
    free = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0, logit_bias=bias, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    assert "aa" in "".join(map(chr, free)) and "aa" not in "".join(map(chr, got))  # the bad words changed it
    params.bad_words = None  # the same SamplingParams again, without them: nothing is banned any more
    assert llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == free
    with pytest.raises(ValueError, match="allowed_token_ids: every one of them is a bad word"):
        llm.generate([prompt], SamplingParams(allowed_token_ids=[ord("x"), ord("x")], bad_words=["x"]))
    allowed = [ord(c) for c in "xyz"]
    ps = [SamplingParams(max_tokens=1, temperature=1.0, seed=i, allowed_token_ids=allowed) for i in range(600)]
    firsts = torch.tensor([o.outputs[0].token_ids[0] for o in llm.generate([prompt] * 600, ps, use_tqdm=False)])
    assert set(firsts.tolist()) <= set(allowed)
    probs = llm.score(prompt)[-1].double()[allowed].softmax(-1)  # (3,)
    counts = torch.stack([(firsts == t).sum() for t in allowed]).double()
    assert chi2_pvalue(counts, probs) > 1e-3


def test_min_tokens_masks_eos_and_stop_ids():
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[7], max_tokens=5)
    s = Sequence("r", [1, 2], params, eos_token_ids=(0,))
    logits = torch.zeros(1, 10)
    logits[0, 0], logits[0, 7], logits[0, 5] = 9.0, 8.0, 1.0
    assert Sampler()(logits.clone(), [s]).token_ids == [5]
    s.token_ids += [5, 5]
    assert Sampler()(logits.clone(), [s]).token_ids == [0]


def test_min_tokens_masks_eos_with_ignore_eos_too():
    """ignore_eos only keeps EOS from ending the output; min_tokens still keeps it out of the first
    tokens (vLLM's MinTokensLogitsProcessor bans EOS whatever ignore_eos says). Before, with ignore_eos
    an EOS-favouring model output EOS from the first token."""
    params = SamplingParams(temperature=0, min_tokens=2, ignore_eos=True, max_tokens=5)
    s = Sequence("r", [1, 2], params, eos_token_ids=(0,))
    logits = torch.zeros(1, 10)
    logits[0, 0], logits[0, 5] = 9.0, 1.0
    assert Sampler()(logits.clone(), [s]).token_ids == [5]
    s.token_ids += [5, 5]
    assert Sampler()(logits.clone(), [s]).token_ids == [0]


def test_greedy_is_argmax_and_logprobs_are_raw():
    logits = torch.randn(3, 20)
    seqs = make_seqs(SamplingParams(temperature=0, logprobs=3, max_tokens=1), 3)
    out = Sampler()(logits.clone(), seqs)
    assert out.token_ids == logits.argmax(-1).tolist()
    ref = logits.double().log_softmax(-1)
    for i, lp in enumerate(out.logprobs):
        assert lp is not None and abs(lp.logprob - ref[i, lp.token_id].item()) < 1e-5
        assert list(lp.top) == ref[i].topk(3).indices.tolist()


@pytest.mark.parametrize("path", ["cpu", "gumbel"])
def test_seeded_request_is_batch_invariant(path):  # type: ignore[no-untyped-def]
    """A seeded row's tokens depend only on its own params, logits and generator, not on its batch.

    "gumbel" is the path CUDA takes (Gumbel-max kernel, here under the Triton interpreter, for rows
    without filters; inverse CDF for rows with them); "cpu" is inverse CDF throughout. The seeded row,
    without filters (20 seeds) and then with top-p (5 seeds), is sampled alone and beside top-k /
    top-p / min-p, greedy and unfiltered rows, for 2 steps each (the interpreter runs ~20 rows/s)."""
    sampler = _gumbel_sampler() if path == "gumbel" else Sampler()
    torch.manual_seed(7)
    V = 16
    neighbours = [SamplingParams(temperature=1.0, top_k=3, max_tokens=3),
                  SamplingParams(temperature=0.8, top_p=0.7, max_tokens=3),
                  SamplingParams(temperature=0, max_tokens=3),
                  SamplingParams(temperature=1.2, max_tokens=3),
                  SamplingParams(temperature=1.0, min_p=0.3, max_tokens=3)]
    mine = [(SamplingParams(temperature=0.9, max_tokens=3), range(20)),
            (SamplingParams(temperature=0.9, top_p=0.9, max_tokens=3), range(5))]
    at = 2  # the seeded row's place in the batch
    differ = 0
    for params, seeds in mine:
        for seed in seeds:
            alone = make_seqs(params, 1, seed0=seed)
            batch = make_seqs(neighbours[0], 1, seed0=1000 + seed)  # the neighbours' own generators
            batch += [make_seqs(q, 1, seed0=2000 + 10 * seed + j)[0] for j, q in enumerate(neighbours[1:])]
            batch.insert(at, make_seqs(params, 1, seed0=seed)[0])
            for _ in range(2):
                logits = torch.randn(len(batch), V) * 2  # (B, V)
                a = sampler(logits[at:at + 1].clone(), alone).token_ids[0]
                assert sampler(logits.clone(), batch).token_ids[at] == a, (params, seed)
                differ += a != logits[at].argmax().item()
    assert differ > 10  # the seeded rows really sample (not an argmax that any path agrees on)


def test_seeded_request_is_batch_invariant_end_to_end(tiny_models):  # type: ignore[no-untyped-def]
    """Through the engine, CPU path: a seeded request without filters generates the same tokens alone
    and beside requests with top-k / top-p, and unseeded requests get different noise."""
    path, _ = tiny_models["llama"]
    llm = LLM(str(path))
    params = SamplingParams(temperature=1.0, seed=42, max_tokens=20, ignore_eos=True)
    alone = llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0].outputs[0].token_ids
    others = [[i, i + 1, i + 2] * (i % 4 + 1) for i in range(10, 17)]
    filters = [dict(top_k=5), dict(top_p=0.8), dict(min_p=0.2), dict()]
    batch = llm.generate([[5, 6, 7, 8]] + others,
                         [params] + [SamplingParams(temperature=1.0, max_tokens=20 + i, **filters[i % 4])
                                     for i in range(7)],
                         use_tqdm=False)
    assert batch[0].outputs[0].token_ids == alone
    unseeded = llm.generate([[5, 6, 7, 8]] * 2, SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True),
                            use_tqdm=False)
    assert unseeded[0].outputs[0].token_ids != unseeded[1].outputs[0].token_ids  # noise differs per request


def test_logprob_of_chosen_token_matches_forward(tiny_models):  # type: ignore[no-untyped-def]
    path, _ = tiny_models["qwen2"]
    llm = LLM(str(path))
    prompt = [3, 9, 27, 81 % 128]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    full = llm.score(prompt + out.token_ids).double().log_softmax(-1)
    for i, lp in enumerate(out.logprobs):
        assert math.isclose(lp.logprob, full[len(prompt) - 1 + i, lp.token_id].item(), abs_tol=1e-4)
    assert math.isclose(out.cumulative_logprob, sum(lp.logprob for lp in out.logprobs), abs_tol=1e-6)


def test_batched_penalties_and_logprobs_per_row():
    """Rows with different penalties and different logprob counts, in one batch: each row equals
    what it gets alone (the flat (row, token) scatter and the one-transfer readback keep rows apart)."""
    torch.manual_seed(3)
    V = 16
    logits = torch.randn(4, V)
    specs = [dict(repetition_penalty=1.3, logprobs=2), dict(frequency_penalty=0.7, logit_bias={5: 3.0}),
             dict(presence_penalty=0.4, logprobs=0, min_tokens=9), dict(logprobs=5)]
    seqs = []
    for i, kw in enumerate(specs):
        s = Sequence(f"r{i}", [i, i + 1, 2], SamplingParams(temperature=0, max_tokens=9, **kw), eos_token_ids=(4,))
        s.token_ids += [7, 7, i + 8]
        seqs.append(s)
    batch = Sampler()(logits.clone(), seqs)
    for i, s in enumerate(seqs):
        alone = Sampler()(logits[i:i + 1].clone(), [s])
        assert alone.token_ids[0] == batch.token_ids[i]
        assert (alone.logprobs[0] is None) == (batch.logprobs[i] is None) == (s.params.logprobs is None)
        if alone.logprobs[0] is not None:
            assert alone.logprobs[0] == batch.logprobs[i]
            assert len(batch.logprobs[i].top) == s.params.logprobs
    pen = apply_penalties(logits.clone(), seqs)
    assert pen[2, 4] == float("-inf")  # min_tokens bans eos on row 2 only
    assert torch.isfinite(pen[[0, 1, 3], 4]).all()
    assert torch.equal(pen[3], logits[3])  # a row without penalties is untouched


# --- the Gumbel-max kernel (CUDA's sampler for unfiltered batches), under the Triton interpreter
def _gumbel_sampler():  # type: ignore[no-untyped-def]
    pytest.importorskip("triton")
    return Sampler(gumbel=True)


def test_gumbel_kernel_matches_softmax():
    sampler = _gumbel_sampler()
    torch.manual_seed(0)
    V, T = 12, 0.7
    logits = torch.randn(V, dtype=torch.float64) * 2
    logits[5] = float("-inf")  # a banned token is never drawn
    expected = torch.softmax(logits / T, dim=-1)
    seqs = make_seqs(SamplingParams(temperature=T, max_tokens=1), 500, seed0=99)
    counts = torch.zeros(V, dtype=torch.float64)
    for _ in range(3):  # 1,500 draws (each row is one interpreted program: ~6 ms)
        out = sampler(logits.float().expand(len(seqs), V).clone(), seqs)
        counts += torch.bincount(torch.tensor(out.token_ids), minlength=V).double()
    assert counts[5] == 0
    assert chi2_pvalue(counts, expected) > 1e-3
    assert chi2_pvalue(counts, torch.softmax(logits, dim=-1)) < 1e-6  # it has power


def test_gumbel_kernel_greedy_rows_blocks_and_seeds():
    sampler = _gumbel_sampler()
    from lmserve.sampling.gumbel import gumbel_sample
    # a vocabulary over several 4096-wide blocks: the running argmax carries across blocks
    V = 9000
    logits = torch.full((3, V), -5.0)
    logits[0, 8999] = 5.0  # greedy row: its max is in the last, partial block
    logits[1, 4100] = 50.0  # hot row at T = 1: wins whatever the noise
    logits[2, 17] = 3.0
    toks = gumbel_sample(logits, torch.tensor([0.0, 1.0, 0.0]), torch.tensor([0, 7, 0]))
    assert toks.tolist() == [8999, 4100, 17]
    # a seeded row draws the same token alone and in a batch (its seed comes from its own generator)
    params = SamplingParams(temperature=1.0, max_tokens=1)
    flat = torch.zeros(1, 64)
    alone = [sampler(flat.clone(), make_seqs(params, 1, seed0=5)).token_ids[0] for _ in range(2)]
    batch = make_seqs(params, 6, seed0=0)
    batch[3] = make_seqs(params, 1, seed0=5)[0]
    assert alone[0] == alone[1] == sampler(flat.expand(6, 64).clone(), batch).token_ids[3]
    # mixed greedy and sampled rows, with penalties applied first
    g = Sequence("g", [1, 2], SamplingParams(temperature=0, max_tokens=3, logit_bias={3: 100.0}))
    s = make_seqs(params, 1, seed0=1)[0]
    out = sampler(torch.zeros(2, 64), [g, s])
    assert out.token_ids[0] == 3 and 0 <= out.token_ids[1] < 64


def test_a_row_without_filters_keeps_its_whole_vocabulary_beside_filtered_rows():
    """A real vocabulary (49,152): the unfiltered row's probabilities beside a top-k row are its
    probabilities alone, every token > 0 (before, the batch's filter pass applied its top_p = 1.0,
    and a float32 running sum reaches 1 thousands of tokens before the tail: ~4,800 tokens zeroed, so
    a seeded request's tokens followed its neighbours); so is a row asking top_p = 1.0 itself."""
    torch.manual_seed(3)
    logits = torch.randn(2, 49152) * 3  # (2, V)
    plain, topk = SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=20)
    alone = Sampler._probs(logits[:1].clone(), [plain])  # (1, V)
    beside = Sampler._probs(logits.clone(), [plain, topk])  # (2, V)
    assert (alone > 0).all() and torch.equal(beside[0], alone[0])
    assert int((beside[1] > 0).sum()) == 20
    asked = Sampler._probs(logits[:1].clone(), [SamplingParams(temperature=1.0, top_p=1.0, min_p=1e-30)])
    assert int((asked > 0).sum()) > 49000  # min_p 1e-30 drops nothing a float32 softmax holds


def test_top_k_keeps_the_tokens_tied_with_the_kth():
    """logits [2, 1, 1, 1, 0, -1], top_k = 2: the three tokens tied at 1 all stay (HF's TopKLogitsWarper
    and vLLM keep ties), the float64 softmax over the four; before, two of the tied three were cut by
    the sort's order."""
    logits = torch.tensor([[2.0, 1.0, 1.0, 1.0, 0.0, -1.0]])
    got = Sampler._probs(logits.clone(), [SamplingParams(temperature=1.0, top_k=2)])[0].double()
    ref = torch.tensor([2.0, 1.0, 1.0, 1.0], dtype=torch.float64).exp()
    ref = torch.cat([ref / ref.sum(), torch.zeros(2, dtype=torch.float64)])
    assert torch.allclose(got, ref, atol=1e-6), got


def test_a_vanishing_temperature_is_greedy(tiny_models):  # type: ignore[no-untyped-def]
    """temperature 1e-40: logits / T overflowed to inf and the draw fell on the last token of the
    vocabulary every time; below 1e-5 a temperature is greedy (vLLM's rule)."""
    assert SamplingParams(temperature=1e-40).temperature == 0 and SamplingParams(temperature=1e-4).temperature == 1e-4
    path, _ = tiny_models["llama"]
    llm = LLM(str(path))
    tiny, greedy = (llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, temperature=t, seed=1, ignore_eos=True),
                                 use_tqdm=False)[0].outputs[0].token_ids for t in (1e-40, 0))
    assert tiny == greedy and tiny != [llm.engine.vocab_size - 1] * 6


def test_seed_minus_one_means_unseeded(tiny_models):  # type: ignore[no-untyped-def]
    """seed -1 is "random" (vLLM's SamplingParams and llama.cpp read it so): three runs differ, as unseeded
    runs do; before, -1 was a fixed seed and the three were identical. Another negative seed is a seed."""
    from lmserve import LLM
    assert SamplingParams(seed=-1).seed is None and SamplingParams(seed=-2).seed == -2
    llm = LLM(str(tiny_models["llama"][0]), kv_cache_memory="16MiB")
    runs = [llm.generate([[5, 6, 7]], SamplingParams(temperature=1.0, max_tokens=16, seed=s), use_tqdm=False)[0]
            .outputs[0].token_ids for s in (-1, -1, -1, -2, -2)]
    assert len({tuple(r) for r in runs[:3]}) == 3 and runs[3] == runs[4]
