"""Offline benchmarks on our engine: throughput, latency (with achieved bandwidth), naive vs cached."""

from __future__ import annotations

import random
import time
from typing import Any

import torch

from lmserve.bench.common import Request, latency_prompts, percentiles, sync
from lmserve.kv.cache import KVCache
from lmserve.llm import LLM
from lmserve.sequence import SamplingParams, StructuredOutputsParams


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's weights as held: parameters and buffers (quantized layers keep their
    packed values and scales in buffers)."""
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def measure_bandwidth(device: str, mb: int = 256) -> float:
    """Device memory bandwidth in bytes/s from a large copy (read + write counted)."""
    n = mb * 2**20 // 4
    a = torch.empty(n, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(5):
        b.copy_(a)
    sync(device)
    return 2 * a.numel() * 4 * 5 / (time.perf_counter() - t0)


def failed(outs: list[Any]) -> None:
    """Raise RuntimeError if any request of a benchmark ended in an error: a failed step ends its requests
    with finish_reason "error" and generate returns normally, so its figures would count what never ran."""
    bad = [c for o in outs for c in o.outputs if c.finish_reason == "error"]
    if bad:
        raise RuntimeError(f"{len(bad)} request(s) of the benchmark failed: {bad[0].error}")


def run_throughput(llm: LLM, requests: list[Request], temperature: float = 0.6, seed: int = 0,
                   progress: bool = True, structured: StructuredOutputsParams | None = None) -> dict[str, Any]:
    """The offline workload through LLM.generate: every request with its own max_tokens, ignore_eos
    (and, with `structured`, every output held to that constraint)."""
    params = [SamplingParams(temperature=temperature, max_tokens=r.max_tokens, ignore_eos=True, seed=seed + i,
                             structured_outputs=structured) for i, r in enumerate(requests)]
    before = llm.stats()
    sync(llm.engine.config.device)
    t0 = time.perf_counter()
    outs = llm.generate([r.prompt for r in requests], params, use_tqdm=progress)
    sync(llm.engine.config.device)
    wall = time.perf_counter() - t0
    failed(outs)
    after = llm.stats()
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    prompt_tokens = sum(len(r.prompt) for r in requests)
    queried = after.prompt_tokens_queried - before.prompt_tokens_queried
    return {
        "wall_s": wall, "num_requests": len(requests), "prompt_tokens": prompt_tokens,
        "output_tokens": out_tokens, "output_tokens_per_s": out_tokens / wall,
        "total_tokens_per_s": (out_tokens + prompt_tokens) / wall, "requests_per_s": len(requests) / wall,
        "peak_kv_blocks_used": after.peak_used_blocks, "kv_blocks_total": after.num_blocks,
        "prefix_cache_hit_rate": (after.prefix_hit_tokens - before.prefix_hit_tokens) / queried if queried else 0.0,
        "preemptions": after.num_preemptions - before.num_preemptions,
        "ttft_s": percentiles([o.metrics.ttft for o in outs if o.metrics.ttft is not None]),
        "tpot_s": percentiles([o.metrics.tpot for o in outs if o.metrics.tpot is not None]),
    }


def run_latency(llm: LLM, batch_size: int, input_len: int, output_len: int, repeats: int = 3,
                peak_bandwidth: float | None = None, seed: int = 0) -> dict[str, Any]:
    """Batch of `batch_size` fresh random prompts, greedy, fixed lengths; TTFT, TPOT and the bandwidth
    achieved by decode steps ((weight bytes + KV bytes read) / step time) over `repeats` runs."""
    eng = llm.engine
    dev = eng.config.device
    prompts = latency_prompts(eng.vocab_size, batch_size, input_len, repeats, seed)
    kv_tok = KVCache.bytes_per_block(eng.model_config, 1, eng.config.torch_dtype, eng.config.kv_cache_dtype)  # one token
    wbytes = weight_bytes(eng.model)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    ttfts: list[float] = []
    tpots: list[float] = []
    e2es: list[float] = []
    step_times: list[float] = []
    step_bytes: list[float] = []
    for rep in range(repeats + 1):  # the first run warms up and is not counted
        ids = [f"lat-{rep}-{i}-{time.time_ns()}" for i in range(batch_size)]
        start = time.perf_counter()
        for rid, prompt in zip(ids, prompts[rep]):
            eng.add_request(rid, prompt, params)
        first: dict[str, float] = {}
        done: dict[str, float] = {}
        while eng.has_unfinished_requests():
            decoding = all(s.num_computed_tokens >= s.num_prompt_tokens for seqs in eng.requests.values()
                           for s in seqs) and len(first) == batch_size
            ctx = sum(s.num_tokens for seqs in eng.requests.values() for s in seqs)
            t0 = time.perf_counter()
            outs = eng.step()
            sync(dev)
            t1 = time.perf_counter()
            if decoding and rep > 0:
                step_times.append(t1 - t0)
                step_bytes.append(wbytes + ctx * kv_tok)
            try:
                failed([o for o in outs if o.finished])
            except RuntimeError:
                for rid in ids:
                    eng.abort_request(rid)
                raise
            for o in outs:
                if o.request_id not in first and o.outputs[0].token_ids:
                    first[o.request_id] = t1
                if o.finished:
                    done[o.request_id] = t1
        if rep == 0:
            continue
        for rid in ids:
            ttfts.append(first[rid] - start)
            e2es.append(done[rid] - start)
            if output_len > 1:  # one token has no time per output token
                tpots.append((done[rid] - first[rid]) / (output_len - 1))
    med_step = percentiles(step_times)["p50"] if step_times else float("nan")
    bytes_per_step = sum(step_bytes) / len(step_bytes) if step_bytes else 0.0
    achieved = bytes_per_step / med_step if step_times else 0.0
    peak = peak_bandwidth or measure_bandwidth(dev)
    return {
        "batch_size": batch_size, "input_len": input_len, "output_len": output_len, "repeats": repeats,
        "ttft_s": percentiles(ttfts), "tpot_s": percentiles(tpots), "e2e_s": percentiles(e2es),
        "tokens_per_s": batch_size * output_len / percentiles(e2es)["p50"],
        "decode_tokens_per_s": batch_size / med_step,
        "decode_step_s": percentiles(step_times),
        "weight_bytes": wbytes, "bytes_per_decode_step": bytes_per_step,
        "achieved_bandwidth_gbs": achieved / 1e9, "peak_bandwidth_gbs": peak / 1e9,
        "bandwidth_fraction": achieved / peak,
    }


def run_naive_vs_cached(llm: LLM, max_len: int, points: int = 8, prompt_len: int = 8, seed: int = 0
                        ) -> dict[str, Any]:
    """Time to produce the token at context length L, with the KV cache (one decode step) and without
    it (recompute the whole sequence: what every step costs with no cache)."""
    eng = llm.engine
    dev = eng.config.device
    rng = random.Random(seed)
    prompt = [rng.randrange(10, eng.vocab_size) for _ in range(prompt_len)]
    rid = f"naive-{time.time_ns()}"
    eng.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_len - prompt_len, ignore_eos=True))
    cached: dict[int, float] = {}
    tokens = list(prompt)
    while eng.has_unfinished_requests():
        seq = eng.requests[rid][0]
        length = seq.num_tokens
        t0 = time.perf_counter()
        outs = eng.step()
        sync(dev)
        cached[length] = time.perf_counter() - t0
        for o in outs:
            tokens = o.prompt_token_ids + o.outputs[0].token_ids
    lengths = sorted({max(prompt_len + 1, int(max_len * (i + 1) / points)) for i in range(points)})
    naive: dict[int, float] = {}
    for L in lengths:
        llm.score(tokens[:L], last_only=True)  # warm-up at this shape
        sync(dev)
        t0 = time.perf_counter()
        llm.score(tokens[:L], last_only=True)
        sync(dev)
        naive[L] = time.perf_counter() - t0
    cached_at = {L: cached.get(L, cached.get(L - 1, float("nan"))) for L in lengths}
    return {"lengths": lengths, "naive_s_per_token": [naive[L] for L in lengths],
            "cached_s_per_token": [cached_at[L] for L in lengths],
            "naive_total_s_estimate": sum(naive.values()) / len(naive) * (max_len - prompt_len),
            "cached_total_s": sum(cached.values())}
