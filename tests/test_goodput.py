"""The goodput speculation policy (spec/goodput.py): the k a step drafts, chosen from measured costs."""

from __future__ import annotations

import itertools

import pytest

from lmserve import LLM, SamplingParams
from lmserve.config import EngineConfig
from lmserve.spec.goodput import PROBE, StepCosts, best_k, expected_tokens
from tests.test_spec import PROMPTS, spec_llm


def test_expected_tokens_is_the_mean_of_a_chain():
    # a chain of k drafts, each accepted with probability a after the ones before: the tokens a
    # verification yields are 1 + the accepted run; enumerate every outcome
    for a, k in [(0.0, 3), (0.3, 1), (0.6, 4), (1.0, 2)]:
        mean = 0.0
        for run in range(k + 1):  # run accepted, then a rejection (or the end of the chain)
            p = a ** run * ((1 - a) if run < k else 1.0)
            mean += p * (1 + run)
        assert expected_tokens(a, k) == pytest.approx(mean)


def test_step_costs_interpolate_between_measured_row_counts():
    c = StepCosts()
    assert c.step_time(3) is None and c.draft_time(2) == 0.0
    c.record_step(2, 10.0)
    c.record_step(6, 18.0)
    assert c.step_time(2) == 10.0
    assert c.step_time(3) == pytest.approx(12.0)  # linear between 2 and 6
    assert c.step_time(9) == 18.0  # above every measured count: the nearest below (optimistic)
    assert c.step_time(1) is None  # below every measured count: unknown
    c.record_step(2, 20.0)  # an exponential average, not the last value
    assert 10.0 < c.step_time(2) < 20.0
    c.record_draft(1, 4, 8.0)
    c.record_draft(4, 2, 10.0)
    assert c.draft_time(1) == 2.0 and c.draft_time(3) == 5.0 and c.draft_time(2) == 2.0  # a round; nearest


def _rate(batch: int, ks: list[int], alphas: list[float], c: StepCosts) -> float:
    """Tokens a second of a step where drafting request i drafts ks[i] (0: plain)."""
    drafting = [k for k in ks if k]
    rows = batch + sum(ks)
    t = c.step_time(rows) + (max(drafting) * c.draft_time(len(drafting)) if drafting else 0.0)
    return (batch - len(ks) + sum(expected_tokens(a, k) for a, k in zip(alphas, ks))) / t


@pytest.mark.parametrize("case", [
    # (batch, alphas, step seconds by rows, draft round seconds) -> the best uniform k over every subset
    (1, [0.6], lambda r: 1.0, 0.0),  # flat: speculation always pays, as many drafts as allowed
    (1, [0.5], lambda r: float(r), 0.0),  # compute-bound: never pays
    (2, [0.9, 0.05], lambda r: 1 + 0.1 * (r - 2), 0.0),  # one request worth drafting for, one not
    (4, [0.7, 0.2, 0.5, 0.4], lambda r: 1 + 0.06 * (r - 4) ** 1.5, 0.02),
    (3, [0.8, 0.8, 0.1], lambda r: 1 + 0.05 * (r - 3), 0.3),  # drafting costly: fewer rounds
])
def test_best_k_is_the_best_uniform_k_over_every_subset(case):
    batch, alphas, cost, draft = case
    c = StepCosts()
    for r in range(batch, batch + 4 * len(alphas) + 1):
        c.record_step(r, cost(r))
    for s in range(1, len(alphas) + 1):
        c.record_draft(s, 1, draft * (1 + 0.5 * (s - 1)))
    k, n = best_k(batch, alphas, 4, c)
    # the reference: every subset of the requests drafting every k, enumerated
    best = max(((kk, sub) for kk in range(1, 5) for size in range(1, len(alphas) + 1)
                for sub in itertools.combinations(range(len(alphas)), size)),
               key=lambda ks: _rate(batch, [ks[0] if i in ks[1] else 0 for i in range(len(alphas))], alphas, c))
    best_rate = _rate(batch, [best[0] if i in best[1] else 0 for i in range(len(alphas))], alphas, c)
    plain = batch / c.step_time(batch)
    if best_rate <= plain:
        assert (k, n) == (0, 0)
    else:
        top = sorted(range(len(alphas)), key=lambda i: -alphas[i])[:n]  # best_k's n are the most accepting
        assert _rate(batch, [k if i in top else 0 for i in range(len(alphas))], alphas, c) == pytest.approx(best_rate)
    if case[0] == 1 and case[2](5) == 1.0:
        assert (k, n) == (4, 1)
    if case[1] == [0.9, 0.05]:
        assert n == 1 and k > 0


def test_best_k_measures_the_plain_step_first():
    c = StepCosts()
    assert best_k(2, [0.9, 0.9], 4, c) == (0, 0)
    c.record_step(2, 1.0)
    assert best_k(2, [0.9, 0.9], 4, c) == (4, 2)  # more rows never measured: taken as cheap, so tried


def test_a_probe_drafts_what_loses_least():
    """Where no drafting pays (each row costs its share), a probe drafts the best config with k >= 1:
    the most accepting request, one token (the other configs lose more)."""
    c = StepCosts()
    for r in range(4, 21):
        c.record_step(r, float(r))
    assert best_k(4, [0.3, 0.9, 0.5, 0.1], 4, c) == (0, 0)
    assert best_k(4, [0.3, 0.9, 0.5, 0.1], 4, c, drafting=True) == (1, 1)


def on_fake_clock(llm, cost):  # type: ignore[no-untyped-def]
    """llm's speculation policy on a fake clock: a step of r rows takes cost(r) seconds. Returns the
    steps run, each (sequences, rows, no prompt in it)."""
    now = [0.0]
    policy, runner = llm.engine.spec, llm.engine.runner
    policy.clock = lambda: now[0]
    real, steps = runner.execute, []

    def execute(out):  # type: ignore[no-untyped-def]
        rows = sum(n for _, n in out.scheduled)
        now[0] += cost(rows)
        decode = all(seq.num_computed_tokens > 0 for seq, _ in out.scheduled)  # no prompt in the step
        steps.append((len(out.scheduled), rows, decode))
        return real(out)
    runner.execute = execute
    return steps


def test_goodput_stops_drafting_where_rows_cost_their_share_and_drafts_where_they_are_free(tiny_models):
    path, _ = tiny_models["llama"]
    params = SamplingParams(max_tokens=80, temperature=0, ignore_eos=True)
    ref = LLM(str(path)).generate(PROMPTS, params, use_tqdm=False)
    runs = {}
    for name, cost in [("compute-bound", float), ("flat", lambda r: 1.0)]:
        llm = spec_llm(path, "ngram", spec_policy="goodput")
        steps = on_fake_clock(llm, cost)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        for a, b in zip(outs, ref):  # exact whatever k is chosen
            assert a.outputs[0].token_ids == b.outputs[0].token_ids, name
        decode = [(b, r) for b, r, d in steps if d and b == len(PROMPTS)]  # the steps of all four decoding
        runs[name] = (sum(r > b for b, r in decode), len(decode), llm.stats().spec)
    drafted, total, st = runs["compute-bound"]
    # each row costs its share: a verification of k + 1 rows costs k + 1 steps and yields fewer tokens,
    # so after the first tries only the probes (one step in PROBE + 1) draft
    assert st["proposed"] > 0 and drafted <= total // (PROBE + 1) + 3, (drafted, total)
    drafted, total, st = runs["flat"]
    # rows free: every step that can draft does, as many as the proposer finds
    assert drafted >= total - 3 and st["proposed"] > 4 * st["verifications"] * 0.5, (drafted, total, st)


def test_spec_policy_is_checked():
    with pytest.raises(ValueError, match="spec_policy"):
        EngineConfig(speculative_method="ngram", spec_policy="fastest")
    with pytest.raises(ValueError, match="spec_policy.*deterministic"):  # timing would decide sampled tokens
        EngineConfig(speculative_method="ngram", spec_policy="goodput", deterministic=True)
    EngineConfig(speculative_method="ngram", spec_policy="goodput")
