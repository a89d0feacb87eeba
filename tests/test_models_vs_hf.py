"""Our model code and engine against HF transformers on the same (tiny, random) weights."""

from __future__ import annotations

import pytest
import torch

from lmserve import LLM, SamplingParams
from tests.conftest import FAMILIES

PROMPTS = [[5, 17, 33, 9, 100, 3], [7] * 3 + list(range(20, 61)), [11, 12], list(range(64, 127)) + [1, 2, 3]]


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_hf(tiny_models, family):  # type: ignore[no-untyped-def]
    path, hf = tiny_models[family]
    llm = LLM(str(path), kv_cache_memory="64MiB")
    for prompt in PROMPTS:
        ours = llm.score(prompt)  # (T, V)
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].float()  # (T, V)
        assert ours.shape == ref.shape
        assert (ours - ref).abs().max().item() < 1e-4
    assert llm.stats().used_blocks == 0


CONFIGS = {
    "default": dict(),
    "chunked": dict(max_num_batched_tokens=7),
    "prefix": dict(enable_prefix_caching=True, block_size=4),
    "preempt": dict(kv_cache_memory=None, block_size=4, max_num_batched_tokens=16),
}


def greedy_matches_hf(path, hf, mode: str, n_new: int) -> None:  # type: ignore[no-untyped-def]
    """Our greedy tokens equal HF generate's for PROMPTS under CONFIGS[mode] (preempt: a pool with room
    for ~2.5 of the 4 requests, so someone is preempted and recomputed; prefix: the prompts share a
    40-token prefix a first request cached); every block free afterwards."""
    opts = dict(CONFIGS[mode])
    if mode == "preempt":
        from lmserve.kv.cache import KVCache
        from lmserve.kv.groups import KVGroups
        from lmserve.models.loader import hf_config
        cfg = hf_config(path)
        per_block = KVCache.bytes_per_block(cfg, 4, torch.float32)  # one KV group's layers (all, for one kind)
        groups = KVGroups.from_config(cfg)
        longest = max(len(p) for p in PROMPTS) + n_new
        opts["kv_cache_memory"] = per_block * (groups.blocks_per_token_bound(longest, 4, 16) + 12 * groups.num_groups)
    llm = LLM(str(path), **opts)
    params = SamplingParams(max_tokens=n_new, temperature=0, ignore_eos=True)
    prompts = PROMPTS
    if mode == "prefix":
        shared = list(range(30, 70))
        llm.generate([shared + [3, 4]], params, use_tqdm=False)
        prompts = [shared + p for p in PROMPTS]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, n_new), (mode, prompt)
    st = llm.stats()
    if mode == "preempt":
        assert st.num_preemptions > 0
    if mode == "prefix":
        assert st.prefix_hit_tokens >= 40 * len(PROMPTS) // 4 * 4
    assert st.used_blocks == 0 and st.free_blocks == st.num_blocks


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", list(CONFIGS))
def test_greedy_matches_hf_generate(tiny_models, family, mode):  # type: ignore[no-untyped-def]
    path, hf = tiny_models[family]
    greedy_matches_hf(path, hf, mode, n_new=24)


@pytest.mark.parametrize("chunk", [None, 7])
def test_prompt_logprobs_match_hf_float64(tiny_models, chunk):  # type: ignore[no-untyped-def]
    """prompt_logprobs (each prompt token's logprob, its rank, the top k) against HF's logits in float64,
    in one prefill and in 7-token chunks (the runner computes them a chunk at a time)."""
    path, hf = tiny_models["llama"]
    llm = LLM(str(path), kv_cache_memory="64MiB", **({"max_num_batched_tokens": chunk} if chunk else {}))
    k = 3
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=k))
    ref_model = hf.double()
    try:
        for prompt, out in zip(PROMPTS, outs):
            with torch.no_grad():
                ref = ref_model(torch.tensor([prompt])).logits[0].log_softmax(-1)  # (T, V) float64
            lps = out.prompt_logprobs
            assert lps is not None and len(lps) == len(prompt) and lps[0] is None
            for i in range(1, len(prompt)):
                lp, row, tid = lps[i], ref[i - 1], prompt[i]
                assert lp.token_id == tid and abs(lp.logprob - row[tid].item()) < 1e-4
                # the rank: 1 + the tokens more likely (within float32's rounding of a near tie either way)
                assert int((row > row[tid] + 1e-4).sum()) + 1 <= lp.rank <= int((row > row[tid] - 1e-4).sum()) + 1
                vals = row.topk(k).values  # (k,)
                got = torch.tensor(list(lp.top.values()), dtype=torch.float64)  # (k,), most likely first
                assert torch.allclose(got, vals, atol=1e-4)
                assert all(abs(v - row[t].item()) < 1e-4 for t, v in lp.top.items())
    finally:
        hf.float()
    assert llm.stats().used_blocks == 0
