"""Offline chained acceptance of EAGLE heads on the speculation benchmark's held-out chat prompts: the
target's greedy answers (96 tokens) to spec/prompts.CHAT, then eagle.chain_acceptance over the answer
rows (drafts 1..4 all accepted), for each head given; how the first draft's acceptance follows the
head's confidence (the top probability of its read-out softmax: what --spec-min-draft-prob cuts on)
and the target's own; and the best static draft tree of N nodes (EAGLE-2 / Medusa style) beside the
chain: along the accepted path a tree node computes what chain_forward does, so from the rank of the
target's greedy token at each chained depth a tree's expected tokens a verification are 1 + the sum
over its nodes of how often the node's path of ranks is matched. Also: draft 1's acceptance under
rejection sampling at a temperature (the expected overlap sum_x min(p_T, q_T) of the target's and the
head's distributions), and a hybrid chain that drafts prompt lookup's continuation (spec/ngram) wherever
the context so far has an earlier match of >= 2 tokens and the head's chained token elsewhere.
BENCHMARKS.md, issue #21.

    python scripts/eagle_chat_acceptance.py HEAD [HEAD ...]
"""

from __future__ import annotations

import sys
from collections import Counter

import torch

from lmserve import LLM, SamplingParams
from lmserve.bench.spec import task_prompts
from lmserve.spec import eagle
from lmserve.spec.ngram import ngram_lookup

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


@torch.no_grad()
def sampled(head: eagle.EagleHead, examples: list[eagle.Example], lm: torch.Tensor,
            temperatures: tuple[float, ...]) -> list[float]:
    """Draft 1's acceptance probability under rejection sampling at each temperature, averaged over the
    rows: sum_x min(p_T(x), q_T(x)), p the target's distribution at the drafted position, q the head's."""
    vocab = head.draft_vocab
    totals, rows = [0.0] * len(temperatures), 0
    for ex in examples:
        pred = eagle.chain_forward(head, ex.feats, ex.embeds, 1)[0]  # (T - 1, H): features of positions 1..
        head_logits = pred @ (lm if vocab is None else lm[vocab]).T  # (T - 1, V')
        target_logits = ex.feats[1:] @ lm.T  # (T - 1, V)
        for i, temperature in enumerate(temperatures):
            q = torch.zeros_like(target_logits)
            q[:, slice(None) if vocab is None else vocab] = torch.softmax(head_logits / temperature, -1)
            p = torch.softmax(target_logits / temperature, -1)
            totals[i] += float(torch.minimum(p, q).sum())
        rows += pred.shape[0]
    return [t / max(1, rows) for t in totals]


@torch.no_grad()
def hybrid(head: eagle.EagleHead, examples: list[eagle.Example], contexts: list[list[int]], lm: torch.Tensor,
           min_match: int = 2) -> tuple[list[float], list[float], str]:
    """Chained greedy acceptance (drafts 1..DEPTH, over eagle.greedy_rows) of (a) prompt lookup alone
    and (b) prompt lookup's token wherever the context up to the drafted position has an earlier match
    of >= min_match tokens, the head's chained token elsewhere. contexts[i]: the prompt's ids before
    examples[i]'s first row (row t's context is contexts[i] + tokens[:t + 2]). Also a line on draft 1:
    how often each is right, either is, and prompt lookup where it matches >= min_match tokens."""
    vocab = head.draft_vocab
    out = lm if vocab is None else lm[vocab]
    hits = {"ngram": [0] * DEPTH, "hybrid": [0] * DEPTH}
    rows, first = 0, Counter()
    for ctx0, ex in zip(contexts, examples):
        preds = eagle.chain_forward(head, ex.feats, ex.embeds, DEPTH)
        m = ex.feats.shape[0] - DEPTH
        heads = [(pr[:m] @ out.T).argmax(-1) for pr in preds]  # DEPTH x (m,)
        heads = [h if vocab is None else vocab[h] for h in heads]
        full = ctx0 + ex.tokens.tolist()
        for t in torch.nonzero(eagle.greedy_rows(ex, DEPTH)).flatten().tolist():
            rows += 1
            alive = {"ngram": True, "hybrid": True}
            for s in range(1, DEPTH + 1):  # draft s: the token after position t + s
                ctx = full[:len(ctx0) + t + s + 1]
                lookup = ngram_lookup(ctx, 1, 1, 3)
                strong = ngram_lookup(ctx, 1, min_match, 3)
                label = int(ex.labels[t + s])
                if s == 1:
                    by_head, by_lookup = int(heads[0][t]) == label, bool(lookup) and lookup[0] == label
                    first.update({"head": by_head, "lookup": by_lookup, "either": by_head or by_lookup,
                                  "strong": bool(strong), "strong right": bool(strong) and strong[0] == label})
                alive["ngram"] &= bool(lookup) and lookup[0] == label
                alive["hybrid"] &= (strong[0] if strong else int(heads[s - 1][t])) == label
                for k in hits:
                    hits[k][s - 1] += alive[k]
    line = (f"draft 1 right: the head {first['head'] / max(1, rows):.1%}, prompt lookup "
            f"{first['lookup'] / max(1, rows):.1%}, either {first['either'] / max(1, rows):.1%}; prompt lookup "
            f"matches >= {min_match} tokens on {first['strong'] / max(1, rows):.1%} of rows, right on "
            f"{first['strong right'] / max(1, first['strong']):.1%} of them")
    return [h / max(1, rows) for h in hits["ngram"]], [h / max(1, rows) for h in hits["hybrid"]], line


def main(heads: list[str]) -> None:
    llm = LLM()
    prompts = task_prompts(llm.tokenizer, 16, "chat")
    outs = llm.generate(prompts, SamplingParams(max_tokens=96, temperature=0), use_tqdm=False)
    lm = eagle.float_head(llm.engine.model)
    examples, sure, contexts = [], [], []
    for p, o in zip(prompts, outs):
        full = list(p) + list(o.outputs[0].token_ids)
        e = eagle.example(llm, full)
        a = len(p) - 1  # the row whose next token is the answer's first
        contexts.append(list(p[:a]))
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
        temperatures = (0.3, 0.7, 1.0)
        print("  draft 1 accepted by rejection sampling:", ", ".join(
            f"T = {t}: {a:.1%}" for t, a in zip(temperatures, sampled(head, examples, lm, temperatures))))
        ngram, mixed, line = hybrid(head, examples, contexts, lm)
        print("  " + line)
        for name, acc in (("prompt lookup alone", ngram),
                          ("prompt lookup where it matches >= 2 tokens, else the head", mixed)):
            print(f"  {name}: drafts 1..s accepted " + " / ".join(f"{x:.1%}" for x in acc) + "; tokens a verification "
                  "by k: " + " ".join(f"{1 + sum(acc[:k]):.3f}" for k in range(1, DEPTH + 1)))


if __name__ == "__main__":
    main(sys.argv[1:])
