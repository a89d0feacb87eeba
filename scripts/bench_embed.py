"""Embedding throughput (LLM.embed, last-token pooling, normalised) beside HF transformers on the same
weights in the same process: HF's base model over padded batches (right-padded, sorted by length as a
user would batch them, the last real token's final hidden state), the way sentence-transformers runs a
decoder embedding model. Both in float32 on the CPU; the vectors compared (cosine) as a check. Rounds
interleaved; the median per engine.

    python scripts/bench_embed.py [--model smollm2-135m] [--prompts 128] [--min-len 16] [--max-len 128]
                                  [--hf-batch-size 16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lmserve import LLM  # noqa: E402
from lmserve.bench.hf import load_hf_model  # noqa: E402


def hf_embed(model, prompts: list[list[int]], batch: int) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    """Last-token embeddings by HF: batches of similar lengths, right-padded, attention-masked."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[torch.Tensor] = [torch.empty(0)] * len(prompts)
    with torch.inference_mode():
        for s in range(0, len(order), batch):
            idx = order[s:s + batch]
            n = max(len(prompts[i]) for i in idx)
            ids = torch.zeros(len(idx), n, dtype=torch.long)
            mask = torch.zeros(len(idx), n, dtype=torch.long)
            for r, i in enumerate(idx):
                ids[r, :len(prompts[i])] = torch.tensor(prompts[i])
                mask[r, :len(prompts[i])] = 1
            h = model.model(input_ids=ids, attention_mask=mask).last_hidden_state  # (B, n, H)
            for r, i in enumerate(idx):
                out[i] = torch.nn.functional.normalize(h[r, len(prompts[i]) - 1].float(), dim=0)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompts", type=int, default=128)
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=128)
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    rng = random.Random(0)
    llm = LLM(a.model)
    vocab = llm.engine.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(a.min_len, a.max_len))] for _ in range(a.prompts)]
    tokens = sum(map(len, prompts))
    hf = load_hf_model(a.model, torch.float32, "cpu").eval()
    times: dict[str, list[float]] = {"lmserve": [], "hf": []}
    ours = ref = None
    for r in range(a.rounds + 1):  # the first round warms up
        llm.reset_prefix_cache()  # (each round computes every prompt: a last-token request would hit the last one's)
        t = time.perf_counter()
        ours = llm.embed(prompts, use_tqdm=False)
        t1 = time.perf_counter()
        ref = hf_embed(hf, prompts, a.hf_batch_size)
        t2 = time.perf_counter()
        if r:
            times["lmserve"].append(t1 - t)
            times["hf"].append(t2 - t1)
    cos = [float(torch.tensor(o.outputs.embedding) @ v) for o, v in zip(ours, ref)]  # type: ignore[union-attr]
    print(f"{a.prompts} prompts, {tokens} tokens ({a.min_len}..{a.max_len} each), median of {a.rounds} rounds")
    print("| engine | s | prompts/s | tokens/s |")
    print("|---|---|---|---|")
    for name, xs in times.items():
        m = statistics.median(xs)
        print(f"| {name} | {m:.2f} | {a.prompts / m:.1f} | {tokens / m:.0f} |")
    print(f"lmserve / hf: {statistics.median(times['hf']) / statistics.median(times['lmserve']):.2f}x; cosine of the "
          f"two engines' vectors: min {min(cos):.4f}, median {statistics.median(cos):.4f} (lmserve runs the GGUF's "
          f"quantized blocks by default, HF the dequantized float weights)")


if __name__ == "__main__":
    main()
