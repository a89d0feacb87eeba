"""n / best_of on shared, copy-on-write blocks."""

from __future__ import annotations

import pytest

from lmserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_models):  # type: ignore[no-untyped-def]
    path, _ = tiny_models["llama"]
    return LLM(str(path), block_size=16, kv_cache_memory="256MiB")


PROMPT = [(5 * i + 7) % 120 + 3 for i in range(37)]  # 37 tokens: the last block is partial


def test_children_equal_seeded_requests_alone(llm):  # type: ignore[no-untyped-def]
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=24, ignore_eos=True)
    fam = llm.generate([PROMPT], params, use_tqdm=False)[0]
    assert [o.index for o in fam.outputs] == [0, 1, 2, 3]
    texts = [o.token_ids for o in fam.outputs]
    assert len({tuple(t) for t in texts}) > 1  # they really differ (so shared writes would be caught)
    for i, out in enumerate(fam.outputs):
        alone = llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=11 + i, max_tokens=24, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0]
        assert out.token_ids == alone.token_ids, i
    st = llm.stats()
    assert st.used_blocks == 0 and st.free_blocks == st.num_blocks


def test_children_equal_seeded_requests_alone_with_speculation(tiny_models):  # type: ignore[no-untyped-def]
    """The same rule with n-gram speculation on a repetitive prompt: child i equals a request alone with
    seed + i, the alone ones on an engine without prefix caching (before, a child whose prompt was cached
    but its last token drafted on that prompt token, drawing its random numbers otherwise: a seeded
    output then depended on the cache)."""
    path, _ = tiny_models["llama"]
    prompt = [7, 8, 9, 10, 11] * 8
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=24, ignore_eos=True)
    spec = {"speculative_method": "ngram", "num_speculative_tokens": 3, "kv_cache_memory": "256MiB"}
    fam = LLM(str(path), block_size=16, **spec).generate([prompt], params, use_tqdm=False)[0]
    cold = LLM(str(path), block_size=16, enable_prefix_caching=False, **spec)
    for i, out in enumerate(fam.outputs):
        alone = cold.generate([prompt], SamplingParams(temperature=1.0, seed=11 + i, max_tokens=24, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0]
        assert out.token_ids == alone.token_ids, i
    assert cold.stats().spec["proposed"] > 0  # drafts ran


def test_children_under_preemption(tiny_models):  # type: ignore[no-untyped-def]
    path, _ = tiny_models["llama"]
    from lmserve.kv.cache import KVCache
    from lmserve.models.loader import hf_config
    import torch
    per_block = KVCache.bytes_per_block(hf_config(path), 4, torch.float32)
    small = LLM(str(path), block_size=4, kv_cache_memory=per_block * 40, enable_prefix_caching=False)
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=40, ignore_eos=True)
    fam = small.generate([PROMPT, PROMPT[:20]], params, use_tqdm=False)
    assert small.stats().num_preemptions > 0
    big = LLM(str(path), block_size=4, kv_cache_memory="64MiB")
    ref = big.generate([PROMPT, PROMPT[:20]], params, use_tqdm=False)
    for a, b in zip(fam, ref):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    st = small.stats()
    assert st.used_blocks == 0


def test_memory_saving_n8(tiny_models):  # type: ignore[no-untyped-def]
    path, _ = tiny_models["qwen3"]
    prompt = [(3 * i + 1) % 120 + 4 for i in range(1024)]
    opts = dict(block_size=16, kv_cache_memory="512MiB", max_num_batched_tokens=2048)
    shared = LLM(str(path), enable_prefix_caching=False, **opts)
    shared.generate([prompt], SamplingParams(n=8, temperature=1.0, seed=1, max_tokens=256, ignore_eos=True),
                    use_tqdm=False)
    separate = LLM(str(path), enable_prefix_caching=False, **opts)
    separate.generate([prompt] * 8, [SamplingParams(temperature=1.0, seed=1 + i, max_tokens=256, ignore_eos=True)
                                     for i in range(8)], use_tqdm=False)
    peak_shared = shared.stats().peak_used_blocks
    peak_separate = separate.stats().peak_used_blocks
    saving = 1 - peak_shared / peak_separate
    print(f"peak blocks: shared {peak_shared}, separate {peak_separate}, saving {saving:.1%}")
    assert peak_separate == 8 * (-(-(1024 + 256) // 16))
    assert saving >= 0.55


def test_best_of_returns_most_likely(llm):  # type: ignore[no-untyped-def]
    params = SamplingParams(n=2, best_of=5, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    assert len(out.outputs) == 2 and [o.index for o in out.outputs] == [0, 1]
    lps = [o.cumulative_logprob for o in out.outputs]
    assert lps[0] >= lps[1]
    alone = [llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=3 + i, max_tokens=12, ignore_eos=True,
                                                   logprobs=0), use_tqdm=False)[0].outputs[0] for i in range(5)]
    best = sorted(alone, key=lambda o: -o.cumulative_logprob)[:2]
    assert [o.token_ids for o in out.outputs] == [o.token_ids for o in best]
    for o, b in zip(out.outputs, best):
        assert abs(o.cumulative_logprob - b.cumulative_logprob) < 1e-4


def test_families_never_leak(tiny_models):  # type: ignore[no-untyped-def]
    """Random mixes of n / best_of / beam requests in a pool small enough to preempt, with aborts."""
    from hypothesis import example, given, settings
    from hypothesis import strategies as st
    path, _ = tiny_models["llama"]
    import torch
    from lmserve.kv.cache import KVCache
    from lmserve.models.loader import hf_config
    per_block = KVCache.bytes_per_block(hf_config(path), 4, torch.float32)
    llm = LLM(str(path), block_size=4, kv_cache_memory=per_block * 48, max_num_batched_tokens=64)
    eng = llm.engine
    kinds = st.sampled_from(["n", "best_of", "beam", "single"])
    reqs = st.lists(st.tuples(kinds, st.integers(2, 30), st.integers(2, 24), st.booleans()), min_size=1, max_size=6)

    @settings(max_examples=15, deadline=None, derandomize=True)
    @given(reqs=reqs, abort_after=st.integers(0, 6))
    @example(reqs=[("n", 30, 24, False)] * 5 + [("beam", 20, 24, True)], abort_after=3)  # sure to preempt
    def run(reqs, abort_after):  # type: ignore[no-untyped-def]
        ids = []
        for i, (kind, plen, max_tokens, abort) in enumerate(reqs):
            p = dict(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=i)
            if kind == "n":
                p["n"] = 3
            elif kind == "best_of":
                p.update(n=2, best_of=3)
            elif kind == "beam":
                p.update(use_beam_search=True, n=2, best_of=3, temperature=0)
            rid = f"fam-{i}-{id(reqs)}"
            eng.add_request(rid, [(7 * j + i) % 120 + 3 for j in range(plen)], SamplingParams(**p))
            ids.append((rid, abort))
        steps = 0
        while eng.has_unfinished_requests():
            eng.step()
            steps += 1
            if steps == abort_after:
                for rid, abort in ids:
                    if abort:
                        eng.abort_request(rid)
            bm = eng.block_manager
            counts = [0] * bm.num_blocks
            for seqs in eng.requests.values():
                for s in seqs:
                    if not s.is_finished:
                        for b in (b for t in s.block_tables for b in t if b >= 0):
                            counts[b] += 1
            assert counts == bm.ref_count
        st_ = llm.stats()
        assert st_.used_blocks == 0 and st_.free_blocks == st_.num_blocks

    run()
    assert llm.stats().num_preemptions > 0


def test_forked_children_never_exceed_max_num_seqs(tiny_models):  # type: ignore[no-untyped-def]
    """n children forked while other requests run: the running set stays within max_num_seqs (the
    children past it wait, then run), and every child finishes its tokens."""
    path, _ = tiny_models["llama"]
    llm = LLM(str(path), max_num_seqs=3, kv_cache_memory="16MiB", block_size=4)
    eng = llm.engine
    eng.add_request("solo", [7, 8, 9], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    eng.add_request("fan", [5, 9, 2, 7, 1, 3], SamplingParams(n=4, max_tokens=6, temperature=1.0, seed=3,
                                                               ignore_eos=True))
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
        assert len(eng.scheduler.running) <= 3
    assert len(done["fan"].outputs) == 4 and all(len(c.token_ids) == 6 for c in done["fan"].outputs)
    assert llm.stats().used_blocks == 0  # the children that waited let their references go


def test_tpot_of_n_samples_is_one_outputs(tiny_models):  # type: ignore[no-untyped-def]
    """n = 4 samples of 20 tokens decode side by side: TPOT is the time per token of one output, (finish -
    first token) / 19 (before, / 79: the four outputs' tokens summed, 4x too small)."""
    path, _ = tiny_models["llama"]
    out = LLM(str(path)).generate([[5, 6, 7]], SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=20,
                                                               ignore_eos=True), use_tqdm=False)[0]
    m = out.metrics
    assert m.num_output_tokens == 80
    assert m.tpot == pytest.approx((m.finished_time - m.first_token_time) / 19, rel=1e-9)


def test_an_aborted_parent_is_let_go_at_once(tiny_models):  # type: ignore[no-untyped-def]
    """A request of n = 3 aborted mid-prefill, children still to fork: FanOut held the finished parent
    (its tokens, detokenizer, grammar) until some later request made the engine step."""
    path, _ = tiny_models["llama"]
    eng = LLM(str(path), block_size=4, max_num_batched_tokens=4).engine
    eng.add_request("a", list(range(3, 30)), SamplingParams(n=3, max_tokens=4))
    eng.step()  # the parent mid-prefill, two forks pending
    assert [s.request_id for s in eng.fanout._forking] == ["a"]
    assert eng.abort_request("a")
    assert eng.fanout._forking == [] and not eng.requests
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_queue_time_of_a_one_token_prompt_with_children(tiny_models):  # type: ignore[no-untyped-def]
    """n = 3 on a one-token prompt makes its children at once; they were queued before their parent, ran
    first (max_num_seqs=1) and the request's first_scheduled_time (the parent's alone) came after its
    first token: queue_time > TTFT. Now the parent queues first and the request is scheduled when any of
    its sequences is."""
    path, _ = tiny_models["llama"]
    llm = LLM(str(path), max_num_seqs=1)
    out = llm.generate([[5]], SamplingParams(n=3, max_tokens=20, temperature=1.0, seed=0, ignore_eos=True),
                       use_tqdm=False)[0]
    m = out.metrics
    assert len(out.outputs) == 3
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time
    assert m.queue_time <= m.ttft
    assert out.outputs[0].index == 0


def test_the_engines_token_counters(tiny_models):  # type: ignore[no-untyped-def]
    """EngineStats.prompt_tokens / generation_tokens (/metrics' token counters) count as the engine runs:
    a request's prompt once (n = 3, a beam search), every sequence's generated tokens, an aborted
    request's tokens so far, and nothing for a request refused before it ran (the server counted at
    the end of a request: an aborted one added nothing, an expired one its whole prompt)."""
    from lmserve.sequence import Request
    path, _ = tiny_models["llama"]
    llm = LLM(str(path), max_num_seqs=8)
    llm.generate([[5, 6, 7, 8]], SamplingParams(n=3, max_tokens=5, temperature=1.0, seed=0, ignore_eos=True),
                 use_tqdm=False)
    st = llm.stats()
    assert (st.prompt_tokens, st.generation_tokens) == (4, 15)
    llm.generate([[5, 6, 7]], SamplingParams(n=2, use_beam_search=True, max_tokens=4), use_tqdm=False)
    st = llm.stats()
    assert st.prompt_tokens == 7 and st.generation_tokens == 15 + 1 + 2 * 3  # a token a running beam a step
    eng = llm.engine
    eng.add_request("gone", Request([9, 10, 11, 12, 13], SamplingParams(max_tokens=50, ignore_eos=True)))
    for _ in range(4):
        eng.step()
    eng.abort_request("gone")
    st = llm.stats()
    assert st.prompt_tokens == 12 and st.generation_tokens == 22 + 4
    expired = LLM(str(path), max_waiting_time=1e-9)
    out = expired.generate([[5, 6, 7]], SamplingParams(max_tokens=3), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "error"
    assert (expired.stats().prompt_tokens, expired.stats().generation_tokens) == (0, 0)
