"""The prefix cache's second tier (kv/offload.py) on a real engine: blocks the pool evicts come back from
host memory or files, bit for bit the KV the pool would have held, so a prompt whose prefix left the pool
gives the tokens and logprobs of a pool hit (and HF's greedy tokens); files survive a restart and are
checked when read; the tier is bounded, cleared by reset_prefix_cache, and refused where it cannot serve."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmserve import LLM, SamplingParams
from lmserve.kv.cache import KVCache
from lmserve.models.loader import hf_config

A = [(7 * i) % 120 + 4 for i in range(41)]  # 10 full blocks of 4 before its last token
OTHERS = [[(5 * i + j) % 120 + 4 for i in range(41)] for j in range(1, 4)]  # enough to push A out of 24 blocks
PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3)


def per_block(path: Path, kv_cache_dtype: str = "auto") -> int:
    return KVCache.bytes_per_block(hf_config(path), 4, torch.float32, kv_cache_dtype)


def evict_and_return(llm: LLM, prompt: list[int] = A):  # type: ignore[no-untyped-def]
    """Run prompt, three others that push its blocks out of the pool, then prompt again: both outputs."""
    first = llm.generate([prompt], PARAMS, use_tqdm=False)[0]
    llm.generate(OTHERS, PARAMS, use_tqdm=False)
    return first, llm.generate([prompt], PARAMS, use_tqdm=False)[0]


def tokens_and_logprobs(out):  # type: ignore[no-untyped-def]
    return out.outputs[0].token_ids, out.outputs[0].logprobs


@pytest.mark.parametrize("family,kw", [("llama", {}), ("qwen2", {"kv_cache_dtype": "int8"}), ("llama_mqa", {})])
def test_an_evicted_prefix_comes_back_as_a_pool_hit(tiny_models, family, kw):  # type: ignore[no-untyped-def]
    path, hf = tiny_models[family]
    tight = dict(block_size=4, kv_cache_memory=per_block(path, kw.get("kv_cache_dtype", "auto")) * 24, **kw)
    tiered = LLM(str(path), kv_offloading_size="64MiB", **tight)
    first, back = evict_and_return(tiered)
    st = tiered.stats()
    assert back.metrics.num_cached_tokens == 40 and st.offload_hit_tokens == 40  # all from the tier
    assert st.offload["saved_blocks"] > 0 and st.offload["loaded_blocks"] == 10

    plain = LLM(str(path), **tight)  # the same pool without a tier: A's blocks are gone, it recomputes
    _, again = evict_and_return(plain)
    assert again.metrics.num_cached_tokens == 0 and plain.stats().offload is None
    assert st.computed_tokens == plain.stats().computed_tokens - 40

    roomy = LLM(str(path), block_size=4, **kw)  # a pool that keeps A: its second run is a pool hit
    _, hit = evict_and_return(roomy)
    assert hit.metrics.num_cached_tokens == 40
    assert tokens_and_logprobs(back) == tokens_and_logprobs(hit)  # the tier's KV is the pool's, bit for bit
    assert back.outputs[0].token_ids == first.outputs[0].token_ids == again.outputs[0].token_ids
    if not kw:  # HF's greedy tokens on the same weights (an int8 cache may differ from float math)
        ref = hf.generate(torch.tensor([A]), max_new_tokens=8, do_sample=False)[0, len(A):].tolist()
        assert back.outputs[0].token_ids == ref


def test_recompute_preemption_reads_its_blocks_back(tiny_models):  # type: ignore[no-untyped-def]
    """A sequence preempted by recompute finds the blocks it had in the tier when it is readmitted: the same
    outputs as a pool where nothing is preempted, fewer tokens run than recompute without the tier."""
    path, _ = tiny_models["llama"]
    prompts = [[(7 * i + j) % 120 + 4 for i in range(n)] for j, n in enumerate((9, 30, 17, 41, 5, 23))]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    ref = LLM(str(path), block_size=4).generate(prompts, params, use_tqdm=False)
    runs = {}
    for size in (0, "64MiB"):
        llm = LLM(str(path), block_size=4, kv_cache_memory=per_block(path) * 40, preemption_mode="recompute",
                  kv_offloading_size=size)
        got = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref], size
        runs[size] = llm.stats()
        assert runs[size].num_preemptions > 0 and runs[size].used_blocks == 0
    assert runs["64MiB"].offload_hit_tokens > 0
    assert runs["64MiB"].computed_tokens < runs[0].computed_tokens


def test_chunked_prefill_after_a_tier_hit(tiny_models):  # type: ignore[no-untyped-def]
    """A tier hit followed by a prompt tail longer than one step's budget: chunks after the loaded blocks."""
    path, _ = tiny_models["llama"]
    long = A + [(3 * i) % 120 + 4 for i in range(30)]
    kw = dict(block_size=4, kv_cache_memory=per_block(path) * 30, max_num_batched_tokens=8)
    llm = LLM(str(path), kv_offloading_size="64MiB", **kw)
    llm.generate([A], PARAMS, use_tqdm=False)
    llm.generate(OTHERS, PARAMS, use_tqdm=False)
    got = llm.generate([long], PARAMS, use_tqdm=False)[0]
    assert got.metrics.num_cached_tokens == 40 and llm.stats().offload_hit_tokens == 40
    ref = LLM(str(path), block_size=4, enable_prefix_caching=False).generate([long], PARAMS, use_tqdm=False)[0]
    assert got.outputs[0].token_ids == ref.outputs[0].token_ids


def test_a_salt_keeps_its_own_blocks_in_the_tier(tiny_models):  # type: ignore[no-untyped-def]
    path, _ = tiny_models["llama"]
    llm = LLM(str(path), block_size=4, kv_cache_memory=per_block(path) * 24, kv_offloading_size="64MiB")
    llm.generate([{"prompt_token_ids": A, "cache_salt": "tenant-a"}], PARAMS, use_tqdm=False)
    llm.generate(OTHERS, PARAMS, use_tqdm=False)
    other = llm.generate([{"prompt_token_ids": A, "cache_salt": "tenant-b"}], PARAMS, use_tqdm=False)[0]
    assert other.metrics.num_cached_tokens == 0 and llm.stats().offload_hit_tokens == 0
    own = llm.generate([{"prompt_token_ids": A, "cache_salt": "tenant-a"}], PARAMS, use_tqdm=False)[0]
    assert own.metrics.num_cached_tokens == 40


def test_files_survive_a_restart_and_are_checked(tiny_models, tmp_path):  # type: ignore[no-untyped-def]
    path, _ = tiny_models["llama"]
    kw = dict(block_size=4, kv_cache_memory=per_block(path) * 24, kv_offloading_size="64MiB",
              kv_offloading_dir=str(tmp_path))
    roomy = LLM(str(path), block_size=4)
    _, hit = evict_and_return(roomy)
    llm = LLM(str(path), **kw)
    llm.generate([A], PARAMS, use_tqdm=False)
    llm.close()  # writes the pool's cached blocks
    (layout,) = list(tmp_path.iterdir())
    files = sorted(layout.glob("*.kv"))
    assert len(files) == (len(A) + PARAMS.max_tokens - 1) // 4  # every full block it computed
    again = LLM(str(path), **kw)  # a new process's engine: nothing in its pool
    got = again.generate([A], PARAMS, use_tqdm=False)[0]
    assert got.metrics.num_cached_tokens == 40 and tokens_and_logprobs(got) == tokens_and_logprobs(hit)
    again.close()

    block_file = next(f for f in files if f.read_bytes()[4:37] == b"\0" + _block_hash(again, A, 5))  # A's 6th block
    data = bytearray(block_file.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit of KV: the crc catches it
    block_file.write_bytes(bytes(data))
    third = LLM(str(path), **kw)
    got = third.generate([A], PARAMS, use_tqdm=False)[0]
    assert got.metrics.num_cached_tokens == 20  # blocks 0-4 from files; the damaged one and after recomputed
    assert not block_file.exists()  # deleted when read (close writes it again, from the pool)
    assert got.outputs[0].token_ids == hit.outputs[0].token_ids
    third.close()

    other, _ = tiny_models["qwen2"]  # other weights: another layout folder, never read from A's files
    o = LLM(str(other), block_size=4, kv_offloading_size="64MiB", kv_offloading_dir=str(tmp_path))
    assert o.generate([A], PARAMS, use_tqdm=False)[0].metrics.num_cached_tokens == 0
    o.close()
    assert len(list(tmp_path.iterdir())) == 2


def _block_hash(llm: LLM, prompt: list[int], i: int) -> bytes:
    bm = llm.engine.block_manager
    return bm.block_hashes(prompt, i + 1)[i]


def test_the_tier_is_bounded_and_reset(tiny_models, tmp_path):  # type: ignore[no-untyped-def]
    path, _ = tiny_models["llama"]
    for d in (None, tmp_path):
        llm = LLM(str(path), block_size=4, kv_cache_memory=per_block(path) * 24, kv_offloading_size=per_block(path) * 5,
                  kv_offloading_dir=d and str(d))
        evict_and_return(llm)
        st = llm.stats().offload
        assert st["capacity_blocks"] == 5 and st["blocks"] == 5 and st["dropped_blocks"] > 0
        llm.close()
        if d is not None:
            assert len(list(next(d.iterdir()).glob("*.kv"))) <= 5
        assert llm.reset_prefix_cache() and llm.stats().offload["blocks"] == 0
        if d is not None:
            assert not list(next(d.iterdir()).glob("*.kv"))


@pytest.mark.parametrize("kw,field", [
    (dict(kv_offloading_dir="/tmp/x"), "kv_offloading_dir"),
    (dict(kv_offloading_size="2"), "kv_offloading_size"),
    (dict(kv_offloading_size="1GiB", enable_prefix_caching=False), "kv_offloading_size"),
    (dict(kv_offloading_size="100B"), "kv_offloading_size"),
])
def test_bad_settings_name_the_field(tiny_models, kw, field):  # type: ignore[no-untyped-def]
    path, _ = tiny_models["llama"]
    with pytest.raises(ValueError, match=field):
        LLM(str(path), block_size=4, **kw)


def test_tensor_parallel_is_refused_by_name(tiny_models):  # type: ignore[no-untyped-def]
    from lmserve import EngineConfig
    with pytest.raises(ValueError, match="kv_offloading_size"):
        EngineConfig(model=str(tiny_models["llama"][0]), kv_offloading_size="64MiB", tensor_parallel_size=2)


@pytest.mark.parametrize("hybrid", [True, False])
def test_gemma3_hybrid_kv_groups(tmp_path, hybrid):  # type: ignore[no-untyped-def]
    """Gemma 3 mixes windowed (6 tokens) and full layers: with its hybrid cache (one full group, two
    windowed ones) a hit needs every full-group block but only the windowed groups' last ones, which come
    from the pool or the tier alike; with one KV group, every block. Both as a pool hit, bit for bit."""
    from conftest import make_tiny_gemma
    path = tmp_path / "gemma"
    hf = make_tiny_gemma(path)
    one = dict(block_size=4, disable_hybrid_kv_cache_manager=not hybrid)
    size = KVCache.bytes_per_block(hf_config(path), 4, torch.float32, hybrid=hybrid)
    blocks = 40 if hybrid else 24  # (the hybrid pool's blocks each hold a third of the layers)
    llm = LLM(str(path), kv_cache_memory=size * blocks, kv_offloading_size="64MiB", **one)
    _, back = evict_and_return(llm)
    _, hit = evict_and_return(LLM(str(path), **one))
    assert back.metrics.num_cached_tokens == hit.metrics.num_cached_tokens == 40
    st = llm.stats()  # all of it from the tier: the full group's ten blocks, each windowed group's last two
    assert st.offload_hit_tokens == 40 and st.offload["loaded_blocks"] == (10 + 2 * 2 if hybrid else 10)
    assert tokens_and_logprobs(back) == tokens_and_logprobs(hit)
    ref = hf.generate(torch.tensor([A]), max_new_tokens=8, do_sample=False)[0, len(A):].tolist()
    assert back.outputs[0].token_ids == ref


def test_an_all_windowed_model(tiny_models):  # type: ignore[no-untyped-def]
    """Mistral (every layer windowed, 24 tokens): a hit needs only the blocks its window reaches back to."""
    path, _ = tiny_models["mistral"]
    llm = LLM(str(path), block_size=4, kv_cache_memory=per_block(path) * 24, kv_offloading_size="64MiB")
    _, back = evict_and_return(llm)
    _, hit = evict_and_return(LLM(str(path), block_size=4))
    assert back.metrics.num_cached_tokens == hit.metrics.num_cached_tokens == 40
    st = llm.stats()  # the window's blocks only: 4-9 ((40 - 24 + 1) // 4 = 4 on)
    assert st.offload_hit_tokens == 24 and st.offload["loaded_blocks"] == 6
    assert tokens_and_logprobs(back) == tokens_and_logprobs(hit)


def test_a_pool_hit_continued_from_the_tier(tiny_models):  # type: ignore[no-untyped-def]
    """The pool lets a finished prompt's tail go first: a longer prompt evicts A's last blocks only, so A's
    next visit takes its first blocks from the pool and the rest from the tier; the same tokens and logprobs."""
    path, _ = tiny_models["llama"]
    b = [(5 * i + 1) % 120 + 4 for i in range(61)]
    llm = LLM(str(path), block_size=4, kv_cache_memory=per_block(path) * 24, kv_offloading_size="64MiB")
    llm.generate([A], PARAMS, use_tqdm=False)
    llm.generate([b], PARAMS, use_tqdm=False)
    back = llm.generate([A], PARAMS, use_tqdm=False)[0]
    assert back.metrics.num_cached_tokens == 40 and 0 < llm.stats().offload_hit_tokens < 40  # (here 28 + 12)
    roomy = LLM(str(path), block_size=4)
    roomy.generate([A], PARAMS, use_tqdm=False)
    hit = roomy.generate([A], PARAMS, use_tqdm=False)[0]
    assert tokens_and_logprobs(back) == tokens_and_logprobs(hit)


def test_forks_and_prompt_logprobs_with_the_tier(tiny_models):  # type: ignore[no-untyped-def]
    """n = 2 (the fork point's token stays to run) takes the tier's blocks and gives a pool hit's samples;
    a prompt_logprobs request takes none (every position is computed) and gives a cold run's values."""
    path, _ = tiny_models["llama"]
    forked = SamplingParams(n=2, max_tokens=6, temperature=0.8, seed=3, ignore_eos=True)
    scored = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1)
    llm = LLM(str(path), block_size=4, kv_cache_memory=per_block(path) * 24, kv_offloading_size="64MiB")
    roomy = LLM(str(path), block_size=4)
    outs = {}
    for name, e in (("tier", llm), ("pool", roomy)):
        e.generate([A], PARAMS, use_tqdm=False)
        e.generate(OTHERS, PARAMS, use_tqdm=False)
        outs[name] = e.generate([A], forked, use_tqdm=False)[0]
    assert outs["tier"].metrics.num_cached_tokens == outs["pool"].metrics.num_cached_tokens == 36
    assert llm.stats().offload_hit_tokens == 36  # all from the tier, up to the fork point
    assert [c.token_ids for c in outs["tier"].outputs] == [c.token_ids for c in outs["pool"].outputs]
    llm.generate(OTHERS, PARAMS, use_tqdm=False)  # (they come back from the tier, and push A out again)
    before = llm.stats().offload_hit_tokens
    got = llm.generate([A], scored, use_tqdm=False)[0]
    assert llm.stats().offload_hit_tokens == before and got.metrics.num_cached_tokens == 0
    cold = LLM(str(path), block_size=4, enable_prefix_caching=False).generate([A], scored, use_tqdm=False)[0]
    assert got.prompt_logprobs == cold.prompt_logprobs


def test_a_failing_save_or_write_loses_only_the_block(tiny_models, tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    """A save that raises (out of memory) or a file that cannot be written (a full disk) is a block not
    kept: generation goes on with right outputs, and a failed write holds nothing in memory."""
    import os

    from lmserve.kv import offload
    path, _ = tiny_models["llama"]
    ref = LLM(str(path), block_size=4).generate([A], PARAMS, use_tqdm=False)[0]

    class NoSpace:  # os for the offload module, whose rename fails as on a full disk
        def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
            return getattr(os, name)

        @staticmethod
        def replace(*a: object) -> None:
            raise OSError(28, "No space left on device")
    monkeypatch.setattr(offload, "os", NoSpace())
    llm = LLM(str(path), block_size=4, kv_cache_memory=per_block(path) * 24, kv_offloading_size="64MiB",
              kv_offloading_dir=str(tmp_path))
    _, back = evict_and_return(llm)
    llm.close()
    st = llm.stats().offload
    assert st["failed_writes"] > 0 and st["blocks"] == 0 and back.metrics.num_cached_tokens == 0
    assert not list(next(tmp_path.iterdir()).iterdir())  # no file, whole or temporary
    assert back.outputs[0].token_ids == ref.outputs[0].token_ids
    monkeypatch.undo()

    llm = LLM(str(path), block_size=4, kv_cache_memory=per_block(path) * 24, kv_offloading_size="64MiB")
    tier = llm.engine.offload

    def boom(block: int) -> None:
        raise RuntimeError("out of memory")
    monkeypatch.setattr(tier, "_read_block", boom)
    _, back = evict_and_return(llm)
    assert tier.stats()["skipped_blocks"] > 0 and len(tier) == 0 and llm.stats().used_blocks == 0
    assert back.outputs[0].token_ids == ref.outputs[0].token_ids


def test_a_shared_folder_and_what_else_lies_in_it(tiny_models, tmp_path):  # type: ignore[no-untyped-def]
    """Two engines on one folder (replicas) both write and both read; a stray temporary file older than an
    hour is removed at start, a fresh one (another writer's) and names not ours are left alone."""
    import os
    import time
    path, _ = tiny_models["llama"]
    kw = dict(block_size=4, kv_cache_memory=per_block(path) * 24, kv_offloading_size="64MiB",
              kv_offloading_dir=str(tmp_path))
    one, two = LLM(str(path), **kw), LLM(str(path), **kw)
    one.generate([A], PARAMS, use_tqdm=False)
    two.generate([OTHERS[0]], PARAMS, use_tqdm=False)
    one.close()
    two.close()
    (layout,) = list(tmp_path.iterdir())
    old, fresh, odd = layout / "1.tmp", layout / "2.tmp", layout / ("z" * 64 + ".kv")
    for f in (old, fresh, odd):
        f.write_bytes(b"x")
    os.utime(old, (time.time() - 7200,) * 2)
    three = LLM(str(path), **kw)
    got = three.generate([A, OTHERS[0]], PARAMS, use_tqdm=False)
    assert [o.metrics.num_cached_tokens for o in got] == [40, 40]
    assert not old.exists() and fresh.exists() and odd.exists()
    three.close()


def test_an_engine_dropped_without_close_frees_its_cache(tiny_models, tmp_path):  # type: ignore[no-untyped-def]
    """The writer thread holds no KV tensor: a dropped LLM's cache is freed and its writer ends."""
    import gc
    import threading
    import weakref
    path, _ = tiny_models["llama"]
    llm = LLM(str(path), block_size=4, kv_cache_memory=per_block(path) * 24, kv_offloading_size="64MiB",
              kv_offloading_dir=str(tmp_path))
    evict_and_return(llm)
    cache = weakref.ref(llm.engine.kv_cache.tensors[0])
    writer = llm.engine.offload.files.thread
    del llm
    gc.collect()
    assert cache() is None
    writer.join(10)
    assert not writer.is_alive() and writer not in threading.enumerate()
