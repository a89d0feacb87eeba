"""The CUDA-graph decode path, checked on the CPU: the padded static-buffer batch (what a graph
replays) run eagerly with the Triton kernels under TRITON_INTERPRET=1, against the float64 reference
and against the engine's eager path. Capture and replay themselves need a GPU (scripts/gpu_check.py).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from lmserve import LLM, SamplingParams  # noqa: E402
from lmserve.attention.testing import float64_attention, pad_static_decode, random_step  # noqa: E402
from lmserve.attention.torch_ref import TorchAttention  # noqa: E402
from lmserve.attention.triton_attn import TritonAttention  # noqa: E402
from lmserve.config import EngineConfig  # noqa: E402


@pytest.mark.parametrize("group,bs,window", [(1, 16, None), (4, 32, None), (2, 16, 20)])
def test_static_decode_batch_with_padding(group, bs, window):  # type: ignore[no-untyped-def]
    """Live decode rows match float64; padding rows (slot -1, context 0) write no KV and output zeros."""
    hkv, d, live, pad = 2, 32, [45, 3, 100], 2
    h = hkv * group
    meta, cache, tables = random_step(live, [1] * len(live), bs, hkv, d, seed=11 + group)
    b = len(live) + pad
    g = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(b, h, d, generator=g), torch.randn(b, hkv, d, generator=g), torch.randn(b, hkv, d, generator=g)
    static = pad_static_decode(meta, pad)
    before = cache.clone()
    out = TritonAttention(target_programs=64).forward(q, k, v, cache, static, d ** -0.5, window)
    changed = (cache != before).any(dim=(0, 2, 3)).nonzero().flatten()
    assert sorted(changed.tolist()) == sorted(meta.slot_mapping.tolist())  # only the live rows' slots
    exact = float64_attention(q[:len(live)], cache, meta, tables, d ** -0.5, window)
    assert (out[:len(live)].double() - exact).abs().max() < 1e-4
    assert torch.equal(out[len(live):], torch.zeros(pad, h, d))
    with pytest.raises(ValueError, match="static"):
        TorchAttention().forward(q, k, v, cache, static, d ** -0.5, window)


def test_graph_sizes_config():
    assert EngineConfig(max_num_seqs=20).graph_sizes == [1, 2, 4, 8, 16, 20]
    assert EngineConfig(max_num_seqs=3).graph_sizes == [1, 2, 3]
    assert EngineConfig(cuda_graph_sizes=[8, 1, 8]).graph_sizes == [1, 8]
    assert EngineConfig(device="cuda", dtype="float32").max_num_seqs == 256  # defaults on CUDA
    assert EngineConfig().max_num_batched_tokens == 512
    with pytest.raises(ValueError, match="cuda_graph_sizes"):
        EngineConfig(cuda_graph_sizes=[0, 4])


@pytest.mark.parametrize("family", ["mistral"])  # sliding window, GQA 2
def test_engine_static_decode_path_matches_eager(tiny_models, family):  # type: ignore[no-untyped-def]
    """Greedy text through the padded static decode path (3 -> 2 -> 1 live rows in graphs of 4 and 2
    and 1) equals the torch reference; the path really ran, with padding."""
    path, _ = tiny_models[family]
    prompts = [[5, 17, 33, 9, 100, 3] * 6, [11, 12], list(range(40, 77))]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (12, 5, 8)]
    ref = LLM(str(path), attention_backend="torch").generate(prompts, params, use_tqdm=False)
    llm = LLM(str(path), attention_backend="triton")
    assert llm.engine.runner.graphs is None  # CPU: eager unless asked
    llm.engine.runner.enable_graphs([1, 2, 4], llm.engine.max_model_len, capture=False)
    out = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    graphs = llm.engine.runner.graphs
    assert graphs.replays >= 11  # every decode step after the first prefill
    assert graphs.padded_rows > 0


def test_score_decode_from_matches_prefill(tiny_models):  # type: ignore[no-untyped-def]
    """Teacher-forced decode steps give the logits of one prefill, on both paths."""
    path, _ = tiny_models["qwen3"]
    toks = [(7 * i + 3) % 120 + 4 for i in range(40)]
    ref = LLM(str(path), attention_backend="torch")
    full = ref.score(toks)
    assert full.shape == (40, 128)
    assert (ref.score(toks, decode_from=9) - full).abs().max() < 1e-4
    assert (ref.score(toks, decode_from=9, last_only=True) - full[-1:]).abs().max() < 1e-4
    tri = LLM(str(path), attention_backend="triton")
    eng = tri.engine
    eng.runner.enable_graphs([1, 2], eng.max_model_len, capture=False)
    assert (tri.score(toks, decode_from=9) - full).abs().max() < 1e-4
    assert eng.runner.graphs.replays == 31
    assert eng.block_manager.stats().free == eng.block_manager.num_blocks  # score frees its blocks
    with pytest.raises(ValueError, match="decode_from"):
        ref.score(toks, decode_from=0)


def test_graph_capture_failure_drops_that_size_only(tiny_models, monkeypatch, caplog):  # type: ignore[no-untyped-def]
    """A size whose warm-up / capture raises something that is not a RuntimeError (here the
    CalledProcessError of a failed Triton launcher build, injected into size 2) is logged and
    dropped; the other sizes serve (a batch of 2 pads up to 4) and the greedy tokens equal the torch
    reference's. Only when every size fails does capture raise (RuntimeError: the engine serves
    eagerly)."""
    import logging
    import subprocess

    from lmserve.graphs import DecodeGraphs
    path, _ = tiny_models["mistral"]
    prompts = [[5, 17, 33, 9, 100, 3] * 6, [11, 12], list(range(40, 77))]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (12, 5, 8)]
    ref = LLM(str(path), attention_backend="torch").generate(prompts, params, use_tqdm=False)
    llm = LLM(str(path), attention_backend="triton")
    real = DecodeGraphs._forward

    def launcher_build_fails_at_2(self, size, meta):  # type: ignore[no-untyped-def]
        if size == 2:
            raise subprocess.CalledProcessError(1, ["gcc", "__triton_launcher.c"])
        return real(self, size, meta)

    monkeypatch.setattr(DecodeGraphs, "_forward", launcher_build_fails_at_2)
    with caplog.at_level(logging.WARNING, logger="lmserve"):
        llm.engine.runner.enable_graphs([1, 2, 4], llm.engine.max_model_len, capture=False)
    graphs = llm.engine.runner.graphs
    assert graphs.sizes == [1, 4] and graphs.bucket(2) == 4
    assert "batch size 2 failed (CalledProcessError" in caplog.text
    out = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    assert graphs.replays >= 11 and graphs.padded_rows > 0

    def always_fails(self, size, meta):  # type: ignore[no-untyped-def]
        raise subprocess.CalledProcessError(1, ["gcc"])

    monkeypatch.setattr(DecodeGraphs, "_forward", always_fails)
    with pytest.raises(RuntimeError, match="no decode graph could be captured"):
        llm.engine.runner.enable_graphs([1, 2], llm.engine.max_model_len, capture=False)
