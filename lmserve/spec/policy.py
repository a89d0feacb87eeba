"""The speculation policy: which decoding sequences draft, how many tokens, and what was accepted.

Owns each sequence's `spec` state (this step's drafts, the running acceptance, the pause) and the
cumulative counters. Per step, around the scheduler and the runner:
  propose(running)          drafts appended to the token lists of the sequences that speculate
  trim(out)                 drafts the scheduler could not fit (or of preempted sequences) dropped
  settle(out, rejected)     after verification: drafts leave the token lists, acceptance recorded
"""

from __future__ import annotations

import torch

from lmserve.config import EngineConfig
from lmserve.scheduler import SchedulerOutput
from lmserve.sequence import Sequence, Status
from lmserve.spec import Proposer, SpecStats

PAUSE_STEPS = 16  # steps without drafts after a request's acceptance falls below the floor


class SpecPolicy:
    """The dynamic rule around a proposer: k drafts, or 0 when the batch is large (decode is no
    longer memory-bound, so verification costs real compute) or this request's drafts have mostly
    been rejected (then it pauses for a while and probes again)."""

    def __init__(self, proposer: Proposer, config: EngineConfig, max_model_len: int) -> None:
        self.proposer = proposer
        self.config = config
        self.max_model_len = max_model_len
        self.stats = SpecStats()
        self._drafted: list[Sequence] = []

    def _num_drafts(self, seq: Sequence, batch: int) -> int:
        c, st = self.config, seq.spec
        p = seq.params
        if not p.speculative or p.use_beam_search or seq.family.forks_pending or batch > c.spec_max_batch:
            return 0
        if st.pause > 0:
            st.pause -= 1
            return 0
        if st.acceptance < c.spec_min_acceptance:
            st.pause, st.acceptance = PAUSE_STEPS, c.spec_min_acceptance  # pause, then probe again
            return 0
        room = min(p.max_tokens - seq.num_output_tokens - 1, self.max_model_len - seq.num_tokens - 1)
        return max(0, min(c.num_speculative_tokens, room))

    def propose(self, running: list[Sequence]) -> None:
        """Append drafts to the decoding sequences that speculate this step."""
        seqs = [s for s in running if s.num_tokens - s.num_computed_tokens == 1]
        ks = [self._num_drafts(s, len(running)) for s in seqs]
        self._drafted = []
        if not any(ks):
            return
        for seq, prop in zip(seqs, self.proposer.propose(seqs, ks)):
            if prop.tokens:
                seq.token_ids.extend(prop.tokens)
                seq.spec.num_draft, seq.spec.draft_probs = len(prop.tokens), prop.probs
                self._drafted.append(seq)

    def trim(self, out: SchedulerOutput) -> None:
        """Drop the drafts the scheduler could not fit (or of preempted sequences) before the forward."""
        got = dict(out.scheduled)
        for seq in self._drafted:
            st = seq.spec
            keep = max(0, got.get(seq, 0) - 1) if seq.status is Status.RUNNING else 0
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
        for seq, _ in out.scheduled:
            st = seq.spec
            if not st.num_draft:
                continue
            k = st.num_draft
            accepted = k - rejected.get(seq, 0)
            del seq.token_ids[len(seq.token_ids) - k:]
            st.num_draft, st.draft_probs = 0, None
            self.stats.record(k, accepted)
            st.acceptance = 0.7 * st.acceptance + 0.3 * (accepted / k)
        self._drafted = []

    def release(self, seq: Sequence) -> None:
        self.proposer.release(seq)
