"""The speculation policy: which decoding sequences draft, how many tokens, and what was accepted.

Owns each sequence's `spec` state (this step's drafts, the running acceptance, the pause) and the
cumulative counters. Per step, around the scheduler and the runner:
  propose(running)          drafts appended to the token lists of the sequences that speculate (a
                            proposer that raises costs the step its drafts, never the engine)
  trim(out)                 drafts the scheduler could not fit (or of preempted sequences) dropped
  settle(out, rejected)     after verification: drafts leave the token lists, acceptance recorded
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

import torch

from lmserve.config import EngineConfig
from lmserve.scheduler import SchedulerOutput
from lmserve.sequence import Sequence, Status
from lmserve.spec import Proposer, SpecStats
from lmserve.spec.goodput import DECAY, PRIOR, PROBE, StepCosts, best_k
from lmserve.utils import EngineFatalError

log = logging.getLogger("lmserve")

PAUSE_STEPS = 16  # steps without drafts after a request's acceptance falls below the floor


class SpecPolicy:
    """The dynamic rule around a proposer: k drafts, or 0 when the batch is large (decode is no
    longer memory-bound, so verification costs real compute) or this request's drafts have mostly
    been rejected (then it pauses for a while and probes again). With spec_policy="goodput" the k
    (and which of those requests draft) is chosen each step from measured costs (spec/goodput.py)."""

    def __init__(self, proposer: Proposer, config: EngineConfig, max_model_len: int,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.proposer = proposer
        self.config = config
        # no draft lands past the engine's context, nor past a draft model's own (its max_position_embeddings)
        self.max_len = min(max_model_len, getattr(proposer, "max_len", max_model_len))
        self.stats = SpecStats()
        self._drafted: list[Sequence] = []
        self.goodput = config.spec_policy == "goodput"
        self.clock = clock
        self.costs = StepCosts()
        self.alpha = (1.0, 1.0)  # the batch's (accepted, tested) drafts, exponential averages
        self._since = 0.0  # clock when drafting ended
        self._timed: tuple[int, list[Sequence]] | None = None  # the last step's rows and sequences, if decode-only
        self._plain = 0  # goodput: steps in a row that drafted nothing

    def _num_drafts(self, seq: Sequence, batch: int) -> int:
        c, st = self.config, seq.spec
        p = seq.params
        if not p.speculative or p.use_beam_search or seq.family.forks_pending or batch > c.spec_max_batch:
            return 0
        if c.deterministic and p.seed is not None and p.temperature > 0:  # its draws would follow the drafts,
            return 0  # which follow the batch (spec_max_batch, the token budget): it decodes plainly
        if st.pause > 0:
            st.pause -= 1
            return 0
        if st.acceptance < c.spec_min_acceptance:
            st.pause, st.acceptance = PAUSE_STEPS, c.spec_min_acceptance  # pause, then probe again
            return 0
        room = min(p.max_tokens - seq.num_output_tokens - 1, self.max_len - seq.num_tokens - 1)
        return max(0, min(c.num_speculative_tokens, room))

    def _acceptance(self, seq: Sequence) -> float:
        """The request's acceptance per drafted token, its counts averaged with PRIOR of the batch's."""
        st, (hits, tries) = seq.spec, self.alpha
        return (st.hits + PRIOR * hits / tries) / (st.tries + PRIOR)

    def _choose(self, seqs: list[Sequence], ks: list[int]) -> list[int]:
        """goodput: the measured best k for this batch, drafted by the requests it picks (a cap on ks)."""
        able = [i for i, k in enumerate(ks) if k]
        if not able:
            return ks
        alphas = {i: self._acceptance(seqs[i]) for i in able}
        k, n = best_k(len(seqs), list(alphas.values()), max(ks), self.costs)
        if k == 0 and self._plain >= PROBE:  # look again at what drafting costs and yields, at the least loss
            k, n = best_k(len(seqs), list(alphas.values()), max(ks), self.costs, drafting=True)
        chosen = set(sorted(able, key=lambda i: -alphas[i])[:n])  # the n most accepting (best_k's ranking)
        return [min(kk, k) if i in chosen else 0 for i, kk in enumerate(ks)]

    def propose(self, running: list[Sequence]) -> None:
        """Append drafts to the decoding sequences that speculate this step."""
        if self._timed is not None:  # goodput: the last step, from its drafting's end to now (outputs included)
            rows, last = self._timed
            if set(last) <= set(running):  # none finished: no wait for new work can lie in between
                self.costs.record_step(rows, self.clock() - self._since)
            self._timed = None
        seqs = [s for s in running if s.num_tokens - s.num_computed_tokens == 1]  # one-row steps
        # a prompt whose last token alone is left (the rest cached) drafts nothing, as with nothing cached
        # (a seeded sequence's draws must not depend on the cache); it is still a row of the step
        ks = [self._num_drafts(s, len(running)) if s.num_computed_tokens >= s.num_prompt_tokens else 0
              for s in seqs]
        if self.goodput:
            ks = self._choose(seqs, ks)
            self._plain = 0 if any(ks) else self._plain + 1
        self._drafted = []
        try:
            # work deferred from earlier steps (EAGLE's backlog): the plain steps' share, timed in neither table
            flush = getattr(self.proposer, "flush", None)
            if any(ks) and flush is not None:
                flush()
            start = self.clock()  # drafting alone is timed
            if any(ks):
                for seq, prop in zip(seqs, self.proposer.propose(seqs, ks)):
                    if prop.tokens:
                        seq.token_ids.extend(prop.tokens)
                        seq.spec.num_draft, seq.spec.draft_probs = len(prop.tokens), prop.probs
                        self._drafted.append(seq)
        except EngineFatalError:
            raise
        except Exception:  # noqa: BLE001 - drafting is an optimization: a failure costs the step its drafts
            log.exception("drafting failed; this step runs without speculation")
            self.discard()
            return
        self._since = self.clock()
        if self._drafted:
            self.costs.record_draft(sum(1 for k in ks if k), max(ks), self._since - start)

    def trim(self, out: SchedulerOutput) -> None:
        """Drop the drafts the scheduler could not fit (or of preempted sequences) before the forward."""
        got = dict(out.scheduled)
        for seq in self._drafted:
            self._cut(seq, max(0, got.get(seq, 0) - 1) if seq.status is Status.RUNNING else 0)

    def discard(self) -> None:
        """A failed step: its drafts leave the token lists unverified, nothing recorded."""
        for seq in self._drafted:
            self._cut(seq)
        self._drafted, self._timed = [], None

    @staticmethod
    def _cut(seq: Sequence, keep: int = 0) -> None:
        """Keep the first `keep` of seq's drafts on its token list, drop the rest."""
        st = seq.spec
        if keep < st.num_draft:
            del seq.token_ids[len(seq.token_ids) - (st.num_draft - keep):]
            st.num_draft = keep
            st.draft_probs = None if not keep or st.draft_probs is None else st.draft_probs[:keep]

    def settle(self, out: SchedulerOutput, rejected: dict[Sequence, int], hidden: torch.Tensor | None = None) -> None:
        """After verification: a proposer that reads the target's hidden states (N, hidden) sees them,
        every draft leaves its token list (the accepted ones come back as sampled tokens), and the
        acceptance of each verification is recorded."""
        observe = getattr(self.proposer, "observe", None)
        if observe is not None and hidden is not None:
            observe(out, hidden, rejected)
        timed = self.goodput and all(n == 1 + seq.spec.num_draft == seq.num_tokens - seq.num_computed_tokens
                                     for seq, n in out.scheduled)  # decode-only: a step of known rows
        rows = sum(n for _, n in out.scheduled)
        for seq, _ in out.scheduled:
            st = seq.spec
            if not st.num_draft:
                continue
            k = st.num_draft
            accepted = k - rejected.get(seq, 0)
            self._cut(seq)
            self.stats.record(k, accepted)
            st.acceptance = 0.7 * st.acceptance + 0.3 * (accepted / k)
            tested = accepted + (accepted < k)  # the accepted drafts and the first rejected one
            st.hits, st.tries = DECAY * st.hits + accepted, DECAY * st.tries + tested
            self.alpha = (DECAY * self.alpha[0] + accepted, DECAY * self.alpha[1] + tested)
        self._timed = (rows, [seq for seq, _ in out.scheduled]) if timed else None  # timed at the next step
        self._drafted = []

    def release(self, seqs: Iterable[Sequence]) -> None:
        """The proposer's state of those of `seqs` that ended goes now: a finished n-child's or a
        pruned beam's as soon as it ends, not with its whole request."""
        for seq in seqs:
            if seq.is_finished:
                self.proposer.release(seq)
