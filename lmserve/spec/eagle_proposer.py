"""The EAGLE head as a speculative proposer (spec/eagle.py has the head and its training).

What the head reads is the target's own feature (the final hidden state its LM head reads) at each
position, so the proposer watches every target step: `observe` gets the step's flattened hidden states
after verification and keeps, per sequence, the head's own KV for every position whose feature and next
token are committed (rejected drafts' rows are dropped). Only K and V of the head's layer are needed for
those positions (fc, norm, k/v projections): a few percent of a target step. The newest feature waits
(`pending`) until its next token is sampled.

`propose` then drafts k tokens per sequence, chained: the pending feature with the embedding of the last
committed token gives the head's predicted feature for the next position; its read-out through the
target's LM head is draft 1; the prediction with draft 1's embedding gives draft 2, and so on. The drafts'
KV entries are dropped after drafting (the next target step brings their true features).

Reading out through the whole LM head costs as much per draft as a fifth of the default model's step on
a CPU; as FR-Spec does, the read-out may be restricted to the most frequent tokens of the head's training
data (`draft_vocab`, saved with the head): drafts come only from that subset, and since each draft's
distribution (zero outside the subset) goes to the rejection step as q, the output stays exact.

On a CPU target whose linears run our int8 kernels (the default model), the head's linears and its
read-out run them too (weights quantized per row once, at load), and where the tile kernel applies the
whole draft runs in C (spec/eagle_native.NativeHead: ~0.33 ms a draft against 3.1 through the int8
modules, 7.8 in fp32); the module path below stays the reference. A greedy request without penalties
drafts the read-out's argmax (a point-mass proposal) without building the full-vocabulary
distribution.

State per sequence (its blocks in the pool `self.kv`, spec/eagle_native.HeadKV): Hkv x head_dim x 2
values per position (1/30 of the default model's KV), freed with the sequence. The pool is the head's
share of the engine's one KV budget (spec/build.kv_share: as many positions as the target's pool holds,
in blocks of its block size, and a chain of drafts a sequence); when a step's
sequences need more, the state of sequences outside the step goes first (`_make_room`); it grows past
its share only when that is not enough, and says so.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from lmserve.config import EngineConfig, ModelConfig
from lmserve.layers.quant import GroupQuantLinear
from lmserve.layers.rotary import RotaryEmbedding
from lmserve.sampling.sampler import Sampler, TokenView, draw, needs_processing
from lmserve.scheduler import SchedulerOutput
from lmserve.sequence import Sequence
from lmserve.spec import Proposal
from lmserve.spec.eagle import EagleHead, float_head, rms_norm
from lmserve.spec.eagle_native import HasBlocks, HeadKV, NativeHead, int8_head


BACKLOG = 256  # rows: a sequence's backlog is fed once it holds this many, drafting or not


@dataclass
class _State(HasBlocks):
    """One sequence's head KV (its blocks in the proposer's pool): entries for positions < next_pos that
    had a feature (RoPE applied), but the newest ones still in its backlog."""

    request_id: str = ""
    next_pos: int = 0  # positions below were fed (or had no feature: prefix-cache hits)
    pending: tuple[int, torch.Tensor] | None = None  # (position, feature (H,)) waiting for its next token
    rng: random.Random | None = None  # drafts' draws: seeded from the request's generator when it first drafts
    # committed rows not yet fed to the KV: (feature (H,), next token, position), in order
    backlog: list[tuple[torch.Tensor, int, int]] = field(default_factory=list)


class EagleProposer:
    """Chain drafting with an EAGLE head over the target's features."""

    def __init__(self, head: EagleHead, target: torch.nn.Module, cfg: ModelConfig, config: EngineConfig,
                 max_model_len: int, kv_budget: int = 0) -> None:
        c = head.cfg
        if c.hidden_size != cfg.hidden_size:
            raise ValueError(f"draft_model: the EAGLE head is for hidden size {c.hidden_size}, "
                             f"the target has {cfg.hidden_size}")
        self.dtype = config.torch_dtype
        self.device = torch.device(config.device)
        self.head = head.to(self.device, self.dtype).eval()
        self.target = target
        self.vocab_size = cfg.vocab_size
        lm = float_head(target)  # (V, H)
        vocab = head.draft_vocab
        if vocab is not None and (vocab.numel() == 0 or int(vocab.max()) >= cfg.vocab_size or int(vocab.min()) < 0):
            raise ValueError(f"draft_model: the head's draft_vocab does not fit the target's {cfg.vocab_size} tokens")
        self.vocab = None if vocab is None else vocab.to(self.device)  # (Vs,) token ids the drafts come from
        self.lm_head = (lm if vocab is None else lm[vocab]).to(self.device, self.dtype)  # (Vs, H)
        del lm
        self.readout: torch.nn.Module | None = None  # the read-out as an int8 layer (int8 targets on the CPU)
        if self.device.type == "cpu" and any(isinstance(m, GroupQuantLinear) and m.cpu_kernel for m in target.modules()):
            self.head, self.readout = int8_head(self.head, self.lm_head)
        # rows for every position a chain reaches: rounds run to the batch's longest k (rows past their
        # own k, near max_model_len, draft too and are dropped)
        self.rotary = RotaryEmbedding(c.head_dim, max_model_len + config.num_speculative_tokens + 1,
                                      c.rope_theta).to(self.device)
        self.sampler = Sampler()
        self.min_prob = config.spec_min_draft_prob  # a chain stops before a draft less sure than this
        self.k = config.num_speculative_tokens
        self.states: dict[int, _State] = {}
        self.kv = HeadKV.for_budget(c.num_kv_heads, c.head_dim, self.dtype, self.device, kv_budget, config.block_size)
        self.native: NativeHead | None = None  # drafting in our C kernels (int8 targets on the CPU)
        if self.readout is not None:
            ids = torch.arange(cfg.vocab_size, device=self.device) if vocab is None else self.vocab
            self.native = NativeHead.build(head, self.lm_head, target.embed(ids), self.rotary, self.dtype)

    # ---------------------------------------------------------------- the head's pieces
    def _state(self, seq: Sequence) -> _State:
        st = self.states.get(id(seq))
        if st is None or st.request_id != seq.request_id:
            if st is not None:
                self.kv.release(st)
            # no draw from seq.generator here: a request that never drafts (deterministic mode's seeded
            # sampling) keeps its random stream whatever its neighbours or chunking
            st = self.states[id(seq)] = _State([], request_id=seq.request_id)
            # an n > 1 child (forked after its parent's prefill): start from the parent's head KV over
            # the shared prompt, when it holds nothing past where the child starts
            if any(o.request_id == seq.request_id for o in self.states.values() if o is not st):
                self.flush()  # (a parent's KV complete before it is copied)
            for other in self.states.values():
                fed = other.next_pos - (other.pending is not None)
                if other is not st and other.request_id == seq.request_id and 0 < fed <= seq.num_computed_tokens:
                    self.kv.write(st, *self.kv.read(other))
                    st.next_pos = fed
                    break
        return st

    def _qkv_in(self, feats: torch.Tensor, tokens: list[int]) -> torch.Tensor:
        """fc([feature ; embed(next token)]): feats (n, H) -> (n, H)."""
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        emb = self.target.embed(ids).to(self.dtype)  # (n, H)
        return self.head.fc(torch.cat([feats.to(self.dtype), emb], -1))  # (n, H)

    def _kv(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (n, H) -> the layer's normed input (n, H), k and v (n, Hkv, d); rope: the rows' rotary.lookup."""
        c, h = self.head.cfg, self.head
        hn = rms_norm(x, h.input_layernorm, c.rms_norm_eps)
        k = self.rotary.rotate(h.k_proj(hn).view(-1, c.num_kv_heads, c.head_dim), rope)  # (n, Hkv, d)
        return hn, k, h.v_proj(hn).view(-1, c.num_kv_heads, c.head_dim)

    def _read_out(self, f: torch.Tensor) -> torch.Tensor:
        """Predicted features (B, H) -> logits (B, Vs) over the draft vocabulary (or all tokens)."""
        return (f @ self.lm_head.T if self.readout is None else self.readout(f)).float()

    def _layer(self, x: torch.Tensor, pos: torch.Tensor, states: list[_State]) -> torch.Tensor:
        """One position per state (decode): x (B, H) at positions pos (B,); each row's K/V appended to its
        state, attention over that state's entries. -> predicted features (B, H)."""
        c, h = self.head.cfg, self.head
        rope = self.rotary.lookup(pos)
        hn, k, v = self._kv(x, rope)
        q = self.rotary.rotate(h.q_proj(hn).view(-1, c.num_heads, c.head_dim), rope)  # (B, Hq, d)
        outs = []
        for i, st in enumerate(states):
            self.kv.write(st, k[i:i + 1], v[i:i + 1])
            keys, values = self.kv.read(st)  # (n, Hkv, d) each
            a = F.scaled_dot_product_attention(q[i][:, None], keys.transpose(0, 1), values.transpose(0, 1),
                                               enable_gqa=True)  # (Hq, 1, d)
            outs.append(a.reshape(1, -1))
        x = x + h.o_proj(torch.cat(outs))  # (B, H)
        hn = rms_norm(x, h.post_attention_layernorm, c.rms_norm_eps)
        return x + h.down_proj(F.silu(h.gate_proj(hn)) * h.up_proj(hn))  # (B, H)

    # ---------------------------------------------------------------- the target's side
    @torch.inference_mode()
    def observe(self, out: SchedulerOutput, hidden: torch.Tensor, rejected: dict[Sequence, int]) -> None:
        """After a target step (drafts still in the token lists): every row whose feature and next token
        are committed goes to its sequence's backlog, the newest waits as pending. hidden: (N, H) of the
        step. The backlogs are fed to the head's KV when any sequence drafts next (`flush`, before
        the drafting), or once one holds BACKLOG rows: a step whose policy drafts nothing
        (spec_policy="goodput" where speculation does not pay) costs a row's copy, not the head's fc
        and K / V projections."""
        self._make_room(out)
        rows: list[torch.Tensor] = []
        toks: list[int] = []
        pos: list[int] = []
        owners: list[_State] = []
        start = 0
        for seq, n in out.scheduled:
            rows_at, start = start, start + n
            p = seq.params
            if not p.speculative or p.use_beam_search:
                continue
            st = self._state(seq)
            committed = seq.num_tokens - rejected.get(seq, 0)  # tokens known now (the next sampled one aside)
            c = seq.num_computed_tokens
            valid = min(n, committed - c)  # rows of positions whose inputs are all committed
            if st.pending is not None:
                j, f = st.pending
                if j < c and j + 1 < committed:  # its next token is here now
                    rows.append(f[None]), toks.append(seq.token_ids[j + 1]), pos.append(j), owners.append(st)
                else:  # recomputed from before it (a preemption): it is fed when its row comes again
                    st.next_pos = min(st.next_pos, j)
                st.pending = None
            first = max(c, st.next_pos)
            for j in range(first, c + valid):
                f = hidden[rows_at + j - c]
                if j + 1 < committed:
                    rows.append(f[None]), toks.append(seq.token_ids[j + 1]), pos.append(j), owners.append(st)
                else:
                    st.pending = (j, f.to(self.dtype, copy=True))
            st.next_pos = max(st.next_pos, c + valid)
        if not rows:
            return
        feats = torch.cat(rows).to(self.dtype)  # (R, H): a copy, not the step's buffer
        for i, st in enumerate(owners):
            st.backlog.append((feats[i], toks[i], pos[i]))
        if any(len(st.backlog) >= BACKLOG for st in owners):
            self.flush()

    def _make_room(self, out: SchedulerOutput) -> None:
        """Before a step's rows go in: when the pool's free blocks may not hold what the step's sequences
        add (their rows and backlogs, a chain of drafts), the head state of sequences outside the step goes
        first, largest first (a recompute-preempted one's rows come back with its recompute and are fed
        again; a swapped-out one drafts from the positions after its return). The pool grows past its
        share of the KV budget only when that is not enough (it grew at once before: preempted sequences
        kept their state while others took the target blocks they freed)."""
        B, need = self.kv.block, 0
        for seq, n in out.scheduled:
            st = self.states.get(id(seq))
            held, blocks = (st.length + len(st.backlog), len(st.blocks)) if st is not None else (0, 0)
            need += max(0, -(-(held + n + self.k + 1) // B) - blocks)
        if len(self.kv.free) >= need:
            return
        stepping = {id(seq) for seq, _ in out.scheduled}
        for key, st in sorted(self.states.items(), key=lambda kv: -len(kv[1].blocks)):
            if len(self.kv.free) >= need or not st.blocks:
                break
            if key not in stepping:
                self.kv.release(st)
                st.next_pos, st.pending, st.backlog = 0, None, []

    @torch.inference_mode()
    def flush(self) -> None:
        """Feed every backlog to the head's KV, in one batch (a state's rows consecutive, in order)."""
        owners = [st for st in self.states.values() for _ in st.backlog]
        if not owners:
            return
        rows = [r for st in self.states.values() for r in st.backlog]
        for st in self.states.values():
            st.backlog = []
        feats, toks, pos = torch.stack([f for f, _, _ in rows]), [t for _, t, _ in rows], [p for _, _, p in rows]
        if self.native is not None:
            ids = torch.tensor(toks, dtype=torch.long, device=self.device)
            self.native.feed(self.kv, owners, feats, self.target.embed(ids), pos)
            return
        x = self._qkv_in(feats, toks)  # (R, H)
        _, k, v = self._kv(x, self.rotary.lookup(torch.tensor(pos, device=self.device)))  # (R, Hkv, d)
        i = 0
        while i < len(owners):  # consecutive rows of one state go in one write
            j = i
            while j < len(owners) and owners[j] is owners[i]:
                j += 1
            self.kv.write(owners[i], k[i:j], v[i:j])
            i = j

    # ---------------------------------------------------------------- drafting
    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        props = [Proposal([]) for _ in seqs]
        self.flush()  # the KV complete up to each sequence's pending row (SpecPolicy flushed it already)
        active = []  # (index, state, committed entries)
        feats, toks, pos = [], [], []
        for i, (seq, k) in enumerate(zip(seqs, ks)):
            st = self.states.get(id(seq))
            last = seq.num_tokens - 2
            if k <= 0 or st is None or st.request_id != seq.request_id or st.pending is None \
                    or st.pending[0] != last:
                continue
            if st.rng is None:
                st.rng = random.Random(seq.generator.getrandbits(62))
            feats.append(st.pending[1][None]), toks.append(seq.token_ids[-1]), pos.append(last)
            st.pending, st.next_pos = None, last + 1  # fed now, for good: its next token is committed
            active.append((i, st, st.length + 1))
        if not active:
            return props
        if self.native is not None:
            return self._propose_native(seqs, ks, props, active, torch.cat(feats), toks, pos)
        drafts: dict[int, list[int]] = {i: [] for i, _, _ in active}
        probs: dict[int, list[torch.Tensor | None]] = {i: [] for i, _, _ in active}  # None: a greedy argmax
        started = list(active)
        x = self._qkv_in(torch.cat(feats), toks)  # (B, H)
        p_t = torch.tensor(pos, device=self.device)
        try:
            for r in range(max(ks)):
                f = self._layer(x, p_t, [st for _, st, _ in active])  # (B, H) predicted features
                logits = self._read_out(f)  # (B, Vs)
                p: torch.Tensor | None = None
                if all(seqs[i].params.temperature == 0 and not needs_processing(seqs[i]) for i, _, _ in active):
                    best = logits.argmax(-1)  # (B,) plain greedy: the argmax, a point mass
                    new = (best if self.vocab is None else self.vocab[best]).tolist()
                    cut = self._unsure(torch.softmax(logits, -1))
                else:
                    p = self._probs(logits, seqs, active, drafts)  # (B, V)
                    cut = self._unsure(p)  # decided before the draw: exactness
                    gens = [None if seqs[i].params.temperature == 0 or cut[row] else st.rng
                            for row, (i, st, _) in enumerate(active)]  # (no draw for a chain's end)
                    new = draw(p, gens).tolist()
                keep = []
                for row, ((i, st, base), tok) in enumerate(zip(active, new)):
                    if cut[row]:
                        continue  # the chain ends before this draft
                    drafts[i].append(tok)
                    probs[i].append(None if p is None else p[row])
                    if len(drafts[i]) < ks[i]:
                        keep.append(row)
                if not keep or r + 1 == max(ks):
                    break
                active = [active[j] for j in keep]
                x = self._qkv_in(f[keep], [new[j] for j in keep])
                p_t = p_t[keep] + 1
        finally:  # the drafts' KV entries go: only committed positions stay
            for _, st, base in started:
                st.length = min(st.length, base)
        for i, d in drafts.items():
            rows = probs[i]
            if not d:
                continue  # its chain ended before its first draft
            if all(r is None for r in rows):
                props[i] = Proposal(d)  # point masses
            else:
                props[i] = Proposal(d, torch.stack([self._one_hot(t) if r is None else r for t, r in zip(d, rows)]))
        return props

    def _propose_native(self, seqs: list[Sequence], ks: list[int], props: list[Proposal], active: list,
                        feats: torch.Tensor, toks: list[int], pos: list[int]) -> list[Proposal]:
        """`propose`'s drafting through NativeHead: plain greedy rows in one call (the argmax chain in C),
        others a call a draft, sampled here. Every row runs the longest k (a row's drafts past its own k
        are dropped)."""
        rounds = max(ks[i] for i, _, _ in active)
        run = self.native.start(self.kv, [st for _, st, _ in active], feats, pos, rounds)  # type: ignore[union-attr]
        embeds = self.target.embed(torch.tensor(toks, dtype=torch.long, device=self.device))  # (B, H)
        try:
            if all(seqs[i].params.temperature == 0 and not needs_processing(seqs[i]) for i, _, _ in active):
                idx = run.step(embeds, rounds, self.min_prob)  # (r, B) read-out indices, r <= rounds
                chains = (idx if self.vocab is None else self.vocab[idx]).T.tolist()  # (B, r) tokens
                sure = (run.probs >= self.min_prob).int().cumprod(0).sum(0).tolist()  # (B,) confident drafts
                for row, ((i, _, _), d) in enumerate(zip(active, chains)):
                    props[i] = Proposal(d[:min(ks[i], sure[row])])  # point masses
                return props
            drafts: dict[int, list[int]] = {i: [] for i, _, _ in active}
            probs: dict[int, list[torch.Tensor]] = {i: [] for i, _, _ in active}
            ended = [False] * len(active)  # rows whose chain stopped before a draft less sure than min_prob
            for _ in range(rounds):
                run.step(embeds)
                p = self._probs(run.logits, seqs, active, drafts)  # (B, V)
                ended = [e or c for e, c in zip(ended, self._unsure(p))]  # decided before the draw: exactness
                live = [not ended[row] and len(drafts[i]) < ks[i] for row, (i, _, _) in enumerate(active)]
                if not any(live):
                    break
                new = draw(p, [st.rng if live[row] and seqs[i].params.temperature != 0 else None
                               for row, (i, st, _) in enumerate(active)])  # a draw only where it counts
                for row, (i, _, _) in enumerate(active):
                    if live[row]:
                        drafts[i].append(int(new[row]))
                        probs[i].append(p[row])
                embeds = self.target.embed(new.to(self.device))
            for i, d in drafts.items():
                if d:
                    props[i] = Proposal(d, torch.stack(probs[i]))
            return props
        finally:  # the drafts' entries go: the first (the pending feature's) stays, if it was made
            for row, (_, st, base) in enumerate(active):
                st.length = min(int(run.lens[row]), base)

    def _probs(self, logits: torch.Tensor, seqs: list[Sequence], active: list, drafts: dict[int, list[int]]
               ) -> torch.Tensor:
        """The distributions the active rows draw from (B, V): the sampler's, over the whole vocabulary (zero
        outside the draft vocabulary), penalties seeing each row's drafts so far."""
        if self.vocab is not None:
            logits = torch.full((len(active), self.vocab_size), float("-inf"),
                                device=self.device).index_copy_(1, self.vocab, logits)  # (B, V)
        views = []
        for i, _, _ in active:
            seqs[i].token_ids.extend(drafts[i])  # penalties see the drafts so far (taken back below)
            views.append(TokenView(seqs[i], seqs[i].num_tokens))
        try:
            return self.sampler.target_probs(logits, views)  # (B, V)
        finally:
            for i, _, _ in active:
                if drafts[i]:
                    del seqs[i].token_ids[-len(drafts[i]):]

    def _unsure(self, p: torch.Tensor) -> list[bool]:
        """Per row of draft distributions p (B, V'): the chain ends before this draft where its top
        probability is below min_prob (never with min_prob 0), or where it is no distribution (NaN: no
        allowed token in the draft vocabulary; drawn from, it put a forbidden token through)."""
        cut = ~torch.isfinite(p).all(-1)  # (B,)
        if self.min_prob:
            cut |= p.amax(-1) < self.min_prob
        return cut.tolist()

    def _one_hot(self, token: int) -> torch.Tensor:  # (V,)
        return torch.zeros(self.vocab_size, device=self.device).index_fill_(0, torch.tensor([token], device=self.device), 1.0)

    def release(self, seq: Sequence) -> None:
        st = self.states.pop(id(seq), None)
        if st is not None:
            self.kv.release(st)
