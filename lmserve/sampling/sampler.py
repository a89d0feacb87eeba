"""Batched sampling with per-request parameters.

Order of logit processing (as vLLM v1 does): a structured-output request's grammar bitmask (tokens
it forbids -inf), logit_bias, min_tokens masking of stop tokens (unless the grammar allows nothing
else: a complete constraint ends the output), then the
penalties (repetition on prompt+output, then frequency and presence on output) on the biased logits,
then greedy argmax or temperature -> top-k -> top-p -> min-p -> sample.

Sampling is by inverse CDF: one uniform u per row from that sequence's own random.Random, and the
token is the first whose cumulative probability (float64) exceeds u. It costs one random number per
row, not one per vocabulary entry. On CUDA, rows without top-k / top-p / min-p are drawn instead by
the Gumbel-max trick in one Triton pass over the logits (sampling/gumbel.py), with a Philox seed per
row from the same per-sequence generator. The method is chosen per row from that row's params (and
the device) alone, so a seeded request draws the same tokens whatever else is in the batch (CUDA
and the CPU give different, equally distributed, tokens for one seed). With speculation the draws
follow the drafts, whose number follows the batch: `deterministic=True` keeps seeded sampled
requests out of speculation (spec/policy.py). Logprobs are the model's raw
log-softmax (before any processing), as vLLM and OpenAI report them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from lmserve.layers.cpu_fused import argmax
from lmserve.layers.linear import row_blocks
from lmserve.sequence import Logprob, SamplingParams, Sequence, bad_words_next
from lmserve.structured import apply_bitmask
from lmserve.utils import to_device, triton_available


def gumbel_sample(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """The Triton Gumbel-max kernel (imported on first use: Triton is optional on the CPU)."""
    from lmserve.sampling.gumbel import gumbel_sample as kernel
    return kernel(logits, temperatures, seeds)


@dataclass
class SamplerOutput:
    """One sampled token (and optional logprobs) per input row."""

    token_ids: list[int]
    logprobs: list[Logprob | None]


def apply_penalties(logits: torch.Tensor, seqs: list) -> torch.Tensor:  # type: ignore[type-arg]
    """allowed_token_ids, bad_words, logit_bias, min_tokens, then repetition / frequency / presence
    penalties, in place. logits: (B, V).

    The order is vLLM v1's: the penalties see the biased logits. Built on the host as flat
    (row, token) lists: one gather/scatter per kind for the whole batch."""
    allow: list[tuple[int, list[int]]] = []  # row, the only tokens it may take
    never: tuple[list[int], list[int]] = ([], [])  # row, token -> -inf (bad words)
    bias: tuple[list[int], list[int], list[float]] = ([], [], [])  # row, token, logit_bias
    ban: tuple[list[int], list[int]] = ([], [])  # row, token -> -inf
    rep: tuple[list[int], list[int], list[float]] = ([], [], [])  # row, token, penalty
    add: tuple[list[int], list[int], list[float]] = ([], [], [])  # row, token, -(frequency + presence)
    for i, s in enumerate(seqs):
        p = s.params
        if p.allowed_token_ids:
            allow.append((i, p.allowed_token_ids))
        for tok in bad_words_next(p, s.output_token_ids):
            never[0].append(i), never[1].append(tok)
        if p.logit_bias:
            bias[0].extend([i] * len(p.logit_bias))
            bias[1].extend(p.logit_bias)
            bias[2].extend(p.logit_bias.values())
        if s.num_output_tokens < p.min_tokens:
            stops = list(p.stop_token_ids) + list(s.eos_token_ids)  # (ignore_eos too: as vLLM, EOS waits for min_tokens)
            ban[0].extend([i] * len(stops))
            ban[1].extend(stops)
        if p.repetition_penalty != 1.0:
            seen = set(s.token_ids)
            rep[0].extend([i] * len(seen))
            rep[1].extend(seen)
            rep[2].extend([p.repetition_penalty] * len(seen))
        if p.presence_penalty or p.frequency_penalty:
            for tok, count in Counter(s.output_token_ids).items():
                add[0].append(i)
                add[1].append(tok)
                add[2].append(-(p.frequency_penalty * count + p.presence_penalty))
    dev = logits.device
    for i, ids in allow:  # vLLM's order: the allowed tokens, the bad words, then biases and penalties
        idx = to_device(torch.tensor(ids), dev)  # (K,)
        keep = logits[i].index_select(0, idx)  # (K,)
        logits[i] = float("-inf")
        logits[i].index_copy_(0, idx, keep)
    if never[0]:
        idx = to_device(torch.tensor(never), dev)  # (2, K)
        logits[idx[0], idx[1]] = float("-inf")
    if bias[0]:
        idx = to_device(torch.tensor(bias[:2]), dev)  # (2, K)
        logits.index_put_((idx[0], idx[1]), to_device(torch.tensor(bias[2], dtype=logits.dtype), dev),
                          accumulate=True)
    if ban[0]:
        idx = to_device(torch.tensor(ban), dev)  # (2, K)
        saved = logits[idx[0], idx[1]]  # (K,)
        logits[idx[0], idx[1]] = float("-inf")
        # a row left with no finite logit (a grammar that allows only the stop token now) keeps its
        # stop tokens: the grammar wins over min_tokens, as a finished constraint must end the output
        rows = idx[0].unique()  # (R,) the rows with a ban
        dead_rows = rows[torch.isneginf(logits[rows]).all(dim=-1)]  # rows left with no finite logit
        if dead_rows.numel():
            dead = torch.isin(idx[0], dead_rows)  # (K,) banned entries in those rows
            logits[idx[0][dead], idx[1][dead]] = saved[dead]
    if rep[0]:
        idx = to_device(torch.tensor(rep[:2]), dev)  # (2, K)
        pen = to_device(torch.tensor(rep[2], dtype=logits.dtype), dev)  # (K,)
        vals = logits[idx[0], idx[1]]  # (K,)
        logits[idx[0], idx[1]] = torch.where(vals > 0, vals / pen, vals * pen)
    if add[0]:
        idx = to_device(torch.tensor(add[:2]), dev)  # (2, K)
        logits.index_put_((idx[0], idx[1]), to_device(torch.tensor(add[2], dtype=logits.dtype), dev),
                          accumulate=True)
    return logits


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                  invariant: bool = False) -> torch.Tensor:
    """Mask (to -inf) tokens outside top-k / top-p / min-p, per row. logits: (B, V); params: (B,).

    top_k <= 0 means off; top_p = 1 and min_p = 0 mean off, so a row with none of them keeps every
    token whatever its neighbours ask. Tokens tied with the k-th stay (as HF's and vLLM's top-k keep
    them). The most likely token always survives.
    """
    B, V = logits.shape
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # (B, V)
    k = torch.where(top_k > 0, top_k, V).clamp(max=V).unsqueeze(1)  # (B, 1)
    drop = sorted_logits < sorted_logits.gather(1, k - 1)  # below the k-th largest
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)  # (B, V)
    before = running_sum(probs, invariant) - probs  # mass strictly before each token
    # top_p = 1 is off: a float32 running sum reaches 1 before the vocabulary's tail does
    drop |= (before >= top_p.unsqueeze(1)) & (top_p.unsqueeze(1) < 1)
    drop |= probs < (min_p.unsqueeze(1) * probs[:, :1])
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def needs_processing(s: Sequence) -> bool:
    p = s.params
    return (p.repetition_penalty != 1.0 or bool(p.presence_penalty) or bool(p.frequency_penalty)
            or bool(p.logit_bias) or s.num_output_tokens < p.min_tokens or bool(p.allowed_token_ids)
            or bool(p.bad_words_token_ids))


@dataclass
class TokenView:
    """A sequence as it stands at one position: what penalties see when scoring token `upto`.

    Speculative verification scores several positions of one sequence in a step; position i must
    be processed as if the drafts before it were already output.
    """

    seq: Sequence
    upto: int  # number of tokens before the predicted one

    @property
    def params(self):  # type: ignore[no-untyped-def]
        return self.seq.params

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids[:self.upto]

    @property
    def output_token_ids(self) -> list[int]:
        return self.seq.token_ids[self.seq.num_prompt_tokens:self.upto]

    @property
    def num_output_tokens(self) -> int:
        return self.upto - self.seq.num_prompt_tokens

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.seq.eos_token_ids

    @property
    def generator(self):  # type: ignore[no-untyped-def]
        return self.seq.generator


class Sampler:
    """Turns the last-position logits of each sampling sequence into its next token.

    Everything decided per row (greedy or not, temperature, filters, the random numbers) is known on
    the host: it reaches the device as one small tensor per kind, and the step's one device-to-host
    sync is reading back the chosen tokens. The method is chosen per row, from that row's params
    alone: on CUDA a row without top-k / top-p / min-p is sampled by the one-pass Gumbel-max kernel
    (sampling/gumbel.py) and a row with them by inverse CDF; elsewhere every row by inverse CDF.
    """

    def __init__(self, gumbel: bool | None = None, invariant: bool = False) -> None:
        self.gumbel = gumbel  # None: on CUDA when Triton imports
        self.invariant = invariant  # deterministic mode: running sums a row's own way (running_sum)

    def _use_gumbel(self, logits: torch.Tensor) -> bool:
        if self.gumbel is not None:
            return self.gumbel
        return logits.is_cuda and triton_available()

    @staticmethod
    def _penalized(logits: torch.Tensor, seqs: list, bitmask: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[type-arg]
        """The grammar's bitmask (structured output: disallowed tokens -inf), then biases and penalties;
        a copy when anything applies."""
        if bitmask is not None:
            logits = apply_bitmask(logits.clone(), bitmask)
            return apply_penalties(logits, seqs) if any(needs_processing(s) for s in seqs) else logits
        if any(needs_processing(s) for s in seqs):
            return apply_penalties(logits.clone(), seqs)
        return logits

    def target_probs(self, logits: torch.Tensor, seqs: list,  # type: ignore[type-arg]
                     bitmask: torch.Tensor | None = None) -> torch.Tensor:
        """The distribution each row samples from, after all processing: (B, V) float32.
        Greedy rows are one-hot at their (processed) argmax. bitmask: (B, W) int32 allowed tokens."""
        return self._probs(self._penalized(logits, seqs, bitmask), [s.params for s in seqs], self.invariant)

    def target_argmax(self, logits: torch.Tensor, seqs: list,  # type: ignore[type-arg]
                      bitmask: torch.Tensor | None = None) -> list[int]:
        """Greedy rows' tokens after all processing (B,): the argmax of target_probs, without building
        its one-hot rows (a greedy verification's only need)."""
        return argmax(self._penalized(logits, seqs, bitmask)).tolist()

    @staticmethod
    def _probs(logits: torch.Tensor, params: list[SamplingParams], invariant: bool = False) -> torch.Tensor:
        """target_probs of logits (B, V) that already carry their penalties -> (B, V)."""
        any_greedy = any(p.temperature == 0 for p in params)
        if any_greedy:
            probs = torch.zeros_like(logits).scatter_(1, argmax(logits).unsqueeze(1), 1.0)  # (B, V)
            if all(p.temperature == 0 for p in params):
                return probs
        filtered = any(p.has_filters for p in params)
        rows = [(float(p.temperature == 0), p.temperature or 1.0, p.top_k, p.top_p, p.min_p) for p in params]
        host = torch.tensor(rows if filtered else [r[:2] for r in rows], dtype=torch.float32)  # (B, 5 or 2)
        cols = to_device(host, logits.device).unbind(1)
        greedy, temps = cols[0] > 0, cols[1]  # (B,) each
        scaled = logits / temps.unsqueeze(1)  # (B, V)
        if filtered:
            scaled = filter_logits(scaled, cols[2].long(), cols[3], cols[4], invariant)
        if not any_greedy:  # (B, V) passes over the vocabulary are the sampler's cost at large batches
            return scaled.softmax(dim=-1)
        return torch.where(greedy.unsqueeze(1), probs, scaled.softmax(dim=-1))

    def _inverse_cdf(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Penalized logits (B, V) -> tokens (B,): one uniform per sampled row from its generator."""
        params = [s.params for s in seqs]
        return draw(self._probs(logits, params, self.invariant), [None if p.temperature == 0 else s.generator
                                                                  for s, p in zip(seqs, params)], self.invariant)

    @staticmethod
    def _gumbel(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Penalized logits (B, V) -> tokens (B,) by the Gumbel-max kernel: one Philox seed per
        sampled row from its generator; greedy rows (T = 0) take the plain argmax."""
        temps = [s.params.temperature for s in seqs]
        host = torch.tensor([temps, [float(s.generator.getrandbits(52)) if t else 0.0 for s, t in zip(seqs, temps)]],
                            dtype=torch.float64)  # (2, B): temperature, Philox seed
        t, seeds = to_device(host, logits.device).unbind(0)  # (B,) each
        return gumbel_sample(logits, t.float(), seeds.long())

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence], bitmask: torch.Tensor | None = None
                 ) -> SamplerOutput:
        """logits: (B, V) float32, one row per sequence in `seqs`; bitmask: (B, W) int32, the tokens
        each row may take (structured output), or None.

        A row's token depends only on its own params, logits and generator, never on the rest of the
        batch: the rows are split by method, one kernel call for the Gumbel rows and one inverse-CDF
        draw for the rest, and the tokens put back in batch order."""
        B = logits.shape[0]
        want_lp = [(s.params.logprobs or 0) if s.params.needs_logprob else None for s in seqs]
        raw_logprobs = logits.log_softmax(dim=-1) if any(n is not None for n in want_lp) else None  # (B, V)
        params = [s.params for s in seqs]
        if all(p.temperature == 0 for p in params):
            tokens = argmax(self._penalized(logits, seqs, bitmask))
        else:
            logits = self._penalized(logits, seqs, bitmask)
            use_gumbel = self._use_gumbel(logits)
            kernel = [use_gumbel and p.temperature != 0 and not p.has_filters for p in params]  # Gumbel-max rows
            cdf = [p.temperature != 0 and not k for p, k in zip(params, kernel)]  # inverse-CDF rows
            if not any(kernel):
                tokens = self._inverse_cdf(logits, seqs)  # greedy rows too (argmax in draw)
            elif not any(cdf):
                tokens = self._gumbel(logits, seqs)  # greedy rows too (T = 0: a plain argmax)
            else:  # both methods: greedy rows ride in the kernel call
                rows = [i for i in range(B) if not cdf[i]] + [i for i in range(B) if cdf[i]]
                G = B - sum(cdf)
                order = to_device(torch.tensor(rows), logits.device)  # (B,): Gumbel rows, then inverse-CDF rows
                picked = torch.cat([self._gumbel(logits.index_select(0, order[:G]), [seqs[i] for i in rows[:G]]),
                                    self._inverse_cdf(logits.index_select(0, order[G:]), [seqs[i] for i in rows[G:]])
                                    ])  # (B,) in `rows` order
                tokens = torch.empty_like(picked).index_copy_(0, order, picked)  # (B,) in batch order
        if raw_logprobs is None:
            return SamplerOutput(tokens.tolist(), [None] * B)
        return SamplerOutput(*read_logprobs(raw_logprobs, tokens, want_lp))


def read_logprobs(raw: torch.Tensor, tokens: torch.Tensor, want: list[int | None]
                  ) -> tuple[list[int], list[Logprob | None]]:
    """Tokens (B,) and, for rows whose `want` is not None, the chosen token's logprob and the top-N
    alternatives from raw (B, V) log-softmax, read back in one transfer."""
    B = tokens.shape[0]
    rows = [i for i, n in enumerate(want) if n is not None]
    top = max(want[i] or 0 for i in rows)
    r = to_device(torch.tensor(rows), raw.device)  # (R,)
    sub = raw.index_select(0, r)  # (R, V)
    parts = [tokens.double(), sub.gather(1, tokens.index_select(0, r).unsqueeze(1)).squeeze(1).double()]
    if top > 0:
        vals, ids = sub.topk(top, dim=-1)  # (R, top) each
        parts += [vals.double().flatten(), ids.double().flatten()]
    flat = torch.cat(parts).tolist()  # the one device-to-host read; token ids are exact in float64
    token_list = [int(t) for t in flat[:B]]
    R = len(rows)
    chosen = flat[B:B + R]
    vals_l, ids_l = flat[B + R:B + R + R * top], flat[B + R + R * top:]
    logprobs: list[Logprob | None] = [None] * B
    for j, i in enumerate(rows):
        n = want[i] or 0
        alts = {int(ids_l[j * top + m]): vals_l[j * top + m] for m in range(n)}
        logprobs[i] = Logprob(token_list[i], chosen[j], alts)
    return token_list, logprobs


def running_sum(x: torch.Tensor, invariant: bool = False) -> torch.Tensor:
    """x.cumsum(dim=-1) for (B, V); invariant (deterministic mode): each row summed the same way whatever
    the batch, on CUDA over fixed blocks of rows (torch's scan picks its threads by the number of rows,
    and hands a lone row to CUB's look-back scan, so a row's sums, and a top-p cut or a draw on them,
    followed the batch). The CPU's scan is a row's own already."""
    return row_blocks(lambda t: t.cumsum(dim=-1), x) if invariant and x.is_cuda else x.cumsum(dim=-1)


def draw(probs: torch.Tensor, generators: list, invariant: bool = False) -> torch.Tensor:  # type: ignore[type-arg]
    """Inverse-CDF draw per row with that row's random.Random (None: argmax). probs: (B, V) -> (B,).

    The uniforms are drawn on the host and sent in one copy, with the greedy mask."""
    host = torch.tensor([[g.random() if g is not None else 0.0 for g in generators],
                         [float(g is None) for g in generators]], dtype=torch.float64)  # (2, B)
    u, is_greedy = to_device(host, probs.device).unbind(0)  # (B,) each
    cdf = running_sum(probs.double(), invariant)  # (B, V)
    drawn = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)  # (B,)
    drawn.clamp_(max=probs.shape[1] - 1)
    if all(g is not None for g in generators):
        return drawn
    return torch.where(is_greedy > 0, probs.argmax(dim=-1), drawn)


def make_logprob(row: torch.Tensor, token_id: int, top_n: int) -> Logprob:
    """The chosen token's logprob and the top_n alternatives from a (V,) log-softmax row."""
    top: dict[int, float] = {}
    if top_n > 0:
        vals, ids = row.topk(top_n)
        top = dict(zip(ids.tolist(), vals.tolist()))
    return Logprob(token_id, float(row[token_id]), top)
