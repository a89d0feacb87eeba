"""How many tokens to draft this step, from what speculation is measured to cost and to yield here
(`spec_policy="goodput"`; SmartSpec, Liu et al. 2024, chooses k the same way for a batch).

Whether speculation pays depends on three numbers (issue #21): how often drafts are accepted, what a
verification of k + 1 rows costs against a one-row step, and what drafting costs. All three differ
between machines (an AVX2 CPU's verification of 3 rows costs ~1.2x a step, a GPU's ~1.0x), batch
sizes and texts, so they are measured while serving, not assumed:

    rows(k)   = B + k * S                     B decoding sequences, S of them drafting
    tokens(k) = (B - S) + sum_i E(alpha_i, k)  E(a, k) = 1 + a + ... + a^k: a chain's expected yield
    time(k)   = step(rows(k)) + k * draft(S)   measured: a decode step of that many rows, a drafting round
    k*, S*    = argmax tokens(k) / time(k)     k in 0..num_speculative_tokens, the same for the batch;
                                               the S drafting are the requests most often accepted

step(rows): the engine's time for a decode-only step, from its drafting's end to the next step's start
(scheduling, the forward and verification, the outputs: all a step costs; a step with a prefill chunk
of more than one token, or after which a request finished, is not recorded), an exponential average per row count, linear
between measured row counts. A row count never measured is taken to cost what the nearest smaller one
did (optimistic: a k not yet tried looks as cheap as the largest tried, so it is tried once and then
known). alpha_i:
each request's acceptance per drafted token (the drafts a verification tested: accepted ones and the
first rejected), averaged with a prior of the batch's own. Every PROBE-th step that chose k = 0 drafts
its best drafting choice anyway (the k >= 1 and S with the most tokens a second: at a large batch
typically one request drafting one token, a step barely dearer than a plain one), so acceptance and
costs that change are seen again.
"""

from __future__ import annotations

PROBE = 32  # steps: after this many plain steps in a row, one with drafts
DECAY = 0.8  # weight of the history in the averages (times, a request's acceptance counts)
PRIOR = 2.0  # drafts' worth of the batch's acceptance in a request's estimate


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a verification yields from a chain of k drafts each accepted with probability alpha
    (given the ones before): 1 + alpha + ... + alpha^k."""
    return sum(alpha ** i for i in range(k + 1))


class StepCosts:
    """Measured seconds: a decode-only step by its rows, a drafting round by its drafting sequences."""

    def __init__(self) -> None:
        self.step: dict[int, float] = {}  # rows -> seconds (exponential average)
        self.draft: dict[int, float] = {}  # drafting sequences -> seconds a round

    @staticmethod
    def _add(table: dict[int, float], key: int, seconds: float) -> None:
        old = table.get(key)
        table[key] = seconds if old is None else DECAY * old + (1 - DECAY) * seconds

    def record_step(self, rows: int, seconds: float) -> None:
        self._add(self.step, rows, seconds)

    def record_draft(self, seqs: int, rounds: int, seconds: float) -> None:
        if rounds > 0:
            self._add(self.draft, seqs, seconds / rounds)

    def step_time(self, rows: int) -> float | None:
        """A decode step of `rows` rows: measured, else linear between the nearest measured row counts
        below and above, else the nearest below's (above every measured: optimistic), else None."""
        t = self.step
        if rows in t:
            return t[rows]
        lo = max((r for r in t if r < rows), default=None)
        hi = min((r for r in t if r > rows), default=None)
        if lo is None:
            return None
        if hi is None:
            return t[lo]
        return t[lo] + (t[hi] - t[lo]) * (rows - lo) / (hi - lo)

    def draft_time(self, seqs: int) -> float:
        """A drafting round for `seqs` sequences: measured, else the nearest measured count's, else 0."""
        if not self.draft:
            return 0.0
        return self.draft[min(self.draft, key=lambda s: (abs(s - seqs), s))]


def best_k(batch: int, alphas: list[float], max_k: int, costs: StepCosts, drafting: bool = False
           ) -> tuple[int, int]:
    """(k, S): the S most accepting of the sequences that may draft (acceptance per draft `alphas`)
    draft k tokens each, the S and k (0..max_k) with the most tokens a second for a step of `batch`
    decoding sequences; drafting: the best with k >= 1 (a probe's). (0, 0) while the plain step is not
    yet measured (measure it first)."""
    base = costs.step_time(batch)
    if base is None or not alphas:
        return 0, 0
    ranked = sorted(alphas, reverse=True)
    best, best_rate = (0, 0), 0.0 if drafting else batch / base
    for k in range(1, max_k + 1):
        tokens = float(batch)
        for s, a in enumerate(ranked, 1):  # the s most accepting draft
            tokens += expected_tokens(a, k) - 1
            step = costs.step_time(batch + k * s)
            time = (step if step is not None else base) + k * costs.draft_time(s)
            if tokens / time > best_rate:
                best, best_rate = (k, s), tokens / time
    return best
