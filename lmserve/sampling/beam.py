"""Beam search bookkeeping, with the same rules as HF transformers' `generate(num_beams=W, do_sample=False)`.

Each step, every running beam's log-softmax is added to its score; the best 2W (beam, token)
continuations are taken; among them, those that end (EOS, or the length limit) and rank in the top W
become finished hypotheses scored sum_logprob / generated_len ** length_penalty (the best W kept);
the best W that do not end become the next running beams. The search stops when no running beam can
beat the worst finished hypothesis (HF's heuristic for early_stopping=False), when all W finished
slots are full and early_stopping is True, or when every continuation ends.

This class only decides; the engine turns "beam b continues with token t" into sequences: the first
continuation of a beam reuses its Sequence, further ones fork it (blocks shared by reference, the
last block copied on write), and beams with no continuation are freed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Hypothesis:
    tokens: list[int]  # generated tokens, including the EOS that ended it, if any
    score: float  # length-normalised: what ranks it
    ended_by_eos: bool
    logprob: float = 0.0  # the sum of its tokens' log-probabilities (its cumulative_logprob, as vLLM reports it)


@dataclass
class BeamState:
    width: int
    max_tokens: int
    eos_ids: tuple[int, ...]
    length_penalty: float = 1.0
    early_stopping: bool = False
    cur_len: int = 0  # tokens generated so far by every running beam
    finished: list[Hypothesis] = field(default_factory=list)
    improvable: bool = True
    done: bool = False

    def step(self, outputs: list[list[int]], scores: list[float], logprobs: torch.Tensor
             ) -> list[tuple[int, int, float]]:
        """One beam step. outputs[b]: beam b's generated tokens; scores[b]: its running score;
        logprobs: (B, V) log-softmax of each running beam's next-token logits.
        Returns the next running beams as (parent beam index, token, new score), best first."""
        W = self.width
        B, V = logprobs.shape
        acc = (logprobs.float() + torch.tensor(scores, dtype=torch.float32).unsqueeze(1)).reshape(-1)  # (B*V,)
        k = min(max(2, 1 + len(self.eos_ids)) * W, acc.numel())
        top_scores, top_idx = torch.topk(acc, k)
        cands = [(int(i) // V, int(i) % V, float(s)) for s, i in zip(top_scores, top_idx)]
        ends = [(t in self.eos_ids) or (self.cur_len + 1 >= self.max_tokens) for _, t, _ in cands]

        running = [c for c, e in zip(cands, ends) if not e][:W]

        new: list[Hypothesis] = []
        full = len(self.finished) >= W
        if self.improvable and not (full and self.early_stopping):
            for r, ((b, t, s), e) in enumerate(zip(cands, ends)):
                if r < W and e:
                    norm = s / ((self.cur_len + 1) ** self.length_penalty)
                    new.append(Hypothesis(outputs[b] + [t], norm, t in self.eos_ids, s))
        merged = self.finished + new
        order = sorted(range(len(merged)), key=lambda i: (-merged[i].score, i))  # stable: earlier first on ties
        self.finished = [merged[i] for i in order[:W]]

        self.cur_len += 1
        if running and len(self.finished) >= W:
            best_possible = running[0][2] / (self.cur_len ** self.length_penalty)
            self.improvable = self.improvable and best_possible > min(h.score for h in self.finished)
        all_finished_full = len(self.finished) >= W
        self.done = (not self.improvable) or (all_finished_full and self.early_stopping) or all(ends) \
            or not running
        return [] if self.done else running

    def best(self, n: int) -> list[Hypothesis]:
        return self.finished[:n]
