"""Preemption by swapping (kv/swap.py) on a real engine: under a pool too small for the batch, the
victims' KV goes to host memory and back, and the outputs equal those of a pool where nothing is
preempted, with fewer tokens run than recompute needs; a windowed model, a quantized cache and
seeded sampling too. The cost rule picks swap on a CPU and recompute on a GPU for the default model."""

from __future__ import annotations

import pytest
import torch

from lmserve import LLM, SamplingParams
from lmserve.kv.cache import KVCache
from lmserve.kv.swap import swap_is_cheaper
from lmserve.models.loader import hf_config

PROMPTS = [[(7 * i + j) % 120 + 4 for i in range(n)] for j, n in enumerate((9, 30, 17, 41, 5, 23))]


def tight(path, blocks: int, **kw) -> LLM:  # type: ignore[no-untyped-def]
    """An engine whose pool holds `blocks` blocks of 4 tokens."""
    per_block = KVCache.bytes_per_block(hf_config(path), 4, torch.float32, kw.get("kv_cache_dtype", "auto"))
    return LLM(str(path), block_size=4, kv_cache_memory=per_block * blocks, enable_prefix_caching=False, **kw)


@pytest.mark.parametrize("family,kw", [("llama", {}), ("mistral", {}), ("llama", {"kv_cache_dtype": "int8"})])
def test_swapped_outputs_equal_unpreempted_ones(tiny_models, family, kw):  # type: ignore[no-untyped-def]
    path, _ = tiny_models[family]
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    seeded = [SamplingParams(max_tokens=40, temperature=0.9, seed=s, ignore_eos=True) for s in range(len(PROMPTS))]
    roomy = LLM(str(path), block_size=4, enable_prefix_caching=False, **kw)
    runs = {}
    for mode in ("swap", "recompute"):
        llm = tight(path, 40, preemption_mode=mode, swap_space="64MiB", **kw)
        for params in (greedy, seeded):
            ref = roomy.generate(PROMPTS, params, use_tqdm=False)
            got = llm.generate(PROMPTS, params, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref], (mode, params)
        st = llm.stats()
        assert st.num_preemptions > 0 and st.used_blocks == 0 and st.free_blocks == st.num_blocks
        runs[mode] = st
    sw, rc = runs["swap"], runs["recompute"]
    assert sw.num_swapped == sw.num_preemptions and rc.num_swapped == 0
    per_block = KVCache.bytes_per_block(hf_config(path), 4, torch.float32, kw.get("kv_cache_dtype", "auto"))
    assert sw.swap_free_blocks == 64 * 2**20 // per_block  # all host space back
    assert sw.computed_tokens < rc.computed_tokens  # the swapped victims ran nothing twice
    print(f"{family} {kw}: {sw.num_preemptions} preemptions swapped, {sw.computed_tokens} tokens run; "
          f"recompute: {rc.num_preemptions} preemptions, {rc.computed_tokens} tokens run")


def test_auto_swaps_on_the_cpu_within_its_space(tiny_models):  # type: ignore[no-untyped-def]
    """preemption_mode auto (the default): on the CPU swapping is the cheaper move, taken while the
    swap space lasts; with none, every preemption recomputes."""
    path, _ = tiny_models["llama"]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    a = tight(path, 40, swap_space="64MiB")
    b = tight(path, 40)
    assert [o.outputs[0].token_ids for o in a.generate(PROMPTS, params, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in b.generate(PROMPTS, params, use_tqdm=False)]
    assert a.stats().num_swapped > 0 and b.stats().num_swapped == 0 and b.stats().num_preemptions > 0


def test_the_cost_rule():
    """SmolLM2-135M's numbers: a block of 16 tokens is 16 x 30 layers x 2 x 3 heads x 64 x 4 bytes;
    swapping 100 tokens' blocks beats recomputing them on a CPU, and loses on a GPU."""
    block_bytes, params = 16 * 30 * 2 * 3 * 64 * 4, 135_000_000
    assert swap_is_cheaper(100, 7, block_bytes, params, "cpu")
    assert not swap_is_cheaper(100, 7, block_bytes, params, "cuda:0")
    assert swap_is_cheaper(100_000, 7, block_bytes, params, "cuda")  # a windowed sequence: few blocks, many tokens


def test_beams_and_children_swap_and_finish_as_unpreempted(tiny_models):  # type: ignore[no-untyped-def]
    """Beam search (families preempted as a whole) and n = 3 children under a pool they do not fit,
    preempted by swapping, in a small token budget (families prefill unevenly): the same outputs as
    an unpreempted pool, and nothing stalls."""
    path, _ = tiny_models["llama"]
    beam = SamplingParams(max_tokens=16, use_beam_search=True, best_of=3, n=2, ignore_eos=True)
    kids = SamplingParams(max_tokens=16, n=3, temperature=0.8, seed=4, ignore_eos=True)
    prompts, params = PROMPTS[:4], [beam, kids, beam, kids]
    ref = LLM(str(path), block_size=4, enable_prefix_caching=False).generate(prompts, params, use_tqdm=False)
    llm = tight(path, 28, preemption_mode="swap", swap_space="64MiB", max_num_batched_tokens=8)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in ref]
    st = llm.stats()
    assert st.num_swapped > 0 and st.used_blocks == 0


def test_an_aborted_swapped_out_request_lets_go_of_its_host_copy_at_once(tiny_models):  # type: ignore[no-untyped-def]
    """Aborting a request while its sequence waits swapped out frees the host copy then, not with a
    next step (an idle engine runs none: the copy stayed until the next request; found by the
    scheduler's random-workload test)."""
    path, _ = tiny_models["llama"]
    llm = tight(path, 40, preemption_mode="swap", swap_space="64MiB")
    eng = llm.engine
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    swapped = None
    for _ in range(200):
        eng.step()
        swapped = next((s for s in eng.scheduler.waiting if s.swapped is not None), None)
        if swapped is not None:
            break
    assert swapped is not None and swapped in eng.runner.swap.saved
    free = eng.scheduler.swap_free
    assert eng.abort_request(swapped.request_id)
    assert swapped not in eng.runner.swap.saved and eng.scheduler.swap_free > free
    for rid in list(eng.requests):
        eng.abort_request(rid)
    assert not eng.runner.swap.saved and not eng.has_unfinished_requests()


def test_blocks_restored_by_swap_in_serve_the_prefix_cache_again(tiny_models):  # type: ignore[no-untyped-def]
    """A request swapped out while its old blocks are taken by others (here: the whole free pool taken
    and given back, which evicts every cached hash) comes back into fresh blocks; once it ends, a new
    request on the same prompt finds its prompt's blocks in the prefix cache (before, restored blocks
    were never registered again: 0 tokens cached)."""
    path, _ = tiny_models["llama"]
    per_block = KVCache.bytes_per_block(hf_config(path), 4, torch.float32)
    llm = LLM(str(path), block_size=4, kv_cache_memory=per_block * 16, preemption_mode="swap", swap_space="64MiB")
    eng, bm = llm.engine, llm.engine.block_manager
    prompt = list(range(40, 56))  # 4 full blocks
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    eng.add_request("B", list(range(60, 68)), SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    eng.add_request("A", prompt, params)
    a = eng.requests["A"][0]
    evicted = False
    while eng.has_unfinished_requests():
        if a.swapped is not None and not evicted:  # others take A's old blocks while it is out
            tables: list[list[int]] = []
            assert bm.allocate(tables, bm.num_free_blocks * bm.block_size)
            bm.free(tables)
            evicted = True
        eng.step()
    assert evicted and eng.stats().num_swapped > 0
    eng.add_request("C", prompt + [70, 71, 72], params)
    eng.step()
    assert eng.requests["C"][0].num_cached_tokens == 16
