"""Beam search equals HF transformers' beam search, on shared copy-on-write blocks, without leaks."""

from __future__ import annotations

import pytest
import torch

from lmserve import LLM, SamplingParams
from lmserve.kv.cache import KVCache
from lmserve.models.loader import hf_config


def hf_beam(model, prompt: list[int], width: int, n: int, max_new: int, eos=None, lp: float = 1.0):  # type: ignore[no-untyped-def]
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=n, do_sample=False,
                             max_new_tokens=max_new, eos_token_id=eos, pad_token_id=0, length_penalty=lp,
                             early_stopping=False)
    res = []
    for row in out[:, len(prompt):].tolist():
        if eos is not None and eos in row:
            row = row[: row.index(eos) + 1]
        res.append(row)
    return res


@pytest.mark.parametrize("family", ["llama", "qwen3", "llama_mqa"])
@pytest.mark.parametrize("width", [2, 4])
def test_beam_matches_hf_tiny(tiny_models, family, width):  # type: ignore[no-untyped-def]
    path, hf = tiny_models[family]
    llm = LLM(str(path), block_size=4)
    prompts = [[5, 17, 33, 9, 100, 3], list(range(40, 63))]
    params = SamplingParams(use_beam_search=True, n=2, best_of=width, max_tokens=12, ignore_eos=True, temperature=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ref = hf_beam(hf, prompt, width, 2, 12)
        assert [o.token_ids for o in out.outputs] == ref
    st = llm.stats()
    assert st.used_blocks == 0 and st.free_blocks == st.num_blocks


def test_beam_with_eos_and_length_penalty(tiny_models):  # type: ignore[no-untyped-def]
    path, hf = tiny_models["qwen2"]
    llm = LLM(str(path), block_size=4)
    prompt = [3, 9, 27, 81, 115, 90]
    # make a frequent token the EOS so that hypotheses end at different lengths
    free = hf_beam(hf, prompt, 3, 3, 10)
    eos = free[1][2]
    for lp in (1.0, 0.5):
        params = SamplingParams(use_beam_search=True, n=3, max_tokens=10, temperature=0, length_penalty=lp,
                                ignore_eos=True, stop_token_ids=[eos])
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        assert [o.token_ids for o in out.outputs] == hf_beam(hf, prompt, 3, 3, 10, eos=eos, lp=lp)
        assert any(o.finish_reason == "stop" for o in out.outputs)
        # a hypothesis ended by a stop_token_ids token names it (vLLM's stop_reason; it was None)
        assert all(o.stop_reason == (eos if o.finish_reason == "stop" else None) for o in out.outputs)
        # cumulative_logprob is the sum of the tokens' log-probabilities (HF's, teacher-forced), as vLLM
        # reports it, whatever the length penalty (it was the length-normalised ranking score)
        for o in out.outputs:
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + o.token_ids])).logits[0].double()
            lp_all = logits.log_softmax(-1)[len(prompt) - 1:-1]  # (T, V): each generated token's distribution
            want = lp_all.gather(1, torch.tensor(o.token_ids).unsqueeze(1)).sum().item()
            assert o.cumulative_logprob == pytest.approx(want, abs=1e-3), (lp, o.token_ids)
    assert llm.stats().used_blocks == 0


def test_beam_shares_blocks(tiny_models):  # type: ignore[no-untyped-def]
    path, _ = tiny_models["llama"]
    prompt = list(range(4, 4 + 64))
    shared = LLM(str(path), block_size=16, enable_prefix_caching=False)
    shared.generate([prompt], SamplingParams(use_beam_search=True, n=1, best_of=4, max_tokens=16, ignore_eos=True),
                    use_tqdm=False)
    # 4 beams of 64 + 16 tokens held separately would need 4 * 5 = 20 blocks at the peak
    assert shared.stats().peak_used_blocks <= 4 + 4 * 2
    assert shared.stats().used_blocks == 0


@pytest.mark.parametrize("budget", [2, 3, 5])
def test_a_beam_search_under_a_small_token_budget_matches_hf(tiny_models, budget):  # type: ignore[no-untyped-def]
    """Width 4 with fewer tokens a step than beams: beams that computed their token wait for their
    siblings with nothing to run. They were scheduled for 0 tokens, and the runner read the row before
    theirs (another sequence's hidden state) as their log-probs: a different search."""
    path, hf = tiny_models["llama"]
    llm = LLM(str(path), block_size=4, max_num_batched_tokens=budget)
    prompt = [5, 17, 33, 9, 100, 3]
    params = SamplingParams(use_beam_search=True, n=4, max_tokens=8, ignore_eos=True, temperature=0)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert [o.token_ids for o in out.outputs] == hf_beam(hf, prompt, 4, 4, 8)


@pytest.mark.parametrize("width", [2, 3, 4])
def test_beam_under_kv_pressure(tiny_models, width):  # type: ignore[no-untyped-def]
    """Defect 1: one beam request (prompt 8, block size 4, pools of 8-16 blocks) whose max_tokens
    filled the pool for one sequence was accepted, then stalled the scheduler ("scheduler stalled").
    Now a family that can never fit is refused up front, naming the field, and a family that fits
    finishes beside a request that fills the pool, preempted and readmitted as a whole."""
    path, hf = tiny_models["llama"]
    per_block = KVCache.bytes_per_block(hf_config(path), 4, torch.float32)
    prompt, other = list(range(10, 18)), list(range(20, 48))
    preempted = 0
    for pool in (8, 12, 16):
        llm = LLM(str(path), block_size=4, kv_cache_memory=per_block * pool, enable_prefix_caching=False)
        never = SamplingParams(use_beam_search=True, n=1, best_of=width, max_tokens=pool * 4 - 8, ignore_eos=True)
        with pytest.raises(ValueError, match="best_of"):
            llm.generate([prompt], never, use_tqdm=False)
        fits = pool // width * 4 - 8  # the family's sequences fill the pool together
        if fits < 1:
            continue
        beam = SamplingParams(use_beam_search=True, n=1, best_of=width, max_tokens=fits, ignore_eos=True)
        plain = SamplingParams(max_tokens=pool * 4 - 28, temperature=0, ignore_eos=True)  # fills the pool
        outs = llm.generate([other, prompt], [plain, beam], use_tqdm=False)
        assert [o.token_ids for o in outs[1].outputs] == hf_beam(hf, prompt, width, 1, fits)
        st = llm.stats()
        assert st.used_blocks == 0 and not llm.engine.requests
        preempted += st.num_preemptions
    assert preempted > 0


@pytest.mark.parametrize("width", [2, 3])
def test_a_beam_search_fits_a_pool_of_its_width(tiny_models, width):  # type: ignore[no-untyped-def]
    """A 3-token prompt's beams, one block each, in a pool of exactly `width` blocks (what validation
    accepts): the search finishes. Before, a copy-on-write source's pin counted as a holder, so the
    last beam copied its block too, found no free block, and the scheduler stalled at the first step."""
    path, hf = tiny_models["llama"]
    per_block = KVCache.bytes_per_block(hf_config(path), 16, torch.float32)
    llm = LLM(str(path), block_size=16, kv_cache_memory=per_block * width, enable_prefix_caching=False)
    out = llm.generate([[5, 6, 7]], SamplingParams(use_beam_search=True, n=width, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [o.token_ids for o in out.outputs] == hf_beam(hf, [5, 6, 7], width, width, 4)
    assert llm.stats().used_blocks == 0 and not llm.engine.block_manager.pins


def test_a_beam_search_counts_its_width_against_max_num_seqs(tiny_models):  # type: ignore[no-untyped-def]
    """max_num_seqs 2, one plain request and a 2-wide beam search: the beams wait for room for both
    (before, the first beam was admitted beside the plain request and its clone made 3 running)."""
    path, _ = tiny_models["llama"]
    eng = LLM(str(path), block_size=4, max_num_seqs=2).engine
    eng.add_request("A", [5, 6], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    eng.add_request("B", [7, 8, 9], SamplingParams(n=2, use_beam_search=True, max_tokens=6, ignore_eos=True))
    peak, done = 0, {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
        peak = max(peak, len(eng.scheduler.running))
    assert peak == 2 and len(done["B"].outputs) == 2 and len(done["A"].outputs[0].token_ids) == 8


def test_pruned_beams_leave_their_request(tiny_models):  # type: ignore[no-untyped-def]
    """A 4-wide beam search over 24 steps: the request holds its running beams only (before, every
    clone it ever made stayed in its list until the search ended, ~3 more sequences a step, each with
    its own token list), and the result is still HF's."""
    from lmserve import fanout
    path, hf = tiny_models["llama"]
    eng = LLM(str(path), block_size=4).engine
    clones = [0]
    real = fanout.FanOut._clone

    def counting(self, *a):  # type: ignore[no-untyped-def]
        clones[0] += 1
        return real(self, *a)

    fanout.FanOut._clone = counting  # type: ignore[method-assign]
    try:
        prompt = [5, 17, 33, 9, 100, 3]
        eng.add_request("B", prompt, SamplingParams(use_beam_search=True, n=2, best_of=4, max_tokens=24, ignore_eos=True))
        peak, out = 0, None
        while eng.has_unfinished_requests():
            for o in eng.step():
                out = o if o.finished else out
            peak = max(peak, len(eng.requests.get("B", [])))
    finally:
        fanout.FanOut._clone = real  # type: ignore[method-assign]
    assert clones[0] > 10 and peak <= 4
    assert [o.token_ids for o in out.outputs] == hf_beam(hf, prompt, 4, 2, 24)


@pytest.mark.parametrize("max_tokens", [1, 2])
def test_a_beam_search_ending_at_its_first_step_has_a_first_token_time(tiny_models, max_tokens):  # type: ignore[no-untyped-def]
    """A search that ends at its first beam step (max_tokens=1) returned tokens with first_token_time None
    (no TTFT, so no TTFT in the server's metrics); now the step that makes the tokens stamps it."""
    path, _ = tiny_models["llama"]
    out = LLM(str(path)).generate([[5, 6, 7]], SamplingParams(n=2, use_beam_search=True, max_tokens=max_tokens),
                                  use_tqdm=False)[0]
    m = out.metrics
    assert all(len(c.token_ids) == max_tokens for c in out.outputs)
    assert m.first_token_time is not None
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
