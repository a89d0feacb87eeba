"""The scheduler on its own: a Scheduler + BlockManager + Sequences, no model.

A small driver plays the engine and the runner: it proposes drafts, runs a step by writing each
scheduled token into a simulated KV cache (block -> the token whose KV each slot holds), samples
tokens, and holds the tokens of lock-step families (beams, which advance together) until every
member has sampled. Every check reads that simulated cache, so a block that holds the wrong tokens
(a bad hash, a stale copy) is seen as such.
"""

from __future__ import annotations

import random

from hypothesis import example, given, settings
from hypothesis import strategies as st

from lmserve.kv.block_manager import NULL_BLOCK, BlockManager, chain_hash
from lmserve.scheduler import Scheduler, SchedulerOutput
from lmserve.sequence import SamplingParams, Sequence, Status


def new_seq(rid: str, prompt: list[int], max_tokens: int = 8, index: int = 0, width: int = 1) -> Sequence:
    """A sequence; width > 1 makes it one of `width` beams (which the scheduler keeps together)."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0,
                            use_beam_search=width > 1, best_of=width if width > 1 else None)
    return Sequence(rid, list(prompt), params, index=index)


class Driver:
    """Engine + runner stand-in around a real Scheduler and BlockManager."""

    def __init__(self, num_blocks: int, block_size: int = 4, max_num_seqs: int = 8, budget: int = 16,
                 prefix_caching: bool = True, seed: int = 0, windows: tuple[int | None, ...] = (None,),
                 swap_blocks: int = 0) -> None:
        self.bm = BlockManager(num_blocks, block_size, prefix_caching, windows, max_step_tokens=budget)
        self.swap_blocks = swap_blocks  # host swap space: every victim that fits swaps (else recomputes)
        self.sched = Scheduler(self.bm, max_num_seqs, budget, swap_blocks, (lambda s, n: True) if swap_blocks else None)
        self.host: dict[Sequence, list[list[int | None]]] = {}  # what HostSwap holds
        self.bs = block_size
        self.content: dict[int, list[int | None]] = {}
        self.families: dict[str, list[Sequence]] = {}
        self.lockstep: set[str] = set()
        self.parent_hash: dict[bytes, bytes | None] = {}
        self.rng = random.Random(seed)

    # ------------------------------------------------------------ requests (what validation admits)
    def fits(self, prompt_len: int, max_tokens: int, width: int = 1) -> bool:
        """Engine.validate: each sequence fits the pool; beams (width > 1) all at once."""
        return width <= self.sched.max_num_seqs and \
            width * self.bm.max_blocks(prompt_len + max_tokens) <= self.bm.num_blocks

    def add(self, rid: str, prompt: list[int], max_tokens: int = 8, width: int = 1, priority: int = 0) -> None:
        """A plain request (width 1) or `width` beams that advance in lock-step."""
        fam = [new_seq(rid, prompt, max_tokens, i, width) for i in range(width)]
        for seq in fam:
            seq.priority = priority
        self.families[rid] = fam
        if width > 1:
            self.lockstep.add(rid)
        for s in fam:
            self.sched.add(s)

    def fork(self, parent: Sequence) -> Sequence:
        """What Engine._clone does: a running copy holding the parent's blocks by reference."""
        fam = self.families[parent.request_id]
        child = new_seq(parent.request_id, parent.prompt_token_ids, parent.params.max_tokens, len(fam))
        child.token_ids = list(parent.token_ids)
        child.block_tables = self.bm.fork(parent.block_tables)
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens
        fam.append(child)
        self.sched.add_running(child, after=parent)
        return child

    def abort(self, rid: str) -> None:
        """What Engine.abort_request does: finish every member, drop host copies at once."""
        for s in self.families.pop(rid, []):
            self.sched.finish(s, "abort")
        for key in self.sched.take_swap_dropped():
            self.host.pop(key)
        self.lockstep.discard(rid)

    def live(self) -> list[Sequence]:
        return [s for fam in self.families.values() for s in fam if not s.is_finished]

    @property
    def pending(self) -> bool:
        return bool(self.sched.running or self.sched.waiting)

    # ------------------------------------------------------------ one step
    def step(self, max_draft: int = 0) -> SchedulerOutput:
        drafted = []
        for s in list(self.sched.running):  # the proposer: drafts for decoding, free-running sequences
            room = s.params.max_tokens - s.num_output_tokens - 1
            k = min(self.rng.randint(0, max_draft), room)
            if s.request_id not in self.lockstep and s.num_tokens - s.num_computed_tokens == 1 and k > 0:
                s.token_ids.extend(self.rng.randrange(4) for _ in range(k))
                s.spec.num_draft = k
                drafted.append(s)
        out = self.sched.schedule()
        got = dict(out.scheduled)
        for s in drafted:  # what SpecPolicy.trim does
            keep = max(0, got.get(s, 0) - 1) if s.status is Status.RUNNING else 0
            if keep < s.spec.num_draft:
                del s.token_ids[len(s.token_ids) - (s.spec.num_draft - keep):]
                s.spec.num_draft = keep
        self.check_step(out)
        for key in out.swap_dropped:  # the runner (HostSwap.apply): drops, outs, ins, then copies
            self.host.pop(key)
        for s, blocks in out.swap_out:
            self.host[s] = [list(self.content.get(b, [None] * self.bs)) for b in blocks]
        for s, blocks in out.swap_in:
            for b, data in zip(blocks, self.host.pop(s), strict=True):
                self.content[b] = data
        for src, dst in out.block_copies:  # the runner: copies, then the forward writes K/V
            self.content[dst] = list(self.content.get(src, [None] * self.bs))
        sampled: dict[Sequence, list[int]] = {}
        rejected: dict[Sequence, int] = {}
        for s, n in out.scheduled:
            c = s.num_computed_tokens
            for table in s.block_tables:  # every KV group's layers write the step's tokens
                for pos in range(c, c + n):
                    self.content.setdefault(table[pos // self.bs], [None] * self.bs)[pos % self.bs] = s.token_ids[pos]
            if c + n != s.num_tokens:
                continue  # a prefill chunk that does not reach the end samples nothing
            bonus = self.rng.randrange(4)
            if s.request_id in self.lockstep:
                s.family.pending_logprobs = bonus  # a beam waits for its siblings (FanOut._beam_step)
            elif s.spec.num_draft:
                acc = self.rng.randint(0, s.spec.num_draft)
                sampled[s] = s.token_ids[s.num_tokens - s.spec.num_draft:][:acc] + [bonus]
                rejected[s] = s.spec.num_draft - acc
            else:
                sampled[s] = [bonus]
        for s, _ in out.scheduled:  # what SpecPolicy.settle does: drafts leave the token list
            if s.spec.num_draft:
                del s.token_ids[len(s.token_ids) - s.spec.num_draft:]
                s.spec.num_draft = 0
        for s in out.preempted:  # FanOut.after_step: a preempted beam recomputes its log-probs
            s.family.pending_logprobs = None
        self.sched.update_from_output(out, sampled, rejected)
        for rid in list(self.lockstep):
            fam = [s for s in self.families.get(rid, []) if not s.is_finished]
            if fam and all(s.status is Status.RUNNING and s.family.pending_logprobs is not None for s in fam):
                for s in fam:
                    s.append_token(s.family.pending_logprobs)
                    s.family.pending_logprobs = None
                    if s.num_output_tokens >= s.params.max_tokens:
                        self.sched.finish(s, "length")
        for rid in [r for r, fam in self.families.items() if all(s.is_finished for s in fam)]:
            del self.families[rid]
            self.lockstep.discard(rid)
        self.check_state()
        return out

    def run_until_done(self, max_steps: int = 2000, **kw: int) -> int:
        steps = 0
        while self.pending:
            out = self.step(**kw)
            assert not out.is_empty, "the scheduler stalled with work pending"
            steps += 1
            assert steps < max_steps
        return steps

    # ------------------------------------------------------------ invariants
    def check_step(self, out: SchedulerOutput) -> None:
        # a copy's target is a scheduled sequence's private block that already holds computed tokens
        # (the partial block it shared), never a block handed out fresh
        partial = {t[i] for s, _ in out.scheduled for t in s.block_tables
                   for i in range(-(-s.num_computed_tokens // self.bs))}
        for src, dst in out.block_copies:
            assert dst in partial, f"copy-on-write pair {src}->{dst} targets no sequence's shared block"
            assert self.bm.ref_count[dst] == 1 and self.bm.ref_count[src] >= 1
        n = sum(n for _, n in out.scheduled)
        assert n <= self.sched.max_num_batched_tokens
        assert len(self.sched.running) <= self.sched.max_num_seqs

    def check_state(self) -> None:
        bm, bs = self.bm, self.bs
        counts = [0] * bm.num_blocks
        for s in self.live():
            for b in (b for t in s.block_tables for b in t if b != NULL_BLOCK):
                counts[b] += 1
            if s.status is Status.WAITING:
                assert not s.block_tables and s.family.pending_logprobs is None
        assert counts == bm.ref_count, "reference counts must equal the number of holders"
        assert all((bm.ref_count[b] == 0) == (b in bm.free_queue) for b in range(bm.num_blocks))
        for s in self.live():
            if s.status is not Status.RUNNING:
                continue
            assert len(s.block_tables) == bm.num_groups
            for g, table in enumerate(s.block_tables):
                # the cache holds each computed token's KV where the next step can read it: every token
                # in a full group, the last window - 1 tokens (and maybe more) in a windowed one
                need = bm.first_needed(g, s.num_computed_tokens) * bs
                for pos in range(s.num_computed_tokens):
                    b = table[pos // bs]
                    if b == NULL_BLOCK:
                        assert pos < need, (s, g, pos)
                        continue
                    assert self.content[b][pos % bs] == s.token_ids[pos], (s, g, pos)
                parent = None
                for i, b in enumerate(table[:s.num_computed_tokens // bs]):
                    h = bm.block_hash[b] if b != NULL_BLOCK else None
                    expected = chain_hash(parent, s.token_ids[i * bs:(i + 1) * bs])
                    if h is not None:
                        assert h == expected, "a block registered under another block's hash"
                        self.parent_hash[h] = parent
                    parent = expected
        for (g, h), b in bm.hash_to_block.items():  # cached blocks, held or free, still hold what they hash
            assert bm.block_hash[b] == h and bm.block_group[b] == g
            if h in self.parent_hash:
                assert h == chain_hash(self.parent_hash[h], self.content[b])


# ---------------------------------------------------------------- order and budget
def test_decode_first_then_prefill_chunks_then_admission():
    d = Driver(num_blocks=64, budget=10)
    d.add("a", list(range(3)))
    d.step()  # a's prompt (3 tokens) in one chunk
    d.add("b", list(range(100, 120)))  # 20 tokens: chunks of what the budget leaves
    out = d.step()
    assert [(s.request_id, n) for s, n in out.scheduled] == [("a", 1), ("b", 9)]
    d.add("c", [7, 7, 7])
    out = d.step()
    assert [(s.request_id, n) for s, n in out.scheduled] == [("a", 1), ("b", 9)]  # no budget left for c
    out = d.step()
    assert [(s.request_id, n) for s, n in out.scheduled] == [("a", 1), ("b", 2), ("c", 3)]
    assert [s.request_id for s, _ in d.step().scheduled] == ["a", "b", "c"]  # all decoding now


def test_chunk_sizes_follow_the_budget():
    d = Driver(num_blocks=64, budget=32)
    d.add("long", list(range(100)), max_tokens=2)
    chunks = [d.step().scheduled[0][1] for _ in range(5)]
    assert chunks == [32, 32, 32, 4, 1]  # the last prompt chunk samples; then one decode token


def test_preempts_the_tail_and_admits_nothing_that_step():
    d = Driver(num_blocks=4, block_size=4, budget=64)
    d.add("a", list(range(7)), max_tokens=8)  # 2 blocks, grows to 4
    d.add("b", list(range(50, 57)), max_tokens=8)
    d.step()
    assert d.bm.num_free_blocks == 0
    d.add("c", [1, 2, 3])
    out = d.step()  # a's 8th token fits its second block; b's too
    out = d.step()  # a needs a third block: the tail (b) is preempted, c is not admitted
    assert [s.request_id for s in out.preempted] == ["b"]
    assert [s.request_id for s, _ in out.scheduled] == ["a"]
    assert [s.request_id for s in d.sched.waiting] == ["b", "c"]  # the victim goes to the front
    assert d.families["b"][0].num_computed_tokens == 0 and not d.families["b"][0].block_table
    d.run_until_done()
    assert d.bm.num_free_blocks == d.bm.num_blocks


def test_priority_orders_admission_first_come_first_served_within_one():
    """Lower priority values are admitted first; equal ones in arrival order (the default, all 0, is
    plain FCFS)."""
    d = Driver(num_blocks=64, max_num_seqs=1, budget=64)
    for rid, prio in (("a", 5), ("b", 0), ("c", 5), ("d", -1), ("e", 0)):
        d.add(rid, [1, 2, 3], max_tokens=2, priority=prio)
    assert [s.request_id for s in d.sched.waiting] == ["d", "b", "e", "a", "c"]
    order = []
    while d.sched.waiting or d.sched.running:
        out = d.step()
        order += [s.request_id for s, _ in out.scheduled if s.request_id not in order]
    assert order == ["d", "b", "e", "a", "c"]


def test_preemption_takes_the_worst_priority_not_the_latest():
    """A pool short for two growing sequences: the one of worse priority is preempted, though the
    better one was admitted last (FCFS alone takes the tail), and goes back ahead of its equals."""
    d = Driver(num_blocks=4, block_size=4, budget=64)
    d.add("low", list(range(7)), max_tokens=8, priority=3)
    d.step()
    d.add("high", list(range(50, 57)), max_tokens=8, priority=0)
    high = d.families["high"][0]
    preempted = []
    while d.sched.waiting or d.sched.running:
        preempted += [s.request_id for s in d.step().preempted]
    assert preempted and set(preempted) == {"low"}  # (first come, first served alone: "high", the tail)
    assert high.num_preemptions == 0 and high.is_finished
    assert d.bm.num_free_blocks == d.bm.num_blocks


def test_a_victim_swaps_out_and_resumes_where_it_was():
    """With swap space, the victim's computed blocks go to the host (the output lists them), it keeps
    its computed tokens, and on readmission fresh blocks are listed to copy them back into: nothing
    is recomputed (the driver checks every computed token's KV is back in place); without swap space,
    or with too little, the same workload recomputes the victim's tokens."""
    runs = {}
    for swap in (0, 1, 8):
        d = Driver(num_blocks=4, block_size=4, budget=64, swap_blocks=swap)
        d.add("a", list(range(7)), max_tokens=8)
        d.add("b", list(range(50, 57)), max_tokens=8)
        b = d.families["b"][0]
        d.step()
        d.step()
        out = d.step()  # a needs a third block: b (the tail) is preempted
        assert [s.request_id for s in out.preempted] == ["b"]
        if swap == 8:
            assert [(s.request_id, len(blocks)) for s, blocks in out.swap_out] == [("b", 2)]
            assert b.num_computed_tokens == 8 and b.swapped is not None and d.sched.swap_free == 6
        else:  # no room on the host (b holds 2 blocks): recompute
            assert not out.swap_out and b.num_computed_tokens == 0
        swapped_in = []
        while d.pending:
            swapped_in += [(s.request_id, len(blocks)) for s, blocks in d.step().swap_in]
        assert swapped_in == ([("b", 2)] if swap == 8 else [])
        assert d.sched.swap_free == swap and d.bm.num_free_blocks == 4
        runs[swap] = d.sched.stats
    assert runs[8].num_swapped == 1 and runs[0].num_swapped == runs[1].num_swapped == 0
    assert runs[8].computed_tokens == runs[0].computed_tokens - 8  # b's 8 computed tokens, not run again


def test_a_swapped_sequence_with_nothing_left_to_run_resumes_one_token_back():
    """A beam that has computed its last token waits, log-probs in hand, for its siblings; preempted,
    it loses them (FanOut drops a victim's log-probs), so swapped it must come back with its last token
    to run again, not with nothing to run (its family would wait on it forever: a stall)."""
    bm = BlockManager(16, 4, False)
    sched = Scheduler(bm, 4, 64, swap_blocks=16, swap_pays=lambda s, n: True)
    seq = new_seq("beam", list(range(6)), max_tokens=4, index=0, width=2)
    sched.add(seq)
    sched.schedule()
    assert seq.num_computed_tokens == 0  # (scheduled: the step's tokens count once update_from_output runs)
    seq.num_computed_tokens = seq.num_tokens  # as after the step: the beam has nothing left to compute
    sched._preempt(seq)
    assert seq.swapped is not None and seq.num_computed_tokens == seq.num_tokens - 1
    out = sched.schedule()
    assert [(s.request_id, n) for s, n in out.scheduled] == [("beam", 1)] and len(out.swap_in) == 1


# ---------------------------------------------------------------- families (defects 1 and 7)
def test_beams_are_preempted_and_readmitted_as_a_whole():
    d = Driver(num_blocks=12, block_size=4, budget=64)
    d.add("solo", list(range(30, 44)), max_tokens=8)
    d.add("beam", list(range(8)), max_tokens=4, width=3)
    for _ in range(20):
        order = [s for s in d.sched.running if s.request_id == "beam"]
        out = d.step()
        if out.preempted:
            break
    assert sorted(s.index for s in out.preempted) == [0, 1, 2]
    assert all(s.request_id == "beam" for s in out.preempted)
    assert list(d.sched.waiting) == order  # in running order, at the front
    d.run_until_done()
    assert d.bm.num_free_blocks == d.bm.num_blocks


def test_forked_children_stand_alone():
    """n / best_of children are independent after the fork: the tail child alone is preempted, so
    a family larger than the pool still finishes (each child fits by itself)."""
    d = Driver(num_blocks=8, block_size=4, budget=64)
    d.add("fam", list(range(8)), max_tokens=16)  # 6 blocks at the end; 3 children need 14 at least
    d.step()
    p = d.families["fam"][0]
    d.fork(p)
    d.fork(p)
    alone = 0  # steps where a child was preempted while a sibling ran on
    while d.pending:
        out = d.step()
        assert not out.is_empty
        alone += bool(out.preempted) and any(s.request_id == "fam" for s, _ in out.scheduled)
    assert alone > 0
    assert d.bm.num_free_blocks == d.bm.num_blocks


def test_lockstep_family_under_pressure_never_stalls():
    """Beams that have sampled wait (0 tokens to run) for their siblings: with a family that fits the
    pool (what validation now demands), preemption of whole families always lets it finish. The
    engine-level case of defect 1 (a family that could never fit) is in test_beam.py."""
    stalled_configs = 0
    for width in (2, 3, 4):
        for num_blocks in (8, 12, 16):
            d = Driver(num_blocks=num_blocks, block_size=4, budget=64)
            max_tokens = num_blocks // width * 4 - 8  # the family fills the pool
            if max_tokens < 1:
                continue
            assert d.fits(8, max_tokens, width)
            d.add("other", [1, 2, 3], max_tokens=4)
            d.add("beam", list(range(10, 18)), max_tokens=max_tokens, width=width)
            d.run_until_done()
            stalled_configs += d.sched.stats.num_preemptions > 0
            assert d.bm.num_free_blocks == num_blocks
    assert stalled_configs > 0  # the pressure was real: families were preempted and came back


def _prefill_beside_a_forked_decode(prompt_len: int) -> Driver:
    """A 6-block pool of 4-token blocks: y, a prompt of prompt_len tokens with 8 computed (prefilling:
    scheduled after the decodes), and p, 6 tokens computed and one to run, forked: p and its child
    share p's 2 blocks, the second half full."""
    d = Driver(num_blocks=6, block_size=4, budget=64)
    y = new_seq("y", list(range(100, 100 + prompt_len)), max_tokens=1)
    assert d.bm.allocate(y.block_tables, 8)
    p = new_seq("p", list(range(6)))
    assert d.bm.allocate(p.block_tables, 6)
    p.append_token(9)
    for s, computed in ((y, 8), (p, 6)):
        s.num_computed_tokens, s.status = computed, Status.RUNNING
        d.sched.running.append(s)
        d.families[s.request_id] = [s]
    d.content.update({b: [None] * 4 for t in y.block_tables + p.block_tables for b in t})
    d.fork(p)
    return d


def test_copy_on_write_pairs_of_a_victim_are_dropped():
    """Defect 7: a sequence that got a private copy this step and is then preempted must not leave
    its (src, dst) pair behind: dst has just been freed and may now be someone else's fresh block."""
    d = _prefill_beside_a_forked_decode(20)  # 2 blocks free
    out = d.sched.schedule()
    # p writes into the shared block (a copy takes 1 free block); y's next chunk needs 3 blocks:
    # the tail family (p and its child) is preempted, and p's copy must go with it
    assert {s.request_id for s in out.preempted} == {"p"}
    assert [(s.request_id, n) for s, n in out.scheduled] == [("y", 12)]
    assert out.block_copies == []
    d.check_step(out)


def test_a_pinned_copy_source_is_no_holder():
    """A copy-on-write source is pinned until the step's copies run, but a pin is no holder: of three
    sequences sharing a partial block two copy it and the last writes in place (before, every one of
    them copied: the pin kept the count above 1). And a sequence that copied, then is preempted in the
    same schedule(), lets its pin go: a prefill needing the whole pool got an empty schedule before
    (Engine.step: "scheduler stalled", every request failed)."""
    d = Driver(num_blocks=16, block_size=4, budget=64)
    d.add("p", list(range(6)), max_tokens=4)
    out = d.step()
    (p,) = d.families["p"]
    d.fork(p), d.fork(p)  # three holders of p's 2 blocks, the second partial
    out = d.step()
    assert len(out.block_copies) == 2 and {n for _, n in out.scheduled} == {1}
    d.run_until_done()
    assert d.bm.num_free_blocks == 16 and not d.bm.pins

    d = _prefill_beside_a_forked_decode(23)  # y: 24 tokens, the whole pool
    out = d.sched.schedule()  # p copies the shared block (pinning it); its child writes in place; y needs all
    assert [(s.request_id, n) for s, n in out.scheduled] == [("y", 15)]
    assert {s.request_id for s in out.preempted} == {"p"} and out.block_copies == []
    d.sched.release_pins()
    assert not d.bm.pins and d.bm.num_free_blocks == 0  # y holds all 6 blocks


def test_a_drafting_decode_goes_before_prefills():
    """A decode with drafts has 1 + k tokens to run: it is still a decode and goes first (before, it
    queued behind a prefill admitted earlier and could get no token at all that step)."""
    d = Driver(num_blocks=64, block_size=4, budget=8)
    y = new_seq("y", list(range(40)), max_tokens=4)  # still prefilling
    assert d.bm.allocate(y.block_tables, 8)
    y.num_computed_tokens = 8
    dd = new_seq("d", [1, 2, 3], max_tokens=20)
    assert d.bm.allocate(dd.block_tables, 3)
    dd.num_computed_tokens = 3
    dd.append_token(1)
    for s in (y, dd):
        s.status = Status.RUNNING
        d.sched.running.append(s)
    dd.token_ids += [1, 1, 1]
    dd.spec.num_draft = 3
    out = d.sched.schedule()
    assert [(s.request_id, n) for s, n in out.scheduled] == [("d", 4), ("y", 4)]


# ---------------------------------------------------------------- speculation and prefix hashes (defect 4)
def test_speculative_steps_register_blocks_over_their_real_tokens():
    """Defect 4: after verification the computed count moved past the token list (the accepted
    drafts were not appended back yet), so a block that filled was hashed over a short slice."""
    d = Driver(num_blocks=64, block_size=4, budget=64)
    d.add("a", [5, 6, 7], max_tokens=24)
    d.step()  # 3 prompt tokens computed, 1 sampled
    seq = d.families["a"][0]
    seq.token_ids.extend([8, 9, 9, 9])  # drafts that fill the second block
    seq.spec.num_draft = 4
    out = d.sched.schedule()
    del seq.token_ids[-4:]  # the speculation policy takes the drafts back before the update
    d.sched.update_from_output(out, {seq: [8, 9, 9, 9, 1]}, {seq: 0})  # all accepted, plus a bonus
    assert seq.num_computed_tokens == 8 and seq.token_ids[4:] == [8, 9, 9, 9, 1]
    h0 = chain_hash(None, seq.token_ids[:4])
    assert d.bm.block_hash[seq.block_table[0]] == h0
    assert d.bm.block_hash[seq.block_table[1]] == chain_hash(h0, [8, 9, 9, 9])
    # a later request with the same 8 tokens hits both blocks
    assert d.bm.find_cached_prefix(seq.token_ids[:8] + [3]) == [seq.block_table[:2]]


# ---------------------------------------------------------------- random workloads
events = st.lists(st.tuples(st.sampled_from(["add", "add", "beam", "abort", "fork", "step", "step", "step"]),
                            st.integers(0, 2**16)), min_size=1, max_size=60)


@settings(max_examples=120, deadline=None)
@example(events=[("add", 32), ("step", 0), ("fork", 0), ("fork", 0), ("step", 0), ("abort", 0)], num_blocks=6,
         block_size=4, budget=4, max_draft=0, prefix=False, windows=(None, 4), swap=4)  # found by CI: an aborted
# request's swapped-out child kept its host copy until a next step that an idle engine never ran
@given(events=events, num_blocks=st.integers(6, 20), block_size=st.sampled_from([2, 4]),
       budget=st.sampled_from([4, 8, 32]), max_draft=st.integers(0, 3), prefix=st.booleans(),
       windows=st.sampled_from([(None,), (None, 4), (None, 3, 3)]), swap=st.sampled_from([0, 0, 4, 64]))
def test_random_workload_invariants(events, num_blocks, block_size, budget, max_draft, prefix, windows, swap):  # type: ignore[no-untyped-def]
    """Random arrivals, beams, aborts, forks and speculative accept counts under a tight pool, with one
    KV group or full + sliding-window groups, victims recomputed or swapped to the host (a little or a
    lot of swap space): reference counts equal holders, every computed token's KV is where its sequence
    reads it (a windowed group: the tokens its window still sees; a swapped sequence: back where it
    resumes), every cached block's hash is the hash of its tokens, nothing stalls, and all blocks (and
    all swap space) are free at the end."""
    d = Driver(num_blocks, block_size, max_num_seqs=6, budget=budget, prefix_caching=prefix, windows=windows,
               swap_blocks=swap)
    prefixes = [[1, 2, 3, 0] * 4, [3, 2, 1, 0] * 3, [2, 2]]
    for i, (ev, r) in enumerate(events):
        rng = random.Random(r)
        if ev in ("add", "beam"):
            prompt = prefixes[r % 3][: rng.randint(1, 12)] + [rng.randrange(4) for _ in range(rng.randint(0, 5))]
            width = rng.randint(2, 3) if ev == "beam" else 1
            max_tokens = rng.randint(1, 10)
            if d.fits(len(prompt), max_tokens, width):
                d.add(f"r{i}", prompt, max_tokens, width)
        elif ev == "abort" and d.families:
            d.abort(rng.choice(sorted(d.families)))
        elif ev == "fork":
            cands = [s for s in d.sched.running if s.request_id not in d.lockstep]
            if cands:
                s = rng.choice(cands)
                d.fork(s)  # children stand alone: each fits as its parent does
        elif d.pending:
            out = d.step(max_draft=max_draft)
            assert not out.is_empty, "the scheduler stalled with work pending"
    d.run_until_done(max_draft=max_draft)
    assert not d.families
    assert d.bm.num_free_blocks == num_blocks
    assert d.sched.swap_free == swap and not d.host


def test_a_beam_swapped_back_in_with_no_tokens_registers_its_blocks():
    """A beam family swapped back in on a 1-token budget: the first beam runs its token, the second comes
    back with 0 (not in the step's scheduled list). Both beams' full blocks are in the prefix cache after
    (before, the second's were never registered: update_from_output only visited scheduled sequences)."""
    bm = BlockManager(64, 4, True)
    sch = Scheduler(bm, 8, 1, swap_blocks=100, swap_pays=lambda s, n: True)
    p = SamplingParams(max_tokens=20, use_beam_search=True, best_of=2, ignore_eos=True, temperature=0)
    a, b = (Sequence("r", list(range(30, 42)), p, index=i) for i in range(2))
    for s in (a, b):
        sch.add(s)

    def step(beam_tokens: bool = True) -> SchedulerOutput:
        out = sch.schedule()
        sch.update_from_output(out, {})
        if beam_tokens and all(s.num_computed_tokens == s.num_tokens for s in (a, b)):  # the beam step
            a.append_token(7)
            b.append_token(8)
        return out
    while min(a.num_computed_tokens, b.num_computed_tokens) < 17:
        step()
    sch._preempt(b)
    sch._preempt(a)  # the family preempted by swapping
    assert a.swapped is not None and b.swapped is not None
    other: list[list[int]] = []
    bm.allocate(other, bm.num_free_blocks * 4)  # another request takes the pool: the old hashes are evicted
    bm.free(other)
    out = step(beam_tokens=False)
    assert {s.index for s, _ in out.swap_in} == {0, 1} and [(s.index, n) for s, n in out.scheduled] == [(0, 1)]
    for s in (a, b):
        full = s.num_computed_tokens // 4
        assert all((0, h) in bm.hash_to_block for h in bm.block_hashes(s.token_ids, full)), s.index


def test_children_deferred_by_max_num_seqs_wait_in_index_order(tiny_models):  # type: ignore[no-untyped-def]
    """n = 4 with max_num_seqs 2 and another request running: children 1, 2, 3 wait in that order (each was
    queued ahead of the one before it: 3, 2, 1)."""
    from lmserve import LLM
    e = LLM(str(tiny_models["llama"][0]), max_num_seqs=2).engine
    e.add_request("other", [9, 9, 9, 9], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    e.add_request("fam", list(range(10, 20)), SamplingParams(max_tokens=5, n=4, temperature=0.8, seed=1,
                                                             ignore_eos=True))
    for _ in range(3):
        e.step()
    assert [(s.request_id, s.index) for s in e.scheduler.waiting] == [("fam", 1), ("fam", 2), ("fam", 3)]
    while e.has_unfinished_requests():
        e.step()
