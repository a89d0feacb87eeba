"""Offline chained acceptance of EAGLE heads on the speculation benchmark's held-out chat prompts: the
target's greedy answers (96 tokens) to spec/prompts.CHAT, then eagle.chain_acceptance over the answer
rows (drafts 1..4 all accepted), for each head given; and how the first draft's acceptance follows
the head's confidence (the top probability of its read-out softmax: what --spec-min-draft-prob cuts
on). BENCHMARKS.md, issue #21.

    python scripts/eagle_chat_acceptance.py HEAD [HEAD ...]
"""

from __future__ import annotations

import sys

import torch

from lmserve import LLM, SamplingParams
from lmserve.bench.spec import task_prompts
from lmserve.spec import eagle

BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.7, 1.01)


@torch.no_grad()
def confidence(head: eagle.EagleHead, examples: list[eagle.Example], lm: torch.Tensor) -> str:
    """Draft 1's share of rows and acceptance per bucket of the head's top probability."""
    vocab = head.draft_vocab
    out = lm if vocab is None else lm[vocab]
    tops, hits = [], []
    for ex in examples:
        pred = eagle.chain_forward(head, ex.feats, ex.embeds, 1)[0]  # (T - 1, H): features of positions 1..
        p = torch.softmax(pred @ out.T, -1)
        top, idx = p.max(-1)
        tok = idx if vocab is None else vocab[idx]
        tops.append(top), hits.append(tok == ex.labels[1:])
    top, hit = torch.cat(tops), torch.cat(hits)
    rows = []
    for lo, hi in zip(BUCKETS, BUCKETS[1:]):
        sel = (top >= lo) & (top < hi)
        rows.append(f"[{lo:.1f}, {min(hi, 1.0):.1f}): {sel.float().mean():.0%} of rows, "
                    f"{hit[sel].float().mean() if sel.any() else 0:.0%} accepted")
    return "; ".join(rows)


def main(heads: list[str]) -> None:
    llm = LLM()
    prompts = task_prompts(llm.tokenizer, 16, "chat")
    outs = llm.generate(prompts, SamplingParams(max_tokens=96, temperature=0), use_tqdm=False)
    lm = eagle.float_head(llm.engine.model)
    examples = []
    for p, o in zip(prompts, outs):
        e = eagle.example(llm, list(p) + list(o.outputs[0].token_ids))
        a = len(p) - 1  # the row whose next token is the answer's first
        examples.append(eagle.Example(e.feats[a:], e.embeds[a:], e.labels[a:], e.tokens[a:]))
    for h in heads:
        head = eagle.load_head(h)
        acc = eagle.chain_acceptance(head, examples, lm, 4)
        print(h, "drafts 1..s accepted:", " / ".join(f"{x:.1%}" for x in acc))
        print("  draft 1 by the head's top probability:", confidence(head, examples, lm))


if __name__ == "__main__":
    main(sys.argv[1:])
