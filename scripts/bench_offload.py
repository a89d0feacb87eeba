"""What the prefix cache's offload tier buys: long documents revisited round robin through a KV pool that
holds only a few of them (a chat server whose conversations outnumber its cache; a RAG server with more
documents than fit). Each request is a document (--doc-len tokens) plus a short question, one at a time,
--output-len new tokens. Configurations, in one process: the pool alone (every revisit recomputes its
document), a host-memory tier, a directory tier, and a restart: a new engine on that directory's files
(its first visit of each document) beside a cold engine. Per configuration: TTFT p50 of the revisits
(rounds 2..; for the restart, of its one round), the prompt tokens served from cache, the wall time.

--cost: what the tier costs where nothing comes back: --rounds rounds of three new documents each, through
the same pool, the three engines (pool alone, memory tier, directory tier) taking turns document by
document; TTFT p50 of each (the first round dropped: warm-up), every block evicted and saved.

    python scripts/bench_offload.py [--model smollm2-135m] [--docs 8] [--doc-len 1024] [--pool-docs 2] [--rounds 3] [--cost]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lmserve import LLM, SamplingParams  # noqa: E402
from lmserve.kv.cache import KVCache  # noqa: E402


def requests(docs: int, doc_len: int, rounds: int, vocab: int, seed: int = 0) -> list[list[list[int]]]:
    """rounds x docs prompts: document d's tokens, then a question of 16 tokens new each round."""
    rng = random.Random(seed)
    bodies = [[rng.randrange(100, vocab) for _ in range(doc_len)] for _ in range(docs)]
    return [[b + [rng.randrange(100, vocab) for _ in range(16)] for b in bodies] for _ in range(rounds)]


def run(llm: LLM, rounds: list[list[list[int]]], params: SamplingParams) -> dict:
    ttft: list[list[float]] = []
    t0 = time.perf_counter()
    for prompts in rounds:
        ttft.append([])
        for p in prompts:
            out = llm.generate([p], params, use_tqdm=False)[0]
            ttft[-1].append(out.metrics.ttft)
    wall = time.perf_counter() - t0
    st = llm.stats()
    revisits = [t for r in ttft[1:] for t in r] or ttft[0]
    return {"ttft_p50_ms": round(1000 * statistics.median(revisits), 1),
            "first_round_ttft_p50_ms": round(1000 * statistics.median(ttft[0]), 1),
            "hit_tokens": st.prefix_hit_tokens, "offload_hit_tokens": st.offload_hit_tokens,
            "computed_tokens": st.computed_tokens, "wall_s": round(wall, 2),
            "tier": st.offload}


def cost(kw: dict, pool: int, tier: int, a: argparse.Namespace, vocab: int, folder: str) -> None:
    """The three engines in turn over new documents only: TTFT p50 each, the tier's counters."""
    llms = {"pool alone": LLM(**kw, kv_cache_memory=pool), "memory tier": LLM(**kw, kv_cache_memory=pool,
            kv_offloading_size=tier), "directory tier": LLM(**kw, kv_cache_memory=pool, kv_offloading_size=tier,
                                                           kv_offloading_dir=folder)}
    rng = random.Random(1)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    ttft: dict[str, list[float]] = {k: [] for k in llms}
    for r in range(a.rounds):
        docs = [[rng.randrange(100, vocab) for _ in range(a.doc_len)] for _ in range(3)]
        for doc in docs:
            for i, (name, llm) in enumerate(llms.items()):  # (each engine its own tokens: no shared prefix)
                out = llm.generate([doc + [100 + i]], params, use_tqdm=False)[0]
                if r:
                    ttft[name].append(out.metrics.ttft)
    print("\n| engine | TTFT p50, new documents only | tier |\n|---|---|---|")
    for name, llm in llms.items():
        print(f"| {name} | {1000 * statistics.median(ttft[name]):.0f} ms | {llm.stats().offload} |")
        llm.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--doc-len", type=int, default=1024)
    ap.add_argument("--pool-docs", type=int, default=2, help="documents the KV pool holds")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--cost", action="store_true", help="new documents only: what saving every evicted block costs")
    a = ap.parse_args()
    kw = {"model": a.model} if a.model else {}
    probe = LLM(**kw)
    c, bm = probe.engine.config, probe.engine.block_manager
    per_block = KVCache.bytes_per_block(probe.engine.model_config, c.block_size, c.torch_dtype, c.kv_cache_dtype,
                                        not c.disable_hybrid_kv_cache_manager)
    per_doc = per_block * bm.max_blocks(a.doc_len + 16 + a.output_len)  # every KV group's blocks (Gemma 3: windows)
    vocab = probe.engine.vocab_size
    del probe
    pool = per_doc * a.pool_docs
    tier = per_block * bm.num_groups * bm.blocks_needed(a.doc_len + 16 + a.output_len) * (a.docs + 1)  # every block
    rounds = requests(a.docs, a.doc_len, a.rounds, vocab)
    params = SamplingParams(max_tokens=a.output_len, temperature=0, ignore_eos=True)
    folder = tempfile.mkdtemp(prefix="lmserve-offload-")
    if a.cost:
        return cost(kw, pool, tier * 4, a, vocab, folder)
    print(f"pool {pool / 2**20:.0f} MiB ({a.pool_docs} documents of {a.doc_len} tokens), tier {tier / 2**20:.0f} "
          f"MiB, {a.docs} documents x {a.rounds} rounds, {a.output_len} new tokens each", flush=True)
    results = {}
    for name, extra in (("pool alone", {}), ("memory tier", {"kv_offloading_size": tier}),
                        ("directory tier", {"kv_offloading_size": tier, "kv_offloading_dir": folder})):
        llm = LLM(**kw, kv_cache_memory=pool, **extra)
        results[name] = run(llm, rounds, params)
        llm.close()
        print(name, json.dumps(results[name]), flush=True)
    for name, extra in (("restart, cold", {}),
                        ("restart, directory tier", {"kv_offloading_size": tier, "kv_offloading_dir": folder})):
        t0 = time.perf_counter()
        llm = LLM(**kw, kv_cache_memory=pool, **extra)
        load = time.perf_counter() - t0
        results[name] = run(llm, rounds[:1], params) | {"load_s": round(load, 2)}
        llm.close()
        print(name, json.dumps(results[name]), flush=True)
    base = results["pool alone"]["ttft_p50_ms"]
    print("\n| configuration | TTFT p50 | vs the pool alone | prompt tokens from cache | tokens computed | wall |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        ref = results["restart, cold"]["ttft_p50_ms"] if name.startswith("restart") else base
        print(f"| {name} | {r['ttft_p50_ms']} ms | {ref / r['ttft_p50_ms']:.2f}x faster | {r['hit_tokens']} "
              f"({r['offload_hit_tokens']} from the tier) | {r['computed_tokens']} | {r['wall_s']} s |")


if __name__ == "__main__":
    main()
