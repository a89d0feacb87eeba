"""The batch-invariant Triton attention (deterministic mode on CUDA) under TRITON_INTERPRET=1: the
kernel cases against float64 (float, int8 and fp8 caches, a padded CUDA-graph batch), and the property
itself: a sequence's outputs are bit-identical whether its prompt is one chunk, several, or decoded a
token at a time, alone or among other sequences. The same comparison fails for the fast backend
(triton_attn.py), which is how the test can fail. scripts/gpu_check.py runs these compiled for a GPU.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from lmserve.attention.testing import batching_outputs, check_kernels, check_quant_kernels  # noqa: E402
from lmserve.attention.triton_attn import TritonAttention  # noqa: E402
from lmserve.attention.triton_invariant import InvariantTritonAttention  # noqa: E402

# small splits (32 keys) and scratch (a few rows a launch): several splits a token and several launches
# a step, in the interpreter's budget
SMALL = dict(split_keys=32, decode_keys=16, scratch_bytes=8_000)


@pytest.mark.parametrize("cases", [[0, 1, 2], [3, 4, 5]])
def test_invariant_kernel_against_float64(cases):  # type: ignore[no-untyped-def]
    """KERNEL_CASES (ragged prefill chunks, decodes, GQA 1-8, windows, prefixes ending mid-block; the
    decode-only ones also as a padded CUDA-graph batch): within 1e-4 of float64, the store's bytes equal
    the torch reference's, padding rows zero."""
    rows = check_kernels("cpu", torch.float32, d=32, cases=cases, backend=InvariantTritonAttention(**SMALL))
    assert len(rows) == len(cases)
    for r in rows:
        assert r["store_equal"] and r.get("static_store_equal", True) and r.get("static_pad_zero", True), r
        assert r["triton_err"] < 1e-4 and r.get("static_err", 0.0) < 1e-4, r


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_invariant_kernel_reads_quantized_caches(kv):  # type: ignore[no-untyped-def]
    rows = check_quant_kernels("cpu", torch.float32, kv, d=32, cases=[1, 4], backend=InvariantTritonAttention(**SMALL))
    for r in rows:
        assert r["store_equal"] and r.get("static_pad_zero", True), r
        assert r["triton_err"] < 1e-4 and r.get("static_err", 0.0) < 1e-4, r


@pytest.mark.parametrize("window,kv", [(None, None), (24, "int8")])
def test_a_token_attends_the_same_however_it_is_batched(window, kv):  # type: ignore[no-untyped-def]
    """A sequence of 48 tokens computed four ways (one chunk, three chunks, a chunk then decodes, inside
    a crowd: testing.batching_outputs): bit-identical outputs at every position with the invariant
    kernels (several splits a token, several launches a step); within 1e-4 with the fast kernels, but
    not bit-identical there."""
    backend = InvariantTritonAttention(**SMALL)
    rows = backend.scratch_bytes // (2 * 2 * 17 * 4)  # rows a launch: 2 heads, 2 splits of 32 keys, d = 16
    assert rows < 48
    inv = batching_outputs(backend, "cpu", torch.float32, window, kv)
    for name, o in inv.items():
        assert not o.isnan().any(), name
        assert torch.equal(o, inv["one chunk"]), (name, (o - inv["one chunk"]).abs().max())
    fast = batching_outputs(TritonAttention(rows=16, target_programs=8), "cpu", torch.float32, window, kv)
    assert max((o - fast["one chunk"]).abs().max().item() for o in fast.values()) < 1e-4
    assert (fast["one chunk"] - inv["one chunk"]).abs().max() < 1e-4
    assert not all(torch.equal(o, fast["one chunk"]) for o in fast.values())


def test_engine_needle_is_bit_identical_on_the_triton_path(tiny_models):  # type: ignore[no-untyped-def]
    """Deterministic mode as CUDA runs it, under the interpreter: the triton backend (its invariant
    kernels), the fused Triton norm / SiLU / rotary, decode steps through the padded static batch a
    CUDA graph replays. A tiny Mistral (sliding window, GQA 2): a needle's greedy tokens and logprobs
    alone equal those inside a crowd of random requests, with its prompt chunked otherwise (a 16-token
    budget), bit for bit; and a sequence's logits teacher-forced as prefill chunks equal those of one
    decode step a token (the fast kernels differ there: a tl.dot tile against the split-KV decode)."""
    import random

    from lmserve import LLM, SamplingParams
    from lmserve.layers import dispatch
    path, _ = tiny_models["mistral"]
    rng = random.Random(3)
    needle = [rng.randrange(4, 120) for _ in range(25)]
    crowd = [[rng.randrange(4, 120) for _ in range(rng.randint(3, 20))] for _ in range(4)]
    p = SamplingParams(max_tokens=8, temperature=0, logprobs=2, ignore_eos=True)
    params = [SamplingParams(max_tokens=rng.randint(2, 9), temperature=0.9, seed=i, ignore_eos=True)
              for i in range(4)]
    with dispatch.use_fused(True):
        llm = LLM(str(path), attention_backend="triton", deterministic=True, max_num_batched_tokens=16)
        llm.engine.runner.enable_graphs([1, 2, 4, 8], llm.engine.max_model_len, capture=False)
        alone = llm.generate([needle], p, use_tqdm=False)[0].outputs[0]
        assert llm.reset_prefix_cache()  # the crowd run computes the needle again
        outs = llm.generate(crowd[:2] + [needle] + crowd[2:], params[:2] + [p] + params[2:], use_tqdm=False)
        chunks, decodes = llm.score(needle), llm.score(needle, decode_from=12)  # (25, V) each
    assert torch.equal(chunks, decodes), (chunks - decodes).abs().max()
    found = outs[2].outputs[0]
    assert llm.engine.runner.graphs.padded_rows > 0  # decode steps of 3 rows ran in the padded batch of 4
    assert alone.token_ids == found.token_ids
    lp = lambda o: torch.tensor([[x.logprob, *sorted(x.top.values())] for x in o.logprobs])  # noqa: E731
    assert torch.equal(lp(alone), lp(found))


def test_the_registry_picks_the_invariant_kernels_in_deterministic_mode():
    from lmserve.attention import get_backend
    assert isinstance(get_backend("triton", "cpu", deterministic=True), InvariantTritonAttention)
    assert isinstance(get_backend("auto", "cuda", deterministic=True), InvariantTritonAttention)
    assert type(get_backend("triton", "cpu")) is TritonAttention
    for name, device in (("torch", "cuda"), ("torch", "cpu"), ("cpu", "cuda")):
        with pytest.raises(ValueError, match="deterministic"):
            get_backend(name, device, deterministic=True)
