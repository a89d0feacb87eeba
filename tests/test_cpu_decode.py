"""The CPU decode plan (models/cpu_decode.py) runs exactly the module path's kernels: its logits equal
the module path's bit for bit, its tokens too, for one and several sequences, and it steps aside where
it does not apply."""

from __future__ import annotations

import pytest
import torch

from lmserve import LLM, SamplingParams
from lmserve.layers import cpu_native, dispatch
from lmserve.models.cpu_decode import CpuDecodePlan

pytestmark = pytest.mark.skipif(not cpu_native.available() or cpu_native.isa() != "vnni",
                                reason="the plan runs where our CPU kernels take the VNNI path")


def _llm(path, **kw):  # type: ignore[no-untyped-def]
    return LLM(str(path), kv_cache_memory="16MiB", block_size=4, quantization="int4", **kw)


def test_plan_equals_the_module_path(tiny_models, monkeypatch):  # type: ignore[no-untyped-def]
    llm = _llm(tiny_models["llama"][0])
    model = llm.engine.model
    plan = model.cpu_plan()
    assert isinstance(plan, CpuDecodePlan)
    runs: list[int] = []
    real = plan.run
    monkeypatch.setattr(plan, "run", lambda x, *a: runs.append(x.shape[0]) or real(x, *a))
    ids = [5, 9, 2, 7, 1, 3, 8, 8, 4, 6, 11, 2, 9]
    with_plan = llm.score(ids, decode_from=3)  # (T, V): 10 decode steps through the plan
    assert runs == [1] * 10
    model._cpu_plan = None  # the module path (same kernels, one module at a time)
    without = llm.score(ids, decode_from=3)
    assert torch.equal(with_plan, without)
    prompts = [[5, 9, 2, 7], [4, 4, 8], [1, 2, 3, 4, 5, 6, 7]]  # three sequences a step, blocks of 4
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    model._cpu_plan = plan
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == ref and 3 in runs


def test_plan_steps_aside(tiny_models):  # type: ignore[no-untyped-def]
    assert _llm(tiny_models["qwen3"][0]).engine.model.cpu_plan() is None  # q/k norms
    assert LLM(str(tiny_models["llama"][0]), kv_cache_memory="16MiB", quantization="none").engine.model.cpu_plan() is None
    llm = _llm(tiny_models["llama"][0])
    plan = llm.engine.model.cpu_plan()
    assert plan is not None
    x = torch.zeros(1, 64)
    caches = llm.engine.runner.kv_cache.layers
    from lmserve.attention.testing import random_step
    meta, _, _ = random_step([5], [1], 4, 2, 16, seed=0)
    assert plan.applies(x, caches, meta)
    with dispatch.use_fused(False):  # the torch reference asked for
        assert not plan.applies(x, caches, meta)
    meta2, _, _ = random_step([5, 9], [1, 3], 4, 2, 16, seed=0)
    assert not plan.applies(torch.zeros(4, 64), caches, meta2)  # a prefill chunk in the step
