"""Automatic prefix caching on a real engine: shared prefixes are not recomputed, outputs unchanged."""

from __future__ import annotations

import pytest

from lmserve import LLM, SamplingParams


def test_shared_prefix_computes_only_new_tokens(tiny_models):  # type: ignore[no-untyped-def]
    path, _ = tiny_models["llama"]
    prefix = [(7 * i + 3) % 120 + 4 for i in range(200)]
    first, second = prefix + [10, 11, 12], prefix + [20, 21, 22, 23, 24]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    cached = LLM(str(path), block_size=16, enable_prefix_caching=True)
    out1 = cached.generate([first], params, use_tqdm=False)[0]
    before = cached.stats().computed_tokens
    out2 = cached.generate([second], params, use_tqdm=False)[0]
    computed = cached.stats().computed_tokens - before
    hit = 192  # 12 full blocks of 16 of the 200-token prefix
    assert out2.metrics.num_cached_tokens == hit
    # the new request ran only its uncached prompt tokens plus one step per generated token after the first
    assert computed == len(second) - hit + (8 - 1)

    plain = LLM(str(path), block_size=16, enable_prefix_caching=False)
    ref1, ref2 = plain.generate([first, second], params, use_tqdm=False)
    assert plain.stats().prefix_hit_tokens == 0
    assert out1.outputs[0].token_ids == ref1.outputs[0].token_ids
    assert out2.outputs[0].token_ids == ref2.outputs[0].token_ids


def test_a_readmitted_request_keeps_its_first_cache_hit(tiny_models):  # type: ignore[no-untyped-def]
    """A request preempted by recompute finds its own prompt and output blocks in the prefix cache when it
    comes back: num_cached_tokens (the prompt's hit: usage.prompt_tokens_details.cached_tokens) stays what
    its first admission found, not that readmission's hit (8 cached of a 4-token prompt before)."""
    import torch

    from lmserve.kv.cache import KVCache
    from lmserve.models.loader import hf_config
    path, _ = tiny_models["llama"]
    per_block = KVCache.bytes_per_block(hf_config(path), 4, torch.float32)
    llm = LLM(str(path), block_size=4, kv_cache_memory=8 * per_block, max_model_len=64,
              preemption_mode="recompute", enable_prefix_caching=True)
    outs = llm.generate([[5, 6, 7, 8], [9, 10, 11, 12]], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
                        use_tqdm=False)
    assert sum(o.metrics.num_preemptions for o in outs) >= 1  # the case under test happened
    assert [o.metrics.num_cached_tokens for o in outs] == [0, 0]  # nothing was cached when they arrived
    # nor in the engine's hit rate (/metrics): a readmission's lookup finds its own blocks, which vLLM
    # counts apart and does not export (it counted 8 hits and 20+ queried tokens here)
    st = llm.stats()
    assert st.prefix_hit_tokens == 0 and st.prompt_tokens_queried == 8


def test_cache_salt_keeps_prefixes_apart(tiny_models):  # type: ignore[no-untyped-def]
    """vLLM's cache_salt (a dict prompt's): a request shares prefix-cache blocks only with requests of the same
    salt (none with unsalted ones, none across salts); the tokens are the same whatever the salt."""
    llm = LLM(str(tiny_models["llama"][0]), kv_cache_memory="64MiB", block_size=4)
    prompt = list(range(30, 70))
    p = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)

    def run(salt):  # type: ignore[no-untyped-def]
        out = llm.generate([prompt if salt is None else {"prompt_token_ids": prompt, "cache_salt": salt}], p,
                           use_tqdm=False)[0]
        return out.metrics.num_cached_tokens, out.outputs[0].token_ids
    base = run(None)
    first, again, other, base_again = run("tenant-1"), run("tenant-1"), run("tenant-2"), run(None)
    assert base[0] == 0 and first[0] == 0 and other[0] == 0  # nothing crosses a salt
    assert again[0] > 0 and base_again[0] > 0  # the same salt (or none) shares
    assert base[1] == first[1] == again[1] == other[1] == base_again[1]
    with pytest.raises(ValueError, match="^cache_salt"):
        llm.generate([{"prompt_token_ids": prompt, "cache_salt": ""}], p)
    with pytest.raises(ValueError, match=r"^prompts\[0\]"):
        llm.generate([{"prompt_token_ids": prompt, "salt": "x"}], p)
    assert llm.stats().used_blocks == 0
