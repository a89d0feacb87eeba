"""Prompt-lookup / n-gram proposer: continue with what followed the last earlier occurrence of the
sequence's final n tokens (largest n first). A continuation that runs into the end of the sequence
goes on copying from the tokens it has just drafted (an overlapping, LZ77-style copy), so a text
repeating with period p drafts the full k tokens, not at most p. No model, no state."""

from __future__ import annotations

from lmserve.sequence import Sequence
from lmserve.spec import Proposal


def ngram_lookup(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """k tokens continuing the most recent earlier match of the last n tokens ([] without a match).

    draft[j] = ext[start + n + j], where ext = tokens + the drafts so far: start + n < L, so the
    copy always has a source, reading the drafts themselves once it passes the end of `tokens`."""
    L = len(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        tail = tokens[L - n:]
        first = tail[0]
        for start in range(L - n - 1, -1, -1):
            if tokens[start] == first and tokens[start:start + n] == tail:
                draft = tokens[start + n:start + n + k]
                for j in range(len(draft), k):  # past the end: copy the draft's own earlier tokens
                    draft.append(draft[start + n + j - L])
                return draft
    return []


class NgramProposer:
    """Point-mass drafts from the sequence itself."""

    def __init__(self, min_n: int = 1, max_n: int = 3) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram sizes: need 1 <= min ({min_n}) <= max ({max_n})")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        return [Proposal(ngram_lookup(s.token_ids, k, self.min_n, self.max_n) if k > 0 else []) for s, k in zip(seqs, ks)]

    def release(self, seq: Sequence) -> None:
        return None
