"""Sampler: statistical checks against softmax(logits / T), filter sets, penalties, seeds, stops."""

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


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; p-value from the regularized upper incomplete gamma."""
    n = counts.sum()
    expected = probs * n
    keep = expected > 0
    stat = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat.double() / 2))


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


@pytest.mark.parametrize("kind", ["top_k", "top_p", "min_p"])
def test_filters_never_emit_outside_allowed_set(kind):  # type: ignore[no-untyped-def]
    torch.manual_seed(1)
    V = 50
    logits = torch.randn(V) * 3
    p = torch.softmax(logits.double(), dim=-1)
    order = p.argsort(descending=True)
    if kind == "top_k":
        params = SamplingParams(temperature=1.0, top_k=5, max_tokens=1)
        allowed = set(order[:5].tolist())
    elif kind == "top_p":
        params = SamplingParams(temperature=1.0, top_p=0.6, max_tokens=1)
        before = p[order].cumsum(0) - p[order]
        allowed = set(order[before < 0.6].tolist())
    else:
        params = SamplingParams(temperature=1.0, min_p=0.2, max_tokens=1)
        allowed = set(torch.nonzero(p >= 0.2 * p.max()).flatten().tolist())
    seqs = make_seqs(params, 400)
    seen: set[int] = set()
    for _ in range(10):
        seen |= set(Sampler()(logits.expand(len(seqs), V).clone(), seqs).token_ids)
    assert seen <= allowed
    assert len(seen) == len(allowed) or len(allowed) > 8  # the whole allowed set shows up
    # within the allowed set, the renormalised distribution holds
    counts = torch.zeros(V, dtype=torch.float64)
    seqs = make_seqs(params, 1000, seed0=99)
    for _ in range(10):
        counts += torch.bincount(torch.tensor(Sampler()(logits.expand(1000, V).clone(), seqs).token_ids),
                                 minlength=V).double()
    mask = torch.zeros(V, dtype=torch.bool)
    mask[list(allowed)] = True
    q = torch.where(mask, p, 0.0)
    assert chi2_pvalue(counts, q / q.sum()) > 1e-3


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


def test_min_tokens_masks_eos_and_stop_ids():
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[7], max_tokens=5)
    s = Sequence("r", [1, 2], params, eos_token_ids=(0,))
    logits = torch.zeros(1, 10)
    logits[0, 0], logits[0, 7], logits[0, 5] = 9.0, 8.0, 1.0
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


def test_seeded_request_is_batch_invariant(tiny_models):  # type: ignore[no-untyped-def]
    path, _ = tiny_models["llama"]
    llm = LLM(str(path))
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=20, ignore_eos=True)
    alone = llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0].outputs[0].token_ids
    others = [[i, i + 1, i + 2] * (i % 4 + 1) for i in range(10, 17)]
    batch = llm.generate([[5, 6, 7, 8]] + others,
                         [params] + [SamplingParams(temperature=1.0, max_tokens=20 + i) for i in range(7)],
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
    full = llm.engine.score(prompt + out.token_ids).double().log_softmax(-1)
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
