"""Deterministic mode (`deterministic=True`): a request's tokens and logprobs are bit-identical whether
it runs alone or among others, however its prompt is chunked, whatever the prefix cache holds. The
needle test: one prompt alone vs inside a crowd of random requests, logprobs compared with
torch.equal; and the inverse, that the same comparison fails with the mode off (float weights: the
matmul library picks kernels by the number of rows)."""

from __future__ import annotations

import random

import pytest
import torch

from lmserve import LLM, SamplingParams

NEEDLE_LEN, CROWD = 260, 32


def _needle_vs_crowd(llm: LLM, seeded: bool, share_prefix: bool = False) -> tuple[list, list]:
    """(alone, in the crowd): the needle's (token ids, logprobs) both ways."""
    rng = random.Random(0)
    needle = [rng.randrange(100, 40000) for _ in range(NEEDLE_LEN)]
    p = SamplingParams(max_tokens=16, temperature=0.8 if seeded else 0, seed=5 if seeded else None, logprobs=3,
                       ignore_eos=True)
    alone = llm.generate([needle], p, use_tqdm=False)[0].outputs[0]
    assert llm.reset_prefix_cache()  # the crowd run computes the needle again (it hit 256 of its 260 tokens)
    crowd = [[rng.randrange(100, 40000) for _ in range(rng.randint(5, 150))] for _ in range(CROWD)]
    if share_prefix:  # the needle's first 160 tokens are cached by a request computed in other chunks
        crowd[0] = needle[:160] + crowd[0]
    params = [SamplingParams(max_tokens=rng.randint(4, 24), temperature=rng.choice([0, 0.9]), seed=i, ignore_eos=True)
              for i in range(CROWD)]
    outs = llm.generate(crowd[:10] + [needle] + crowd[10:], params[:10] + [p] + params[10:], use_tqdm=False)
    found = outs[10].outputs[0]

    def lp(o):  # type: ignore[no-untyped-def]
        return [(x.logprob, tuple(sorted(x.top.items()))) for x in o.logprobs]
    return [alone.token_ids, torch.tensor([x[0] for x in lp(alone)]), lp(alone)], \
        [found.token_ids, torch.tensor([x[0] for x in lp(found)]), lp(found)]


@pytest.mark.parametrize("quantization", ["none", "auto"])
def test_needle_alone_equals_needle_in_a_crowd(quantization):  # type: ignore[no-untyped-def]
    """Greedy and seeded sampling, a crowd of 32 random requests (mixed lengths, greedy and sampled),
    chunked prefill (a 64-token budget) and a prefix-cache hit: bit-identical tokens and logprobs. (Float
    weights, whose every step multiplies in 16-row blocks, run the seeded case with the prefix hit only:
    the crowd is the same, and the greedy one took another 45 s.)"""
    llm = LLM(quantization=quantization, deterministic=True, max_num_batched_tokens=64)
    for seeded, share in ((False, False), (True, True)) if quantization == "auto" else ((True, True),):
        alone, crowd = _needle_vs_crowd(llm, seeded, share)
        assert alone[0] == crowd[0]
        assert torch.equal(alone[1], crowd[1]) and alone[2] == crowd[2]
    assert llm.stats().prefix_hit_tokens > 0


def test_without_the_mode_float_weights_drift():
    """The inverse: the mode off, float weights, the same comparison differs (batch-size-dependent
    matmul kernels). (With the default GGUF blocks the linears are row-invariant already; the
    attention of a long prefill chunk is not: docs/architecture.md, deterministic mode.)"""
    llm = LLM(quantization="none", max_num_batched_tokens=64)
    alone, crowd = _needle_vs_crowd(llm, seeded=False)
    assert not torch.equal(alone[1], crowd[1])
    assert (alone[1] - crowd[1]).abs().max() < 1e-3  # a rounding-level drift, not a bug


def test_deterministic_needs_the_cpu_kernels():
    with pytest.raises(ValueError, match="deterministic"):
        LLM(deterministic=True, attention_backend="torch")
    # caches our kernel cannot read went to the torch path, whose padded decode batch is not invariant
    # (a review measured an fp8 cache's logprobs 0.17 nats and greedy tokens apart, alone against batched)
    for kw in (dict(kv_cache_dtype="fp8"), dict(dtype="float16")):
        with pytest.raises(ValueError, match="deterministic"):
            LLM(deterministic=True, **kw)


@pytest.fixture(scope="module")
def deepseek_v3(tmp_path_factory):  # type: ignore[no-untyped-def]
    from tests.test_deepseek import make_deepseek
    path = tmp_path_factory.mktemp("det_v3")
    make_deepseek("v3", path)
    return path


def test_mla_and_moe_needle_is_bit_identical(deepseek_v3):  # type: ignore[no-untyped-def]
    """A tiny DeepSeek-V3 (MLA, sigmoid routing over 8 experts, rope over 4 channel pairs): the needle
    alone, in a crowd, and prefilled in other chunks (a last chunk of one token, attended in the
    absorbed form, against chunks of 64, in the expanded form) gives bit-identical logprobs. Before,
    the router's sigmoid and the rope's cos / sin rounded an element differently by where it fell in
    the step's tensor (a full vector or the scalar tail), and the two attention forms differed."""
    def needle_logprobs(budget: int, crowd: int) -> tuple[list[int], torch.Tensor]:
        llm = LLM(str(deepseek_v3), deterministic=True, max_num_batched_tokens=budget)
        v = llm.engine.model_config.vocab_size
        rng = random.Random(0)
        needle = [rng.randrange(3, v) for _ in range(200)]
        others = [[rng.randrange(3, v) for _ in range(rng.randint(5, 150))] for _ in range(crowd)]
        p = SamplingParams(max_tokens=16, temperature=0, logprobs=0, ignore_eos=True)
        params = [SamplingParams(max_tokens=rng.randint(4, 12), ignore_eos=True, seed=i) for i in range(crowd)]
        outs = llm.generate(others[:crowd // 2] + [needle] + others[crowd // 2:],
                            params[:crowd // 2] + [p] + params[crowd // 2:], use_tqdm=False)
        o = outs[crowd // 2].outputs[0]
        return o.token_ids, torch.tensor([x.logprob for x in o.logprobs])

    alone = needle_logprobs(64, 0)
    for budget, crowd in ((64, 20), (199, 0)):
        other = needle_logprobs(budget, crowd)
        assert alone[0] == other[0]
        assert torch.equal(alone[1], other[1]), (budget, crowd, (alone[1] - other[1]).abs().max())


def test_mla_with_the_triton_backend_attends_a_token_at_a_time(deepseek_v3):  # type: ignore[no-untyped-def]
    """deterministic with attention_backend="triton" (CUDA's default; here under TRITON_INTERPRET=1 when
    the suite set it, else Triton's compiler is never reached: MLA attends in torch ops in the mode):
    teacher-forced logits of prefill chunks equal those of one decode step a token, bit for bit. The
    latent decode kernel (attention/triton_mla.py) would round differently from the chunks' path."""
    pytest.importorskip("triton")
    llm = LLM(str(deepseek_v3), deterministic=True, attention_backend="triton", max_num_batched_tokens=16)
    assert all(not layer.self_attn.triton and layer.self_attn.token_at_a_time
               for layer in llm.engine.model.layers)
    rng = random.Random(2)
    toks = [rng.randrange(3, llm.engine.model_config.vocab_size) for _ in range(40)]
    chunks, decodes = llm.score(toks), llm.score(toks, decode_from=10)  # (40, V) each
    assert torch.equal(chunks, decodes), (chunks - decodes).abs().max()


def test_mla_decodes_eagerly_and_tensor_parallel_is_refused_in_the_mode(deepseek_v3, tiny_models):  # type: ignore[no-untyped-def]
    """On CUDA an MLA model in deterministic mode attends a token at a time on host lengths: no CUDA graph
    (each size failed its warm-up, logged, before the engine fell back); other models keep them. A
    tensor-parallel all-reduce sums in an order that follows the batch: refused."""
    from lmserve.config import EngineConfig
    from lmserve.graphs import graphs_wanted
    pytest.importorskip("triton")
    cuda = EngineConfig(device="cuda", deterministic=True, attention_backend="triton")
    mla = LLM(str(deepseek_v3), deterministic=True, attention_backend="triton")
    plain = LLM(str(tiny_models["llama"][0]), deterministic=True, attention_backend="triton")
    assert not graphs_wanted(cuda, mla.engine.model) and graphs_wanted(cuda, plain.engine.model)
    free = LLM(str(deepseek_v3), attention_backend="triton")
    assert graphs_wanted(EngineConfig(device="cuda", attention_backend="triton"), free.engine.model)
    assert mla.engine.runner.sampler.invariant and not free.engine.runner.sampler.invariant  # (its running sums)
    with pytest.raises(ValueError, match="deterministic.*tensor"):
        EngineConfig(deterministic=True, tensor_parallel_size=2)
