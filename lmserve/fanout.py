"""Fan-out: requests that become several sequences (n / best_of samples, beam search).

Owns each sequence's `family` state and the beam states. A request with n (or best_of) > 1 starts as
one sequence; once its prompt is computed up to the last token, `fork` gives n - 1 children every
block by reference, and each then runs the last prompt token itself into a copy-on-write block.
Beam search clones beams the same way each step, from the log-probs the runner hands over.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from lmserve.kv.block_manager import BlockManager
from lmserve.sampling.beam import BeamState
from lmserve.scheduler import Scheduler, SchedulerOutput
from lmserve.sequence import Sequence, Status

log = logging.getLogger("lmserve")

class FanOut:
    """Creates, forks and clones the sequences of multi-sequence requests and runs the beam step."""

    def __init__(self, scheduler: Scheduler, block_manager: BlockManager,
                 init_seq: Callable[[Sequence], None], fail: Callable[[Sequence, str], None]) -> None:
        self.scheduler = scheduler
        self.bm = block_manager
        self.init_seq = init_seq  # gives a new sequence its generator and output state
        self.fail = fail  # ends a sequence with an error (OutputProcessor.fail)
        self.beams: dict[str, BeamState] = {}  # beam-search requests: their search state
        self._forking: list[Sequence] = []  # parents with children still to fork

    def start(self, seq: Sequence, family: list[Sequence]) -> None:
        """A new request's first sequence: set up its beam search, or its n / best_of children
        (forked later, or made now when a one-token prompt leaves nothing to share)."""
        p = seq.params
        if p.use_beam_search:
            ends = tuple(p.stop_token_ids) + (() if p.ignore_eos else seq.eos_token_ids)
            self.beams[seq.request_id] = BeamState(p.beam_width, p.max_tokens, ends, p.length_penalty,
                                                   p.early_stopping)
        elif p.num_samples > 1 and seq.num_prompt_tokens == 1:
            for i in range(1, p.num_samples):
                child = self._new_child(seq, i)
                family.append(child)
                self.scheduler.add(child)
        elif p.num_samples > 1:
            seq.family.forks_pending = p.num_samples - 1
            self._forking.append(seq)

    def after_step(self, out: SchedulerOutput, beam_logprobs: dict[Sequence, torch.Tensor],
                   requests: dict[str, list[Sequence]]) -> None:
        """Fork the parents that reached their fork point and step the beam searches whose beams
        all have their next-token log-probs. A preempted beam's log-probs are dropped: it recomputes
        them after readmission."""
        for seq in out.preempted:
            seq.family.pending_logprobs = None
        for seq, lp in beam_logprobs.items():
            seq.family.pending_logprobs = lp
        for seq in self._forking:
            if seq.num_computed_tokens == seq.num_prompt_tokens - 1 and not seq.is_finished:
                self._fork(seq, requests[seq.request_id])
        self._forking = [s for s in self._forking if s.family.forks_pending and not s.is_finished]
        for rid in {s.request_id for s in beam_logprobs}:
            if rid in requests:
                try:
                    self._beam_step(rid, requests[rid])
                except Exception as e:  # noqa: BLE001 - a search that cannot go on ends alone, with its error
                    log.exception("beam step failed for %s", rid)
                    for s in requests[rid]:
                        if not s.is_finished:
                            self.fail(s, f"{type(e).__name__}: {e}")

    @staticmethod
    def failing(seqs: list[Sequence], requests: dict[str, list[Sequence]]) -> list[Sequence]:
        """What a failed step of `seqs` ends: those, and every unfinished beam of a beam search among
        them (a beam advances only with all its beams; one left would wait forever). n / best_of
        children stand alone."""
        beams = {s.request_id for s in seqs if s.params.use_beam_search}
        return list(dict.fromkeys(seqs + [s for r in beams for s in requests.get(r, []) if not s.is_finished]))

    def forget(self, request_id: str) -> None:
        self.beams.pop(request_id, None)
        self._forking = [s for s in self._forking if s.request_id != request_id]  # an aborted parent goes now

    def _new_child(self, parent: Sequence, index: int) -> Sequence:
        child = Sequence(parent.request_id, parent.prompt_token_ids, parent.params, prompt=parent.prompt,
                         eos_token_ids=parent.eos_token_ids, arrival_time=parent.arrival_time, index=index,
                         compiled_grammar=parent.compiled_grammar, priority=parent.priority, lora=parent.lora,
                         pooling=parent.pooling, salt=parent.salt)
        self.init_seq(child)
        return child

    def _fork(self, parent: Sequence, family: list[Sequence]) -> None:
        """Parent has computed all but its last prompt token: children take its blocks by reference.

        Each child then runs the last prompt token itself, writing into the shared last block, which
        the scheduler copies for it first (copy-on-write), and samples its own first token.
        """
        after = parent
        for i in range(1, parent.family.forks_pending + 1):
            after = self._clone(parent, i, after, family)
        parent.family.forks_pending = 0

    def _clone(self, parent: Sequence, index: int, after: Sequence, family: list[Sequence]) -> Sequence:
        """A running copy of `parent` holding its blocks by reference (copy-on-write later)."""
        child = self._new_child(parent, index)
        child.token_ids = list(parent.token_ids)
        child.block_tables = self.bm.fork(parent.block_tables)
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child.first_scheduled_time = parent.first_scheduled_time
        child.first_token_time, child.last_token_time = parent.first_token_time, parent.last_token_time
        child.family.beam_score = parent.family.beam_score
        family.append(child)
        self.scheduler.add_running(child, after=after)
        return child

    def _beam_step(self, rid: str, family: list[Sequence]) -> None:
        """Advance a beam search once every running beam has its next-token log-probs."""
        st = self.beams[rid]
        seqs = [s for s in family if not s.is_finished]
        if any(s.family.pending_logprobs is None or s.status is not Status.RUNNING for s in seqs):
            return  # a beam was preempted (with its family) or not scheduled yet: wait for it
        lp = torch.stack([s.family.pending_logprobs for s in seqs])  # (B, V)
        for s in seqs:
            s.family.pending_logprobs = None
        nxt = st.step([s.output_token_ids for s in seqs], [s.family.beam_score for s in seqs], lp)
        now = time.time()
        stats = self.scheduler.stats
        if all(s.first_token_time is None for s in seqs):  # the search's first step: its prompt is processed
            stats.prompt_tokens += seqs[0].num_prompt_tokens
        stats.generation_tokens += len(seqs)  # a token a running beam, as each beam row is one step of decoding
        for s in seqs:  # this step's tokens exist now, in the beams or (a search ending here) the hypotheses
            if s.first_token_time is None:
                s.first_token_time = now
            if s.last_token_time is not None:
                stats.inter_token_latency.observe(now - s.last_token_time)
            s.last_token_time = now
        used: set[int] = set()
        plan = []
        for b, tok, score in nxt:  # fork first: a clone copies its parent before the parent moves on
            parent = seqs[b]
            child = parent if b not in used else self._clone(parent, len(family), parent, family)
            used.add(b)
            plan.append((child, tok, score))
        for child, tok, score in plan:
            child.append_token(tok)
            child.family.beam_score = score
        for b, s in enumerate(seqs):
            if b not in used or st.done:
                self.scheduler.finish(s, "length")  # pruned, or the search is over: blocks freed now
        if not st.done:  # pruned beams leave the request (their tokens live on in the search's hypotheses):
            family[:] = [s for s in family if not s.is_finished]  # it holds its width, not every beam it had
