"""Iteration-level scheduling: every step, how many tokens each request processes.

One decision covers every case: a decode is 1 new token, a prefill chunk is up to the token budget, a
resumed (preempted) request recomputes or swaps back what it had. Decodes go first, then unfinished
prefills, then new admissions, so a long prompt is chunked and never stalls a decode. Out of blocks,
the most recently admitted request is preempted (never the engine). The scheduler owns the waiting
queue and the running list; the block manager owns block state.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from collections import deque
from dataclasses import dataclass, field

from lmserve.kv.block_manager import BlockManager
from lmserve.kv.offload import OffloadTier
from lmserve.sequence import Sequence, Status
from lmserve.stats import SchedulerStats


@dataclass
class SchedulerOutput:
    """What to run this step: each scheduled sequence with its number of new tokens, in batch order."""

    scheduled: list[tuple[Sequence, int]]
    preempted: list[Sequence] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write, before the forward
    # preemption by swapping (kv/swap.py), done before the copies: (sequence, its blocks) out to the
    # host, then in to fresh blocks; host copies of sequences that ended while swapped out, dropped
    swap_out: list[tuple[Sequence, list[int]]] = field(default_factory=list)
    swap_in: list[tuple[Sequence, list[int]]] = field(default_factory=list)
    swap_dropped: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Token-budget scheduler with chunked prefill, prefix-cache admission and preemption."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 swap_blocks: int = 0, swap_pays: Callable[[Sequence, int], bool] | None = None,
                 offload: OffloadTier | None = None) -> None:
        self.bm = block_manager
        self.offload = offload  # the prefix cache's second tier: admission extends a pool hit from it
        # preemption by swapping: host space in blocks, and whether a victim with that many blocks swaps
        self.swap_free, self.swap_pays = swap_blocks, swap_pays
        self._swap_out: list[tuple[Sequence, list[int]]] = []
        self._swap_in: list[tuple[Sequence, list[int]]] = []
        self._swap_dropped: list[Sequence] = []
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the tail (of the worst priority) is preempted first
        self.last_batch, self.stats = (0, 0), SchedulerStats()  # (prefill, decode) tokens of the last step
        # copy-on-write sources by their copier, held until the step's copies run: a holder preempted later
        # in schedule() must not free one to be another copy's target (a preempted copier's copies go)
        self._pinned: dict[Sequence, list[int]] = {}

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence: after every waiting one of its priority or better (lower)."""
        seq.status = Status.WAITING
        self._queue(seq, ahead_of_equals=False)

    def _queue(self, seq: Sequence, ahead_of_equals: bool) -> None:
        """Insert seq into the waiting queue, kept in priority order (stable: first come, first served
        within a priority): behind its equals, or ahead of them (a preempted or deferred sequence, whose
        request came first)."""
        w = self.waiting
        if not w or (w[-1].priority <= seq.priority and not ahead_of_equals):
            w.append(seq)  # the common case: one priority, a new request
            return
        for i, other in enumerate(w):
            if other.priority > seq.priority or (ahead_of_equals and other.priority == seq.priority):
                w.insert(i, seq)
                return
        w.append(seq)

    def expired(self, arrived_before: float) -> list[Sequence]:
        """Waiting sequences never scheduled that arrived before the given time (max_waiting_time)."""
        return [s for s in self.waiting if s.first_scheduled_time is None and s.arrival_time < arrived_before]

    def _victim(self) -> Sequence:
        """The running sequence to preempt first: the worst priority (highest), the latest admitted."""
        return max(reversed(self.running), key=lambda s: s.priority)

    # ---------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: dict[Sequence, int] = {}
        copies: dict[Sequence, list[tuple[int, int]]] = {}  # copy-on-write pairs, by the sequence they serve
        preempted: list[Sequence] = []

        todo = {s: self._tokens_to_compute(s) for s in self.running}
        decoding = [s for s, n in todo.items() if n == 1 + s.spec.num_draft]  # drafts too: a decode goes first
        prefilling = [s for s, n in todo.items() if n != 1 + s.spec.num_draft]
        for seq in decoding + prefilling:
            if budget == 0:
                break
            if seq.status is not Status.RUNNING or todo[seq] == 0:
                continue  # preempted earlier in this loop; or a beam with its log-probs, waiting for its siblings
            n = min(todo[seq], budget)
            while (cow := self.bm.reserve(seq.block_tables, seq.num_computed_tokens,
                                          seq.num_computed_tokens + n)) is None:
                for victim in reversed(self._family(self._victim(), self.running)):  # tail first
                    budget += scheduled.pop(victim, 0)
                    pending = copies.pop(victim, None)  # its copy targets were just freed
                    self.bm.unpin(self._pinned.pop(victim, []))
                    self._preempt(victim, dict((dst, src) for src, dst in pending or ()))
                    preempted.append(victim)
                if seq.status is not Status.RUNNING:
                    break
            if seq.status is Status.RUNNING:
                scheduled[seq] = n
                copies[seq] = cow
                budget -= n
                self._pinned[seq] = self.bm.pin([src for src, _ in cow])
        while self.waiting and budget > 0 and not preempted:
            gang = self._family(self.waiting[0], self.waiting)
            if len(self.running) + max(len(gang), gang[0].params.max_running) > self.max_num_seqs:
                break
            admitted = self._admit(gang, budget)
            if admitted is None:
                break
            for seq, n in admitted:
                if n:
                    scheduled[seq] = n
                    budget -= n

        if not scheduled:  # no copies will run: the pins of sequences scheduled, then preempted, go
            self.release_pins()
        self.stats.computed_tokens += sum(scheduled.values())
        if scheduled:
            self.stats.step_tokens.observe(sum(scheduled.values()))
        decode = sum(n for s, n in scheduled.items() if n == 1 + s.spec.num_draft and s.num_output_tokens)
        self.last_batch = (sum(scheduled.values()) - decode, decode)  # (prefill, decode) tokens: the console
        self.stats.peak_used_blocks = max(self.stats.peak_used_blocks, self.bm.num_blocks - self.bm.num_free_blocks)
        out = SchedulerOutput(list(scheduled.items()), preempted, [c for cs in copies.values() for c in cs],
                              self._swap_out, self._swap_in, self._swap_dropped)
        self._swap_out, self._swap_in, self._swap_dropped = [], [], []
        return out

    def take_swap_dropped(self) -> list[Sequence]:
        """Host copies let go since the last step (finished while swapped out): Engine.abort_request drops them now."""
        dropped, self._swap_dropped = self._swap_dropped, []
        return dropped

    def _admit(self, gang: list[Sequence], budget: int) -> list[tuple[Sequence, int]] | None:
        """Admit a waiting sequence, or the waiting beams of one request together (a half-admitted beam
        family would hold blocks while it waits for the rest): prefix-cache (and offload-tier) lookup, blocks
        for each member's first chunk; members past the token budget get 0 tokens (prefill from the next
        step). None (changing nothing but the offload tier's loaded blocks) when the pool is short."""
        taken: list[tuple[Sequence, int, int]] = []  # (seq, cached tokens, new tokens)
        swapped_in: list[tuple[Sequence, list[int]]] = []
        for seq in gang:
            swapped = seq.swapped is not None  # its KV comes back from the host into fresh blocks
            got = self._swap_back(seq, budget) if swapped else self._take_prefix(seq, budget)
            if got is None:  # the pool is short: nothing admitted
                for s, _, _ in taken:
                    self.bm.free(s.block_tables)
                return None
            if swapped:
                swapped_in.append((seq, got[2]))
            taken.append((seq, got[0], got[1]))
            budget -= got[1]
        now = time.time()
        restored = dict(swapped_in)
        for seq, cached, n in taken:
            self.waiting.remove(seq)
            seq.status = Status.RUNNING
            first = seq.first_scheduled_time is None
            if first:
                seq.first_scheduled_time = now
            self.running.append(seq)
            if seq in restored:  # keeps its num_computed_tokens: nothing to recompute
                self.swap_free += len(restored[seq])
                seq.swapped = None
                self._swap_in.append((seq, restored[seq]))
                continue
            seq.num_computed_tokens = cached
            if first:  # the prompt's cache hit; a readmission finds its own output tokens in the cache too
                seq.num_cached_tokens = cached
                if seq.params.prompt_logprobs is None:  # (vLLM counts readmissions apart, and does not export them)
                    self.stats.prefix_hit_tokens += cached
                    self.stats.prompt_tokens_queried += seq.num_tokens
        return [(seq, n) for seq, _, n in taken]

    def _take_prefix(self, seq: Sequence, budget: int) -> tuple[int, int] | None:
        """A waiting sequence's prefix-cache hit (with the offload tier's blocks, read in; none for prompt logprobs
        or mean pooling: they need every position) and blocks for its first chunk: (cached tokens, tokens to
        run), or None (holding nothing) when the pool is short."""
        use_cache = seq.params.prompt_logprobs is None and (seq.pooled is None or seq.pooling.pooling_type == "last")
        limit = seq.num_prompt_tokens - 2 if seq.family.forks_pending else None  # a fork's last prompt token runs
        for tier in (self.offload.has,) * 2 + (None,) if use_cache and self.offload is not None else (None,):
            prefix = self.bm.find_cached_prefix(seq.token_ids, seq.block_hashes, limit, seq.cache_salt, tier) if use_cache else []
            cached = len(prefix[0]) * self.bm.block_size if prefix else 0
            n = min(self._tokens_to_compute(seq, cached), budget)
            if not self.bm.can_allocate(cached + n, prefix):
                return None
            datas = self.offload.fetch(seq, prefix) if tier is not None else []  # read once the pool has room
            if datas is None:
                continue  # a tier block gone or damaged (now out of its index): look again
            self.bm.allocate(seq.block_tables, cached + n, prefix)  # (room checked: it succeeds)
            if datas:  # into the fresh blocks of the hit's IN_TIER places, registered in the prefix cache
                self.offload.load(self.bm, seq, prefix, cached, datas)
            return cached, n  # (the last try, without the tier, always returns)

    def _swap_back(self, seq: Sequence, budget: int) -> tuple[int, int, list[int]] | None:
        """Blocks for a swapped-out sequence: fresh ones in its old places, plus what its next chunk
        needs. Returns (its computed tokens, tokens to run, the restored blocks in saved order), or None
        (nothing held) when the pool is short."""
        tables = self.bm.restore(seq.swapped)
        if tables is None:
            return None
        restored = [b for t in tables for b in t if b >= 0]  # NULL_BLOCK (< 0): out of a window
        start, n = seq.num_computed_tokens, min(self._tokens_to_compute(seq), budget)
        if self.bm.reserve(tables, start, start + n, keep_from=start) is None:
            self.bm.free(tables)
            return None
        seq.block_tables = tables
        return start, n, restored

    @staticmethod
    def _family(seq: Sequence, queue: Iterable[Sequence]) -> list[Sequence]:
        """What is scheduled as one unit with seq, in queue order: a beam advances only when all its
        request's beams have their next-token log-probs, so the beams in `queue` are admitted and
        preempted together (one left behind would wait forever on the others' blocks). Any other
        sequence, n / best_of children included, stands alone: children are independent after the
        fork (as vLLM v1 makes them separate requests), so each only needs to fit by itself."""
        if not seq.params.use_beam_search:
            return [seq]
        return [s for s in queue if s.request_id == seq.request_id]

    @staticmethod
    def _tokens_to_compute(seq: Sequence, computed: int | None = None) -> int:
        """Tokens left to run; a sequence that will fork stops one token short of its prompt's end."""
        computed = seq.num_computed_tokens if computed is None else computed
        fork = seq.family.forks_pending and computed < seq.num_prompt_tokens - 1
        return (seq.num_prompt_tokens - 1 if fork else seq.num_tokens) - computed

    def add_running(self, seq: Sequence, after: Sequence) -> None:
        """Insert a forked child right after its parent (it already holds its blocks); an n / best_of
        child with max_num_seqs already running waits at the front instead, its blocks let go
        (recomputed, or found again in the prefix cache, when it is admitted). A beam clone always
        runs: the beam step prunes as many beams as it clones before the next schedule()."""
        if len(self.running) >= self.max_num_seqs and not seq.params.use_beam_search:
            self.bm.free(seq.block_tables)
            seq.num_computed_tokens = seq.num_cached_tokens = 0
            seq.status = Status.WAITING
            sibs = [i for i, w in enumerate(self.waiting) if w.request_id == seq.request_id]
            if sibs:  # behind the siblings deferred before it (children fork in index order)
                self.waiting.insert(sibs[-1] + 1, seq)
            else:
                self._queue(seq, ahead_of_equals=True)
            return
        seq.status = Status.RUNNING
        self.running.insert(self.running.index(after) + 1, seq)

    def _preempt(self, seq: Sequence, pending_copies: dict[int, int] | None = None) -> None:
        """Free a running sequence's blocks and requeue it ahead of its equals: its KV swapped out to
        the host when swap_pays says so and there is room (it resumes where it was), else to be
        recomputed. pending_copies (dst -> src): copy-on-write copies of this step not done yet, whose
        destination blocks hold nothing yet (the source is saved in their place)."""
        self.running.remove(seq)
        if seq.num_computed_tokens == seq.num_tokens:  # a beam waiting on its siblings: its log-probs go
            seq.num_computed_tokens -= 1  # with the preemption, so it resumes one token back to get them again
        self.bm.shrink(seq.block_tables, seq.num_computed_tokens)  # blocks past what it computed hold nothing
        self.bm.drop_out_of_window(seq.block_tables, seq.num_computed_tokens)  # nor those its next step won't read
        blocks = [b for t in seq.block_tables for b in t if b >= 0]
        if (self.swap_pays is not None and seq.num_computed_tokens > 0 and 0 < len(blocks) <= self.swap_free
                and self.swap_pays(seq, len(blocks))):
            copies = pending_copies or {}
            self._swap_out.append((seq, [copies.get(b, b) for b in blocks]))
            self.swap_free -= len(blocks)
            seq.swapped = [[b if b < 0 else 0 for b in t] for t in seq.block_tables]
            self.stats.num_swapped += 1
        else:
            seq.num_computed_tokens = 0
        self.bm.free(seq.block_tables)
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.stats.num_preemptions += 1
        self._queue(seq, ahead_of_equals=True)

    # ---------------------------------------------------------------- update
    def update_from_output(self, out: SchedulerOutput, sampled: dict[Sequence, list[int]],
                           rejected: dict[Sequence, int] | None = None) -> dict[Sequence, list[int]]:
        """Advance progress, append sampled tokens, register filled blocks, finish sequences that hit a
        token-level stop (EOS, stop_token_ids, max_tokens). The step's copies are done: their sources
        are let go.

        A speculating sequence ran its last token plus its drafts (which the speculation policy has
        taken back off its token list); `rejected[seq]` of those drafts were wrong: their KV slots
        are rolled back (blocks past the computed tokens return to the pool), and the accepted drafts
        plus the corrected token are appended like any sampled tokens, up to the first that stops the
        sequence (the rest are dropped, as if they had been sampled one step at a time). Blocks are
        hashed only after the tokens they hold are back in the token list. Returns the tokens each
        sequence received.
        """
        self.release_pins()
        rejected = rejected or {}
        bs = self.bm.block_size
        now = time.time()
        received: dict[Sequence, list[int]] = {}
        restored = {seq for seq, _ in out.swap_in}  # fresh blocks, their hashes registered again
        stats, append = self.stats, self._append  # (every sequence, every step: kept lean)
        observe = stats.inter_token_latency.observe
        for seq, n in out.scheduled:
            before = seq.num_computed_tokens
            wrong = rejected.get(seq, 0) if rejected else 0
            seq.num_computed_tokens += n - wrong
            if wrong:
                self.bm.shrink(seq.block_tables, seq.num_computed_tokens)
            stop = None
            tokens = sampled.get(seq)
            if tokens is not None:
                if seq.first_token_time is None and seq.index == 0:  # the request's prompt, counted once
                    stats.prompt_tokens += seq.num_prompt_tokens
                if seq.last_token_time is not None:
                    observe(now - seq.last_token_time)
                seq.last_token_time = now
                got, stop = append(seq, tokens, now)
                if seq.pooled is None:  # (an embedding's token: none)
                    stats.generation_tokens += len(got)
                received[seq] = got
            filled = min(seq.num_computed_tokens, len(seq.token_ids))  # tokens whose KV is in the blocks
            first = 0 if restored and seq in restored else before // bs
            if filled // bs > first:  # a block filled up this step (or came back from the host)
                self.bm.cache_full_blocks(seq.block_tables, seq.token_ids, filled, seq.block_hashes, first, seq.cache_salt)
            if stop is not None:
                self.finish(seq, *stop)
        for seq in restored - dict(out.scheduled).keys():  # back with 0 tokens (a beam sibling took the budget)
            if seq.block_tables and min(seq.num_computed_tokens, seq.num_tokens) >= bs:
                self.bm.cache_full_blocks(seq.block_tables, seq.token_ids, min(seq.num_computed_tokens, seq.num_tokens),
                                          seq.block_hashes, salt=seq.cache_salt)
        return received

    def took_back(self, n: int) -> None:
        """n (>= 0) tokens counted generated were dropped after all (past a stop string or a grammar's end,
        in a speculative window, or refused by a grammar): generation_tokens counts what the requests kept."""
        self.stats.generation_tokens -= n

    def release_pins(self) -> None:
        """The step's block copies are done (or the step failed): let go of their pinned sources."""
        for blocks in self._pinned.values():
            self.bm.unpin(blocks)
        self._pinned = {}

    @staticmethod
    def _append(seq: Sequence, tokens: list[int], now: float) -> tuple[list[int], tuple | None]:
        """Append tokens up to and including the first that ends the sequence; returns the appended
        tokens and (finish reason, stop reason) if one did. On every sequence's path every step:
        kept lean."""
        p = seq.params
        if seq.first_token_time is None:
            seq.first_token_time = now
        n_out = seq.num_output_tokens
        for i, tok in enumerate(tokens):
            seq.token_ids.append(tok)
            n_out += 1
            stop = None
            if n_out >= p.min_tokens:
                if not p.ignore_eos and tok in seq.eos_token_ids:
                    stop = ("stop", None)
                elif tok in p.stop_token_ids:
                    stop = ("stop", tok)
            if stop is None and n_out >= p.max_tokens:
                stop = ("length", None)
            if stop is not None:
                return tokens[:i + 1], stop
        return tokens, None

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None,
               override: bool = False) -> None:
        """End a sequence (stop, length, abort, error) and free its blocks at once. With override, a
        sequence that has already ended takes this reason instead (a stop string found in a token
        before the one that ended it)."""
        if seq.is_finished:
            if override:
                seq.finish_reason, seq.stop_reason = reason, stop_reason
            return
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
            if seq.swapped is not None:  # its host copy is let go
                self.swap_free += sum(1 for t in seq.swapped for b in t if b >= 0)
                seq.swapped = None
                self._swap_dropped.append(seq)
        self.bm.free(seq.block_tables)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        seq.finished_time = time.time()
