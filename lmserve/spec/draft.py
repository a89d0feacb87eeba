"""Draft-model proposer: a smaller model with the same tokenizer and its own paged KV cache.

For each target sequence it keeps a mirror Sequence in its own BlockManager. Every engine step it
first syncs the mirror to the target's committed tokens (keeping the KV of the longest common prefix,
rolling back the rest), then runs k batched steps: the first catches up on the tokens it has not seen
and samples draft 1, each later step decodes the previous draft and samples the next. Drafts are
drawn from the draft model's processed distribution (same temperature / top-k / top-p / penalties
as the request), which is what the rejection step needs as p.
"""

from __future__ import annotations

import random

import torch

from lmserve.config import EngineConfig, ModelConfig
from lmserve.kv import BlockManager, KVCache
from lmserve.runner import ModelRunner
from lmserve.sampling.sampler import Sampler, TokenView, draw
from lmserve.scheduler import SchedulerOutput
from lmserve.sequence import Sequence
from lmserve.spec import Proposal
from lmserve.utils import to_device


class DraftModelProposer:
    """Runs the draft model k steps per engine step over all speculating sequences at once."""

    def __init__(self, model: torch.nn.Module, cfg: ModelConfig, kv_budget: int, config: EngineConfig) -> None:
        dtype = config.torch_dtype
        num_blocks = max(1, KVCache.blocks_for_budget(cfg, config.block_size, dtype, kv_budget))
        self.cfg = cfg
        self.max_len = cfg.max_position_embeddings  # SpecPolicy drafts no position past the draft's own context
        self.model = model
        self.kv = KVCache(cfg, num_blocks, config.block_size, dtype, config.device)
        self.bm = BlockManager(num_blocks, config.block_size, enable_prefix_caching=False,
                               windows=self.kv.groups.windows, max_step_tokens=config.max_num_batched_tokens)
        self.runner = ModelRunner(model, self.kv, config.device)
        self.max_step_tokens = config.max_num_batched_tokens  # a catch-up forward's tokens, at most
        self.sampler = Sampler()
        self.mirrors: dict[int, Sequence] = {}

    def _mirror(self, seq: Sequence) -> Sequence:
        m = self.mirrors.get(id(seq))
        if m is None or m.request_id != seq.request_id:
            if m is not None:  # another request's, whose sequence object's id this one took: its blocks go
                self.bm.free(m.block_tables)
            m = Sequence(seq.request_id, seq.prompt_token_ids, seq.params, eos_token_ids=seq.eos_token_ids)
            m.generator = random.Random(seq.generator.getrandbits(62))
            self.mirrors[id(seq)] = m
        target = seq.token_ids
        lcp = 0
        # the last committed token is always fed again: its logits give draft 1 (a mirror that computed
        # every committed token, its draft cut and then matched, had no row for them)
        limit = min(len(m.token_ids), len(target) - 1, m.num_computed_tokens)
        while lcp < limit and m.token_ids[lcp] == target[lcp]:
            lcp += 1
        m.num_computed_tokens = lcp
        m.token_ids = list(target)
        self.bm.shrink(m.block_tables, lcp)
        return m

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        mirrors = {i: self._mirror(s) for i, (s, k) in enumerate(zip(seqs, ks)) if k > 0}
        # a rejection rolls a mirror back to no less than its target's committed tokens: windowed
        # groups keep what a step from there reads, not only what the speculative steps read
        committed = {i: m.num_tokens for i, m in mirrors.items()}
        drafts: dict[int, list[int]] = {i: [] for i in mirrors}
        probs: dict[int, list[torch.Tensor]] = {i: [] for i in mirrors}
        active = self._catch_up(mirrors, committed)
        for r in range(max(ks, default=0)):
            batch = []
            for i, m in list(active.items()):
                if r >= ks[i]:
                    del active[i]
                    continue
                n = m.num_tokens - m.num_computed_tokens
                if self.bm.reserve(m.block_tables, m.num_computed_tokens, m.num_computed_tokens + n,
                                   keep_from=min(committed[i], m.num_computed_tokens)) is None:
                    del active[i]  # the draft cache is full: this sequence proposes what it has
                    continue
                batch.append((i, m, n))
            if not batch:
                break
            out = SchedulerOutput([(m, n) for _, m, n in batch])
            ids, pos, meta = self.runner.build_inputs(out)
            hidden = self.model(ids, pos, self.kv.layers, meta)  # (N, hidden)
            ends = to_device(torch.tensor(meta.query_start_loc_host_ends()), hidden.device)
            logits = self.model.compute_logits(hidden[ends])  # (B, V)
            p = self.sampler.target_probs(logits, [TokenView(m, m.num_tokens) for _, m, _ in batch])  # (B, V)
            toks = draw(p, [None if m.params.temperature == 0 else m.generator for _, m, _ in batch]).tolist()
            for (i, m, n), tok, row in zip(batch, toks, p):
                m.num_computed_tokens += n
                m.token_ids.append(tok)
                drafts[i].append(tok)
                probs[i].append(row)
        return [Proposal(drafts[i], torch.stack(probs[i])) if i in drafts and drafts[i] else Proposal([])
                for i in range(len(seqs))]

    def _catch_up(self, mirrors: dict[int, Sequence], committed: dict[int, int]) -> dict[int, Sequence]:
        """Feed the mirrors the tokens they have not seen but the last, in forwards of at most the
        engine's token budget (a long prompt's first catch-up is a chunked prefill, as the target's
        was, never the whole of every new prompt in one forward). Returns the mirrors that caught
        up; one the draft cache cannot hold proposes nothing this step."""
        active = dict(mirrors)
        while True:
            batch, room = [], self.max_step_tokens
            for i, m in list(active.items()):
                n = min(m.num_tokens - m.num_computed_tokens - 1, room)  # the last token: drafting's round 0
                if n <= 0:
                    continue
                if self.bm.reserve(m.block_tables, m.num_computed_tokens, m.num_computed_tokens + n,
                                   keep_from=min(committed[i], m.num_computed_tokens)) is None:
                    del active[i]
                    continue
                batch.append((m, n))
                room -= n
            if not batch:
                return active
            ids, pos, meta = self.runner.build_inputs(SchedulerOutput(batch))
            self.model(ids, pos, self.kv.layers, meta)  # (N, hidden): only the KV it writes is wanted
            for m, n in batch:
                m.num_computed_tokens += n

    def release(self, seq: Sequence) -> None:
        m = self.mirrors.pop(id(seq), None)
        if m is not None:
            self.bm.free(m.block_tables)

    def sweep(self, live: set[int]) -> None:
        """Free the mirrors of sequences that are gone."""
        for key in [k for k in self.mirrors if k not in live]:
            self.bm.free(self.mirrors.pop(key).block_tables)
