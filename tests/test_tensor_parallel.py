"""Tensor parallelism (lmserve/parallel): a model split over N processes (gloo on the CPU) gives the
logits and greedy tokens of the whole model in one process, under chunked prefill, prefix caching and
preemption; a quantized linear is split with its scales and groups; a lost rank ends the group
promptly with a clear error. Multi-host over a veth pair between two network namespaces:
tests/test_two_hosts.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from lmserve import LLM
from lmserve.kv.cache import KVCache
from lmserve.layers.linear import MergedLinear
from lmserve.layers.quant import Fp8Linear, Int4Linear, Int8Linear
from lmserve.models.loader import hf_config
from lmserve.parallel.group import RankLost, even_split, head_split, vocab_split
from lmserve.parallel.shard import shard_linear
from lmserve.sequence import SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


# ---------------------------------------------------------------- how the work is cut

def test_head_split_keeps_whole_gqa_groups_on_each_rank():
    # SmolLM2: 9 query heads over 3 KV heads; over 2 ranks the KV heads go 2 + 1 and their queries follow
    assert [head_split(9, 3, 2, r) for r in range(2)] == [(slice(0, 6), slice(0, 2)), (slice(6, 9), slice(2, 3))]
    assert [head_split(9, 3, 3, r) for r in range(3)] == [(slice(3 * r, 3 * r + 3), slice(r, r + 1)) for r in range(3)]
    # fewer KV heads than ranks: each KV head replicated, its query heads split
    assert [head_split(4, 1, 2, r) for r in range(2)] == [(slice(0, 2), slice(0, 1)), (slice(2, 4), slice(0, 1))]
    for h, kv, n in [(32, 8, 4), (32, 8, 3), (12, 2, 4), (16, 8, 8), (8, 2, 8), (4, 2, 2)]:
        seen = []
        for r in range(n):
            q, k = head_split(h, kv, n, r)
            assert all(k.start <= i // (h // kv) < k.stop for i in range(q.start, q.stop))  # its own KV head
            seen += range(q.start, q.stop)
        assert sorted(seen) == list(range(h))  # every query head exactly once
    with pytest.raises(ValueError, match="4 query heads over 2 KV heads cannot be split over 3 ranks"):
        head_split(4, 2, 3, 0)


def test_even_and_vocab_splits_cover_everything_once():
    assert [even_split(1536, 2, r, 32) for r in range(2)] == [slice(0, 768), slice(768, 1536)]
    parts = [even_split(160, 3, r, 32) for r in range(3)]  # 5 units of 32 over 3: 2 + 2 + 1
    assert [(s.start, s.stop) for s in parts] == [(0, 64), (64, 128), (128, 160)]
    with pytest.raises(ValueError, match="whole 32s"):
        even_split(100, 2, 0, 32)
    v = [vocab_split(49153, 2, r) for r in range(2)]
    assert (v[0].start, v[0].stop, v[1].start, v[1].stop) == (0, 24577, 24577, 49153)


def _layers(in_f: int, sizes: list[int]) -> dict[str, object]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(sum(sizes), in_f, generator=g) * 0.05
    out = {"float": MergedLinear(in_f, sizes), "int8 per row": Int8Linear(in_f, sizes),
           "int8 groups of 32": Int8Linear(in_f, sizes, group_size=32),
           "int4 groups of 32": Int4Linear(in_f, sizes, group_size=32), "fp8": Fp8Linear(in_f, sizes)}
    for layer in out.values():
        layer.load(w)
    return out


@pytest.mark.parametrize("kind", ["float", "int8 per row", "int8 groups of 32", "int4 groups of 32", "fp8"])
def test_a_linear_split_by_rows_or_columns_computes_the_whole_one(kind):
    import copy
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(1))
    full_layer = _layers(128, [64, 32, 32])[kind]
    full = full_layer(x)  # (5, 128)
    # column-parallel (qkv-like): each projection keeps a slice of its rows
    cut = copy.deepcopy(full_layer)
    shard_linear(cut, rows=[slice(32, 64), slice(0, 16), slice(16, 32)])
    want = torch.cat([full[:, 32:64], full[:, 64:80], full[:, 112:128]], dim=1)
    torch.testing.assert_close(cut(x), want, rtol=0, atol=1e-6)
    assert cut.sizes == [32, 16, 16]
    # row-parallel (o / down-like): input columns split; the partial products sum to the whole
    halves = []
    for cols in (slice(0, 64), slice(64, 128)):
        part = copy.deepcopy(full_layer)
        shard_linear(part, cols=cols)
        halves.append(part(x[:, cols]))
    torch.testing.assert_close(halves[0] + halves[1], full, rtol=1e-5, atol=1e-5)


def test_a_quantized_split_keeps_the_integers_and_scales_of_the_whole_layer():
    layer = _layers(128, [96])["int8 per row"]
    part = Int8Linear(128, [96])
    part.load_state_dict(layer.state_dict())
    shard_linear(part, cols=slice(64, 128))
    assert torch.equal(part.qweight, layer.qweight[:, 64:])
    assert torch.equal(part.scales, layer.scales)  # a per-row scale stays whole: TP=N holds what TP=1 holds
    grouped = _layers(128, [96])["int4 groups of 32"]
    with pytest.raises(ValueError, match="cut its quantization groups of 32"):
        shard_linear(grouped, cols=slice(0, 48))


# ---------------------------------------------------------------- TP=2 equals TP=1, end to end

PREFIX = [5, 9, 13, 7, 21, 3, 44, 8, 17, 4, 99, 100, 3, 61, 62, 70, 71, 72, 30, 31, 40, 41, 50, 51, 52, 53,
          54, 55, 56, 57, 58, 59]  # two full blocks shared by every prompt: prefix-cache hits


def _prompts() -> list[list[int]]:
    return [PREFIX + [10 + i, 20 + i, 30 + i, 40 + i, 50 + i][: 2 + i % 4] for i in range(6)]


def _small_pool(folder, size: int, blocks: int) -> int:
    """Bytes of `blocks` KV blocks of one rank's shard (its KV heads): a pool that forces preemption."""
    import dataclasses
    cfg = hf_config(folder)
    _, kv = head_split(cfg.num_heads, cfg.num_kv_heads, size, 0)
    local = dataclasses.replace(cfg, num_kv_heads=kv.stop - kv.start)
    return blocks * KVCache.bytes_per_block(local, 16, torch.float32)


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral", "qwen2"])  # qwen3: 1 KV head, replicated
def test_tp2_gives_the_logits_and_tokens_of_tp1(family, tiny_models):
    folder = tiny_models[family][0]
    prompts = _prompts()
    with LLM(str(folder), kv_cache_memory="16MiB") as one:
        logits = one.score(prompts[0])  # (T, V)
        want = [o.outputs[0].token_ids for o in one.generate(prompts, GREEDY, use_tqdm=False)]
    # 7 blocks for 6 sequences of up to 61 tokens (4 blocks each, 3 with a window): preemption; 16-token chunks
    with LLM(str(folder), tensor_parallel_size=2, kv_cache_memory=_small_pool(folder, 2, 7),
             max_num_batched_tokens=16) as two:
        torch.testing.assert_close(two.score(prompts[0]), logits, rtol=0, atol=1e-4)
        got = [o.outputs[0].token_ids for o in two.generate(prompts, GREEDY, use_tqdm=False)]
        st = two.stats()
    assert got == want
    assert st.num_preemptions > 0 and st.prefix_hit_tokens > 0
    assert st.free_blocks == st.num_blocks  # every block back


def test_the_default_model_over_2_and_3_ranks_equals_one_process(smol):
    prompts = ["The capital of France is", "def fibonacci(n):"]
    short = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in smol.generate(prompts, short, use_tqdm=False)]
    logits = smol.score(prompts[0])
    for size in (2, 3):  # 9 query / 3 KV heads: 2 + 1 KV heads over 2 ranks (uneven), 1 each over 3
        with LLM(quantization="none", kv_cache_memory="64MiB", tensor_parallel_size=size) as tp:
            torch.testing.assert_close(tp.score(prompts[0]), logits, rtol=0, atol=2e-4)
            if size == 2:  # (the tokens follow from the logits; generating once is enough)
                assert [o.outputs[0].token_ids for o in tp.generate(prompts, short, use_tqdm=False)] == want


def test_the_default_gguf_model_over_2_ranks_decodes_as_one_does():
    # the default load (GGUF blocks; on VNNI CPUs int8 activations and the CPU decode plan, whose all-
    # reduces sit between its C calls): teacher-forced decode steps over real text agree with one process
    # on the next token as quantization noise allows (a missing or doubled all-reduce agrees on ~nothing)
    text = ("The quick brown fox jumps over the lazy dog. Serving a language model is a memory problem: "
            "the weights stream from memory for every token, and the KV cache decides how many requests fit.")
    with LLM(kv_cache_memory="64MiB") as one:
        want = one.score(text, decode_from=8).argmax(-1)  # (T,)
    with LLM(kv_cache_memory="64MiB", tensor_parallel_size=2) as two:
        got = two.score(text, decode_from=8).argmax(-1)
    agree = (got == want).float().mean().item()
    assert agree >= 0.8, f"top-1 agreement {agree:.2%} over {len(want)} positions"  # measured 90-100%


def test_the_int8_model_over_2_ranks_equals_the_int8_model_in_one(tiny_models, monkeypatch):
    # float activations (our kernels' AVX-512 / AVX2 path): with int8 activations (VNNI) a partial sum's
    # last bit can move an activation's int8 rounding, and the two differ by that rounding, not by TP
    monkeypatch.setenv("LMSERVE_ISA", "avx512")
    folder = str(tiny_models["llama"][0])
    with LLM(folder, quantization="int8", kv_cache_memory="16MiB") as one:
        logits = one.score(_prompts()[1])
        want = [o.outputs[0].token_ids for o in one.generate(_prompts(), GREEDY, use_tqdm=False)]
    with LLM(folder, quantization="int8", kv_cache_memory="16MiB", tensor_parallel_size=2) as two:
        torch.testing.assert_close(two.score(_prompts()[1]), logits, rtol=0, atol=1e-4)
        assert [o.outputs[0].token_ids for o in two.generate(_prompts(), GREEDY, use_tqdm=False)] == want


def test_int8_activations_see_the_whole_layers_blocks_on_every_rank(tmp_path, monkeypatch):
    """The CPU int8 kernel (avx2int8 / vnni) quantizes x per 32 input columns: an MLP of 96 channels was cut
    48 / 48 and rank 1's blocks started mid-block (every logit of it moved, up to 0.03; greedy tokens
    changed). The cut is now in whole 32s (64 / 32); heads whose o_proj columns would cut a block are
    refused by name."""
    import transformers as tf

    from lmserve.layers import cpu_native
    if cpu_native.isa() not in ("vnni", "avx2int8"):
        pytest.skip(f"this CPU's int8 path is {cpu_native.isa()!r}: no int8-activation kernel to cut")
    monkeypatch.setenv("LMSERVE_ISA", "avx2int8")  # (a lone sum's last bit cannot move a rounding between the two)
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
    model = tf.LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(tmp_path)
    prompt = [(3 * j + 1) % 128 for j in range(20)]
    with LLM(str(tmp_path), quantization="int8", kv_cache_memory="8MiB") as one:
        logits = one.score(prompt)
        want = one.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    with LLM(str(tmp_path), quantization="int8", kv_cache_memory="8MiB", tensor_parallel_size=2) as two:
        torch.testing.assert_close(two.score(prompt), logits, rtol=0, atol=1e-4)
        assert two.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == want
    with pytest.raises(ValueError, match=r"rank 0's attention heads \(o_proj input columns 0:16\) cut Int8Linear's "
                                         r"blocks of 32"):  # 4 ranks: one 16-wide head each
        LLM(str(tmp_path), quantization="int8", kv_cache_memory="8MiB", tensor_parallel_size=4)


def test_what_cannot_be_split_is_refused_by_name(tiny_models):
    with pytest.raises(ValueError, match="cannot be split over 3 ranks"):
        LLM(str(tiny_models["llama"][0]), tensor_parallel_size=3, kv_cache_memory="16MiB")
    with pytest.raises(ValueError, match="swapping is not mirrored"):
        LLM(str(tiny_models["llama"][0]), tensor_parallel_size=2, swap_space="64MiB")


# ---------------------------------------------------------------- a lost rank

def test_a_rank_killed_mid_generation_ends_the_step_with_rank_lost(tiny_models):
    llm = LLM(str(tiny_models["llama"][0]), tensor_parallel_size=2, kv_cache_memory="16MiB", distributed_timeout=20)
    try:
        worker = llm.engine.model.workers[0]
        llm.generate([[5, 9, 13]], SamplingParams(max_tokens=4), use_tqdm=False)
        t0 = time.monotonic()
        worker.kill()
        with pytest.raises(RankLost, match="Connection"):
            for _ in range(1000):  # a step notices at its first collective
                llm.generate([[5, 9, 13]], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
        assert time.monotonic() - t0 < 10
        with pytest.raises(RankLost):  # and every later step too: nothing runs on half a model
            llm.generate([[1, 2]], SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        llm.close()


def test_any_failure_inside_a_mirrored_call_is_fatal(tiny_models, monkeypatch):
    # rank 0 fails after the step went out (the other ranks are inside it): serving on would pair the
    # next step's messages with this step's collectives, so the engine stops instead
    llm = LLM(str(tiny_models["llama"][0]), tensor_parallel_size=2, kv_cache_memory="16MiB", distributed_timeout=20)
    try:
        layer = llm.engine.model.inner.layers[1].mlp

        def broken(x):  # type: ignore[no-untyped-def]
            raise MemoryError("injected")
        monkeypatch.setattr(layer, "forward", broken)
        with pytest.raises(RankLost, match="MemoryError: injected.*out of step"):
            llm.generate([[5, 9, 13]], SamplingParams(max_tokens=4), use_tqdm=False)
        monkeypatch.undo()
        with pytest.raises(RankLost):
            llm.generate([[5, 9, 13]], SamplingParams(max_tokens=4), use_tqdm=False)
    finally:
        llm.close()


RANK0 = """
import sys, time
from lmserve import LLM
from lmserve.sequence import SamplingParams
llm = LLM(sys.argv[1], tensor_parallel_size=2, kv_cache_memory="16MiB", distributed_timeout=30)
print("worker", llm.engine.model.workers[0].pid, flush=True)
while True:
    llm.generate([[5, 9, 13]], SamplingParams(max_tokens=32, temperature=0), use_tqdm=False)
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie has exited
    except FileNotFoundError:
        return True


def test_when_rank_0_dies_the_other_rank_exits_with_a_clear_error(tiny_models):
    proc = subprocess.Popen([sys.executable, "-c", RANK0, str(tiny_models["llama"][0])], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        worker = int(proc.stdout.readline().split()[1])
        time.sleep(1.0)  # mid-generation
        proc.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        while not _gone(worker) and time.monotonic() - t0 < 30:
            time.sleep(0.05)
        waited = time.monotonic() - t0
        err = proc.stderr.read()  # the worker shares rank 0's stderr
    finally:
        proc.kill()
        proc.wait()
    assert waited < 10, f"rank 1 still running {waited:.1f} s after rank 0 died"
    assert "error: tensor-parallel rank 1" in err and "failed" in err


def test_the_server_turns_503_and_exits_nonzero_when_a_rank_dies(tiny_models):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    from tests.test_server import free_port, wait_healthy
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "lmserve.cli", "serve", "--port", str(port), "--model",
                             str(tiny_models["llama"][0]), "--tensor-parallel-size", "2", "--kv-cache-memory", "16MiB"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        r = httpx.post(url + "/v1/completions", json={"prompt": [5, 9, 13], "max_tokens": 4, "temperature": 0}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
            (worker,) = map(int, f.read().split())
        os.kill(worker, signal.SIGKILL)
        t0, statuses = time.monotonic(), set()
        while proc.poll() is None and time.monotonic() - t0 < 30:
            try:
                statuses.add(httpx.get(url + "/health", timeout=1).status_code)
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        assert proc.wait(30) == 1 and time.monotonic() - t0 < 30
        assert 503 in statuses  # the grace before exit: /health said why
    finally:
        if proc.poll() is None:
            proc.kill()
    out = proc.stdout.read()
    assert "error: the engine stopped" in out and "tensor-parallel" in out, out[-3000:]


def test_nothing_between_ranks_is_pickled():
    # the vLLM / SGLang class (CVE-2025-30165, -47277): a rank that unpickles what arrives runs what arrives.
    # Every message here is a tensor; torch.distributed's *_object* collectives pickle, so none is used.
    import ast
    from pathlib import Path

    import lmserve.parallel as pkg
    banned = {"pickle", "cloudpickle", "marshal", "dill", "broadcast_object_list", "send_object_list",
              "recv_object_list", "all_gather_object", "gather_object", "scatter_object_list", "eval", "exec"}
    for src in Path(pkg.__file__).parent.glob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(src.read_text())):
            if isinstance(node, ast.Name):
                names.add(node.id)
            elif isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update(a.name.split(".")[0] for a in node.names)
                names.add((getattr(node, "module", None) or "").split(".")[0])
        assert not names & banned, (src.name, names & banned)
        assert "load" not in names or src.name != "step.py"  # no torch.load of a payload


def test_an_engine_that_fails_after_its_ranks_started_stops_them(tiny_models):  # type: ignore[no-untyped-def]
    """TP=2 whose engine fails after loading (max_model_len past the model's): its worker exits and the
    group goes, so the next TP engine, on another model, gives that model's tokens (before, the old
    worker and group lived on, the new engine joined them and decoded through the old model's shard:
    wrong tokens); a second group in one process is refused rather than joined."""
    import torch.distributed as dist
    from lmserve.parallel.group import init_group
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(str(tiny_models["llama"][0]), tensor_parallel_size=2, kv_cache_memory="16MiB", max_model_len=10**6)
    assert not dist.is_initialized()
    other = str(tiny_models["qwen2"][0])
    with LLM(other, kv_cache_memory="16MiB") as one:
        want = one.generate([[5, 9, 13]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    with LLM(other, tensor_parallel_size=2, kv_cache_memory="16MiB", distributed_timeout=20) as two:
        assert two.generate([[5, 9, 13]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == want
        with pytest.raises(RuntimeError, match="already running"):  # refused before it starts anything,
            LLM(other, tensor_parallel_size=2, kv_cache_memory="16MiB")  # and the first one's group kept:
        assert two.generate([[5, 9, 13]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == want
        with pytest.raises(RuntimeError, match="already running"):
            init_group(2, 0, "cpu", 5, None, "tcp://127.0.0.1:1")


def test_a_rank_that_dies_before_the_group_forms_is_named(tiny_models, monkeypatch):  # type: ignore[no-untyped-def]
    """Rank 0 waits distributed_timeout for the group, then said only torch's rendezvous error (a
    timeout in a TCP store); it names the rank that exited, and its status."""
    from lmserve.parallel import driver

    def dying(config, init):  # type: ignore[no-untyped-def]
        return [subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])]
    monkeypatch.setattr(driver, "spawn_workers", dying)
    with pytest.raises(RuntimeError, match=r"rank 1 exited \(status 3\) before the group formed"):
        LLM(str(tiny_models["llama"][0]), tensor_parallel_size=2, distributed_timeout=3, kv_cache_memory="16MiB")
