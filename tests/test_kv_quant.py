"""KV-cache quantization (kv_cache_dtype int8 / fp8; scales per token, head and group of 32 channels).

Round trip within the quantizer's bound; both attention backends (torch reference; Triton under
TRITON_INTERPRET=1, fp32) with a quantized cache against float64 attention over the dequantized cache
(the kernels' own error, as tight as with a float cache) and over the float cache (what quantization
costs, within QUANT_ATTN_BOUND); an engine run against the float cache; the pool's capacity from one
budget; copy-on-write copies the scales; the padded static (CUDA-graph) decode path.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from lmserve import LLM, SamplingParams  # noqa: E402
from lmserve.attention.testing import QUANT_ATTN_BOUND, KERNEL_CASES, check_quant_kernels  # noqa: E402
from lmserve.config import ModelConfig  # noqa: E402
from lmserve.kv.cache import KVCache, QuantizedKV, dequantize, kv_quant_dtype, quantize  # noqa: E402
from lmserve.models.shapes import SHAPES  # noqa: E402
from lmserve.plan import DEVICES, model_from_name, plan  # noqa: E402

FP8 = getattr(torch, "float8_e4m3fn", None)


def _rows(seed: int) -> torch.Tensor:
    """(64, 4, 32) rows of very different magnitudes (1e-6 .. 1e3), a few all-zero rows and spikes."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 4, 32, generator=g) * torch.logspace(-6, 3, 64).view(64, 1, 1)
    x[3] = 0.0
    x[5, :, 7] = 1e4  # one spike per row: the rest quantizes coarsely
    return x


def test_int8_round_trip_within_half_a_step():
    for seed in range(3):
        x = _rows(seed)
        q, s = quantize(x, torch.int8)
        assert q.dtype == torch.int8 and s.shape == (64, 4, 1) and s.dtype == torch.float32  # head_dim 32: one group
        absmax = x.abs().amax(-1)
        assert torch.equal(s[..., 0], absmax / 127)
        assert q.abs().amax(-1)[absmax > 0].eq(127).all()  # the absmax maps to +-127
        err = (dequantize(q, s) - x).abs()
        bound = (absmax / 127 / 2).unsqueeze(-1)  # half a quantization step = absmax / 254
        assert (err <= bound * (1 + 1e-5) + x.abs() * 2 ** -22).all()
        assert (err.amax(-1) > 0.9 * bound.squeeze(-1))[absmax > 1e-3].float().mean() > 0.5  # the bound is tight
        assert (dequantize(q, s)[3] == 0).all()  # a zero row: scale 0, no NaN


def test_int8_groups_of_32_channels_keep_a_large_channel_from_setting_every_step():
    """head_dim 64: a scale per 32 channels. Keys carry a few large channels (rotary pairs); with one
    scale per head their absmax set the step of all 64 channels. Each group's error stays within half
    of its own step (absmax of the group / 254), a bound one scale per head exceeds by ~10x here."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(256, 3, 64, generator=g)
    x[..., 40] = 40 * torch.randint(0, 2, (256, 3), generator=g).mul(2).sub(1)  # a large channel in the second group
    q, s = quantize(x, torch.int8)
    assert s.shape == (256, 3, 2) and q.shape == x.shape
    xg = x.reshape(256, 3, 2, 32)
    assert torch.equal(s, xg.abs().amax(-1) / 127)
    err = (dequantize(q, s) - x).abs().reshape(256, 3, 2, 32)
    bound = (s / 2).unsqueeze(-1) * (1 + 1e-5) + xg.abs() * 2 ** -22
    assert (err <= bound).all()
    head_step = x.abs().amax(-1) / 127  # what one scale per head would give: (256, 3)
    first = err[:, :, 0]  # the channels without the large one: steps ~10x finer than the head's
    assert (first.amax(-1) < head_step / 8).all()
    head_err = (dequantize(*quantize(x.reshape(256, 3, 2, 32)[..., 0, :].contiguous(), torch.int8)) - x[..., :32]).abs()
    assert torch.equal(head_err, first)  # the first group is quantized as a 32-wide head would be
    cache = QuantizedKV.from_float(torch.stack([x, -x]), torch.int8)  # (2, S, Hkv, d), scales (2, S, Hkv, 2)
    assert cache.scale.shape == (2, 256, 3, 2)
    assert torch.equal(cache.read(0, torch.arange(5, 9), torch.float32), dequantize(q, s)[5:9])
    assert cache.nbytes() == 2 * 256 * 3 * (64 + 2 * 4)


@pytest.mark.skipif(FP8 is None, reason="this torch build has no float8_e4m3fn")
def test_fp8_round_trip_within_its_grid():
    x = _rows(7)
    q, s = quantize(x, FP8)
    assert q.dtype == FP8
    absmax = x.abs().amax(-1)
    assert torch.equal(s[..., 0], absmax / 448)
    assert q.float().abs().amax(-1)[absmax > 0].eq(448).all()
    err = (dequantize(q, s) - x).abs()
    # 3 mantissa bits: half an ulp is |x| / 16 at most; subnormals (below 2^-6) are 2^-9 apart
    bound = torch.maximum(x.abs() / 16, s / 1024) * (1 + 1e-5)
    assert (err <= bound).all()
    assert (err / bound)[bound > 0].max() > 0.9  # the bound is reached


@pytest.mark.parametrize("case", range(len(KERNEL_CASES)))
def test_kernels_int8_vs_float64(case):  # type: ignore[no-untyped-def]
    """Ragged prefill + decode, GQA 1..8, block sizes 16 / 32, prefixes ending mid-block, windows;
    decode-only cases also as a padded static batch."""
    r = check_quant_kernels("cpu", torch.float32, "int8", d=32, cases=[case], target_programs=16)[0]
    assert r["store_equal"]  # Triton's store wrote the reference's bytes and scales
    assert r["torch_err"] < 1e-5 and r["triton_err"] < 1e-5  # vs float64 over the dequantized cache
    bound = QUANT_ATTN_BOUND["int8"]
    assert r["torch_quant_err"] < bound and r["triton_quant_err"] < bound  # vs float64 over the float cache
    assert r["torch_quant_err"] > 1e-4  # the cache really is quantized
    if "static_err" in r:
        assert r["static_err"] < 1e-5 and r["static_pad_zero"] and r["static_store_equal"]
    print(f"case {case} int8: kernel err torch {r['torch_err']:.1e} triton {r['triton_err']:.1e}; "
          f"vs float cache {r['torch_quant_err']:.2e} (bound {bound})")


@pytest.mark.parametrize("case", [2, 5])
def test_kernels_int8_groups_vs_float64(case):  # type: ignore[no-untyped-def]
    """head_dim 64: two scales per head (groups of 32 channels), written by both stores byte for byte
    and read per channel by both backends: prefill + decode with GQA 4 (case 2), a decode-only
    windowed batch, also padded static (case 5)."""
    r = check_quant_kernels("cpu", torch.float32, "int8", d=64, cases=[case], target_programs=16)[0]
    assert r["store_equal"]
    assert r["torch_err"] < 1e-5 and r["triton_err"] < 1e-5
    assert 1e-4 < r["torch_quant_err"] < QUANT_ATTN_BOUND["int8"] and r["triton_quant_err"] < QUANT_ATTN_BOUND["int8"]
    if "static_err" in r:
        assert r["static_err"] < 1e-5 and r["static_pad_zero"] and r["static_store_equal"]


@pytest.mark.skipif(FP8 is None, reason="this torch build has no float8_e4m3fn")
def test_kernels_fp8_vs_float64():
    for r in check_quant_kernels("cpu", torch.float32, "fp8", d=32, cases=[1, 3], target_programs=16):
        assert r["store_equal"]
        assert r["torch_err"] < 1e-5 and r["triton_err"] < 1e-5
        assert r["torch_quant_err"] < QUANT_ATTN_BOUND["fp8"] and r["triton_quant_err"] < QUANT_ATTN_BOUND["fp8"]
        assert r["static_err"] < 1e-5 if "static_err" in r else True
        print(f"case {r['case']} fp8: vs float cache {r['triton_quant_err']:.2e} (bound {QUANT_ATTN_BOUND['fp8']})")


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    return sum(x == y for s, t in zip(a, b) for x, y in zip(s, t)) / sum(map(len, a))


def test_engine_int8_against_float_cache(tiny_models):  # type: ignore[no-untyped-def]
    """Greedy tokens and teacher-forced logits (prefill, and one-token decode steps) of the int8
    cache against the float cache. Tiny random models have near-tied logits, so every position whose
    float top-1 margin exceeds twice the largest logit error must pick the same token; the rest are
    counted, not required."""
    path, _ = tiny_models["llama"]
    f, q = LLM(str(path), kv_cache_memory="32MiB"), LLM(str(path), kv_cache_memory="32MiB", kv_cache_dtype="int8")
    assert isinstance(q.engine.kv_cache.layers[0], QuantizedKV)
    assert q.engine.kv_cache.layers[0].data.dtype == torch.int8
    prompts = [[5, 17, 33, 9, 100, 3] * 5, [11, 12], list(range(40, 77)), [(7 * i + 3) % 120 + 4 for i in range(60)]]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    a = [o.outputs[0].token_ids for o in f.generate(prompts, params, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in q.generate(prompts, params, use_tqdm=False)]
    agree = _agreement(a, b)
    assert agree >= 0.9, agree  # measured 0.979 (one sequence diverges late at a near tie)
    toks = prompts[3]
    ref = f.score(toks)  # (60, V)
    for got in (q.score(toks), q.score(toks, decode_from=5)):
        err = (got - ref).abs().max().item()
        assert err < 0.08, err  # measured 0.022 (logits up to ~2.4)
        top2 = ref.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * err
        assert clear.sum() > 40 and torch.equal(got.argmax(-1)[clear], ref.argmax(-1)[clear])
    print(f"int8 vs float cache: greedy agreement {agree:.3f}, logit err {err:.4f}, teacher-forced argmax "
          f"agreement {(got.argmax(-1) == ref.argmax(-1)).float().mean():.3f}")


def test_pool_capacity_grows(tiny_models):  # type: ignore[no-untyped-def]
    """The same kv_cache_memory holds more blocks; the scales are counted (the tensors fit the budget),
    and `lmserve plan` counts the same bytes per token."""
    path, _ = tiny_models["llama"]  # 2 layers, 2 KV heads, head_dim 16, fp32
    budget = 4 << 20
    counts = {}
    for dt in ("auto", "int8"):
        eng = LLM(str(path), kv_cache_memory=budget, kv_cache_dtype=dt).engine
        counts[dt] = eng.block_manager.num_blocks
        allocated = sum(x.nbytes() if isinstance(x, QuantizedKV) else x.numel() * x.element_size()
                        for x in eng.kv_cache.layers)
        assert budget - KVCache.bytes_per_block(eng.model_config, 16, torch.float32, dt) < allocated <= budget
    assert counts == {"auto": 512, "int8": 1638}  # 8192 vs 2560 bytes per block: 16 x (16 + 4) vs 16 x 64
    # real shapes, 1 GiB: int8 vs bf16 ~1.78x, vs fp32 ~3.56x (head_dim 128, a scale per 32 channels:
    # (2 x 128) / (128 + 4 x 4) = 1.78)
    cfg = ModelConfig(**SHAPES["qwen3-0.6b"])
    n = {dt: KVCache.blocks_for_budget(cfg, 16, mdt, 1 << 30, kv)
         for dt, mdt, kv in (("bf16", torch.bfloat16, "auto"), ("fp32", torch.float32, "auto"),
                             ("int8", torch.bfloat16, "int8"), ("fp8", torch.bfloat16, "fp8"))}
    assert n["int8"] == n["fp8"] and 1.77 < n["int8"] / n["bf16"] < 1.79 and 3.55 < n["int8"] / n["fp32"] < 3.57
    print(f"blocks of 16 tokens in 4 MiB, tiny llama fp32: {counts}; qwen3-0.6b in 1 GiB: {n}")
    m = model_from_name("qwen3-0.6b")
    for kv, mdt in (("int8", torch.bfloat16), ("bf16", torch.bfloat16), ("fp32", torch.float32)):
        per_token = plan(m, DEVICES["h200"], "bf16", kv_dtype=kv)["kv_bytes_per_token"]
        assert per_token == KVCache.bytes_per_block(cfg, 1, mdt, kv if kv == "int8" else "auto")


def test_copy_blocks_copies_scales():
    cfg = ModelConfig("LlamaForCausalLM", vocab_size=8, hidden_size=32, intermediate_size=8, num_layers=2,
                      num_heads=2, num_kv_heads=2, head_dim=16)
    cache = KVCache(cfg, num_blocks=6, block_size=4, dtype=torch.float32, device="cpu", kv_cache_dtype="int8")
    g = torch.Generator().manual_seed(0)
    for layer in cache.layers:
        layer.store(torch.randn(24, 2, 16, generator=g), torch.randn(24, 2, 16, generator=g), torch.arange(24))
    before = [QuantizedKV(x.data.clone(), x.scale.clone()) for x in cache.layers]
    cache.copy_blocks([(1, 4), (2, 0)])
    for old, new in zip(before, cache.layers):
        for src, dst in ((1, 4), (2, 0)):
            s, d = slice(src * 4, src * 4 + 4), slice(dst * 4, dst * 4 + 4)
            assert torch.equal(new.data[:, d], old.data[:, s]) and torch.equal(new.scale[:, d], old.scale[:, s])
        for blk in (1, 2, 3, 5):  # untouched
            s = slice(blk * 4, blk * 4 + 4)
            assert torch.equal(new.data[:, s], old.data[:, s]) and torch.equal(new.scale[:, s], old.scale[:, s])


@pytest.mark.skipif(FP8 is None, reason="this torch build has no float8_e4m3fn")
def test_fp8_cache_store_read_copy():
    """fp8 on a CPU build without float8 index kernels: stores, reads and copies go through byte views."""
    cfg = ModelConfig("LlamaForCausalLM", vocab_size=8, hidden_size=32, intermediate_size=8, num_layers=1,
                      num_heads=2, num_kv_heads=2, head_dim=16)
    cache = KVCache(cfg, num_blocks=3, block_size=4, dtype=torch.float32, device="cpu", kv_cache_dtype="fp8")
    layer = cache.layers[0]
    assert layer.data.dtype == kv_quant_dtype("fp8")
    k, v = torch.randn(4, 2, 16), torch.randn(4, 2, 16)
    layer.store(k, v, torch.arange(4, 8))
    cache.copy_blocks([(1, 2)])
    back = layer.read(0, torch.arange(8, 12), torch.float32)
    assert (back - k).abs().max() <= k.abs().max() / 16


def test_parallel_sampling_int8_children_equal_seeded_requests(tiny_models):  # type: ignore[no-untyped-def]
    """n=2 children share the prompt's blocks; the partial last block is copied on write (elements and
    scales). Each child equals the single request with its seed, on the same int8 cache; and the
    first tokens equal the float cache's."""
    path, _ = tiny_models["llama"]
    prompt = [(5 * i + 7) % 120 + 3 for i in range(37)]  # the last block is partial
    q = LLM(str(path), kv_cache_dtype="int8", enable_prefix_caching=False, kv_cache_memory="32MiB")
    params = SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=10, ignore_eos=True)
    fam = q.generate([prompt], params, use_tqdm=False)[0]
    kids = [o.token_ids for o in fam.outputs]
    assert kids[0] != kids[1]
    for i, kid in enumerate(kids):
        alone = q.generate([prompt], SamplingParams(temperature=1.0, seed=11 + i, max_tokens=10, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0].token_ids
        assert kid == alone, i
    flt = LLM(str(path), enable_prefix_caching=False, kv_cache_memory="32MiB").generate([prompt], params, use_tqdm=False)[0]
    assert [o.token_ids[:4] for o in flt.outputs] == [k[:4] for k in kids]


def test_triton_static_decode_path_int8(tiny_models):  # type: ignore[no-untyped-def]
    """The padded static-buffer decode path (what a CUDA graph replays) with an int8 cache, Triton
    under the interpreter: greedy tokens equal the torch reference's on the same int8 cache."""
    pytest.importorskip("triton")
    path, _ = tiny_models["mistral"]  # sliding window, GQA 2
    prompts = [[5, 17, 33, 9, 100, 3] * 5, [11, 12], list(range(40, 57))]  # 30 tokens: past the window of 24
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (6, 3, 5)]
    opts = dict(kv_cache_dtype="int8", kv_cache_memory="32MiB")
    ref = LLM(str(path), attention_backend="torch", **opts).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(path), attention_backend="triton", **opts)
    llm.engine.runner.model.layers[0].self_attn.backend.target_programs = 8  # fewer programs under the interpreter
    llm.engine.runner.enable_graphs([1, 2, 4], llm.engine.max_model_len, capture=False)
    out = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    assert llm.engine.runner.graphs.replays >= 5 and llm.engine.runner.graphs.padded_rows > 0
