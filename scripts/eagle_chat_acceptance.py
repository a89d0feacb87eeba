"""Offline chained acceptance of EAGLE heads on the speculation benchmark's held-out chat prompts: the
target's greedy answers (96 tokens) to spec/prompts.CHAT, then eagle.chain_acceptance over the answer
rows (drafts 1..4 all accepted), for each head given; how the first draft's acceptance follows the
head's confidence (the top probability of its read-out softmax: what --spec-min-draft-prob cuts on)
and the target's own; and the best static draft tree of N nodes (EAGLE-2 / Medusa style) beside the
chain: along the accepted path a tree node computes what chain_forward does, so from the rank of the
target's greedy token at each chained depth a tree's expected tokens a verification are 1 + the sum
over its nodes of how often the node's path of ranks is matched. BENCHMARKS.md, issue #21.

    python scripts/eagle_chat_acceptance.py HEAD [HEAD ...]
"""

from __future__ import annotations

import sys
from collections import Counter

import torch

from lmserve import LLM, SamplingParams
from lmserve.bench.spec import task_prompts
from lmserve.spec import eagle

BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.7, 1.01)
TARGET_BUCKETS = (0.0, 0.3, 0.5, 0.7, 0.9, 1.01)
DEPTH, MAX_RANK = 4, 8  # tree depth and the ranks a tree node may take


@torch.no_grad()
def ranks(head: eagle.EagleHead, ex: eagle.Example, lm: torch.Tensor) -> torch.Tensor:
    """(rows, DEPTH) rank of the target's greedy token in the head's read-out at each chained depth, over
    eagle.greedy_rows; a token outside the draft vocabulary ranks MAX_RANK."""
    vocab = head.draft_vocab
    out = lm if vocab is None else lm[vocab]
    where = torch.arange(lm.shape[0]) if vocab is None else torch.full((lm.shape[0],), -1).index_put_(
        (vocab,), torch.arange(len(vocab)))  # token id -> read-out row (-1: not drafted)
    preds = eagle.chain_forward(head, ex.feats, ex.embeds, DEPTH)
    m = ex.feats.shape[0] - DEPTH
    cols = []
    for s, pred in enumerate(preds, 1):
        logits = pred[:m] @ out.T  # (m, V')
        row = where[ex.labels[s:s + m]]  # (m,)
        rank = (logits > logits.gather(1, row.clamp(min=0)[:, None])).sum(1)
        cols.append(torch.where(row >= 0, rank, torch.full_like(rank, MAX_RANK)).clamp(max=MAX_RANK))
    return torch.stack(cols, 1)[eagle.greedy_rows(ex, DEPTH)]


def trees(all_ranks: torch.Tensor) -> list[str]:
    """The best static tree of N = 1..8 drafted nodes (the N most often matched rank paths: a path is
    matched no more often than its prefix, so they form a tree) against the chain of N."""
    counts: Counter[tuple[int, ...]] = Counter()
    for r in all_ranks.tolist():
        for d in range(DEPTH):
            if r[d] >= MAX_RANK:
                break
            counts[tuple(r[:d + 1])] += 1
    freq = {p: c / len(all_ranks) for p, c in counts.items()}
    best = sorted(freq, key=lambda p: (-freq[p], len(p), p))
    lines = []
    for n in range(1, 9):
        chain = 1 + sum(freq.get((0,) * d, 0.0) for d in range(1, n + 1)) if n <= DEPTH else None
        lines.append(f"{n} drafts: tree {1 + sum(freq[p] for p in best[:n]):.3f} tokens a verification "
                     f"{sorted(best[:n])}, chain " + ("-" if chain is None else f"{chain:.3f}"))
    return lines


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
    examples, sure = [], []
    for p, o in zip(prompts, outs):
        full = list(p) + list(o.outputs[0].token_ids)
        e = eagle.example(llm, full)
        a = len(p) - 1  # the row whose next token is the answer's first
        examples.append(eagle.Example(e.feats[a:], e.embeds[a:], e.labels[a:], e.tokens[a:]))
        top = llm.score(full).softmax(-1).max(-1).values  # (T,) the target's top probability at each position
        sure.append(top[a + 1:len(full) + 1 - DEPTH])  # (m,) draft 1 of row t is the token after position t + 1
    for h in heads:
        head = eagle.load_head(h)
        acc = eagle.chain_acceptance(head, examples, lm, 4)
        print(h, "drafts 1..s accepted:", " / ".join(f"{x:.1%}" for x in acc))
        print("  draft 1 by the head's top probability:", confidence(head, examples, lm))
        per = [ranks(head, ex, lm) for ex in examples]
        hit = torch.cat([r[:, 0] == 0 for r in per])
        target = torch.cat([t[eagle.greedy_rows(ex, DEPTH)] for t, ex in zip(sure, examples)])
        print("  draft 1 by the target's top probability:", "; ".join(
            f"[{lo:.1f}, {min(hi, 1.0):.1f}): {sel.float().mean():.0%} of rows, {hit[sel].float().mean():.0%} accepted"
            for lo, hi in zip(TARGET_BUCKETS, TARGET_BUCKETS[1:]) if (sel := (target >= lo) & (target < hi)).any()))
        for line in trees(torch.cat(per)):
            print("  " + line)


if __name__ == "__main__":
    main(sys.argv[1:])
