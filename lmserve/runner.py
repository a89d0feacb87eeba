"""ModelRunner: SchedulerOutput -> flat tensors + AttentionMetadata -> model -> logits -> tokens.

The only place per-step tensors are built. Every scheduled sequence contributes its new tokens
(token_ids[num_computed : num_computed + n]) to one flat batch; a sequence samples this step only if
those tokens reach its end (a finished prefill or a decode), and only those rows go through the
LM head.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from itertools import accumulate

import torch

from lmserve.attention import AttentionMetadata, pack_block_tables
from lmserve.config import EngineConfig, ModelConfig
from lmserve.graphs import DecodeGraphs
from lmserve.kv.block_manager import BlockManager
from lmserve.kv.cache import KVCache, slots
from lmserve.kv.swap import HostSwap
from lmserve.sampling.rejection import verify, verify_greedy
from lmserve.sampling.sampler import Sampler, TokenView, make_logprob, read_logprobs
from lmserve.scheduler import SchedulerOutput
from lmserve.sequence import Logprob, SamplingParams, Sequence
from lmserve.structured import StructuredOutputs
from lmserve.utils import to_device

log = logging.getLogger("lmserve")


@dataclass
class RunnerOutput:
    """Tokens to append per sequence that reached its end this step (one, or several when drafts
    were accepted), and how many draft tokens each speculating sequence must roll back."""

    sampled: dict[Sequence, list[int]]
    rejected: dict[Sequence, int] = field(default_factory=dict)
    # the sampled tokens' logprobs, aligned with `sampled`, for sequences that need them (logprobs
    # asked for, or best_of ranking); the engine records those of the tokens it keeps
    logprobs: dict[Sequence, list[Logprob]] = field(default_factory=dict)
    beam: dict[Sequence, torch.Tensor] = field(default_factory=dict)  # beam sequence -> (V,) next-token log-probs
    hidden: torch.Tensor | None = None  # (N, hidden) the step's final hidden states (an EAGLE head reads them)


class ModelRunner:
    """Owns the model and the KV cache tensors; executes one scheduled step."""

    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, device: str | torch.device,
                 structured: StructuredOutputs | None = None) -> None:
        self.model = model
        self.structured = structured  # grammar bitmasks of structured-output sequences
        self.kv_cache = kv_cache
        self.swap = HostSwap(kv_cache)  # host copies of swapped-out sequences' blocks
        self.block_size = kv_cache.block_size
        self.device = torch.device(device)
        self.sampler = Sampler(invariant=getattr(model, "batch_invariant", False))  # (deterministic mode)
        self.graphs: DecodeGraphs | None = None  # set by enable_graphs: decode steps replay CUDA graphs
        self.lora = getattr(model, "lora", None)  # enable_lora: the step's adapter rows (lora.LoRAContext)

    def enable_graphs(self, sizes: list[int], max_model_len: int, capture: bool = True) -> float:
        """Run one-token-per-sequence steps through DecodeGraphs; returns the capture time (s).
        capture=False runs that padded static path without graphs (the CPU check of it)."""
        self.graphs = DecodeGraphs(self.model, self.kv_cache, sizes, max_model_len, capture=capture)
        return self.graphs.capture_all()

    def forward(self, out: SchedulerOutput) -> torch.Tensor:
        """The model over the step's flattened tokens: hidden states (N, hidden), from a CUDA graph
        when the step is all single-token sequences and fits one, else eagerly (a step with LoRA
        adapter rows: always eagerly)."""
        lora = self.lora is not None and self.lora.begin(out.scheduled, self.device)
        try:
            if self.graphs is not None and not lora and self.graphs.can_run(out):
                return self.graphs.run(out)
            input_ids, positions, meta = self.build_inputs(out)
            return self.model(input_ids, positions, self.kv_cache.layers, meta)  # (N, hidden)
        finally:
            if lora:
                self.lora.end()

    def build_inputs(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flatten the step: input_ids (N,), positions (N,), metadata. Host lists first, then one
        tensor each (block tables through numpy: the largest of them)."""
        bs = self.block_size
        groups = self.kv_cache.groups.num_groups
        ids: list[int] = []
        pos: list[int] = []
        slot_ids: list[list[int]] = [[] for _ in range(groups)]  # per KV group
        qlens: list[int] = []
        seqlens: list[int] = []
        for seq, n in out.scheduled:
            c = seq.num_computed_tokens
            ids.extend(seq.token_ids[c:c + n])
            pos.extend(range(c, c + n))
            for g, bt in enumerate(seq.block_tables):
                slot_ids[g].extend(slots(bt, c, n, bs))
            qlens.append(n)
            seqlens.append(c + n)
        dev = self.device
        qsl = [0, *accumulate(qlens)]
        n, b = len(ids), len(qlens)
        flat = to_device(torch.tensor(ids + pos + qsl + seqlens + [s for g in slot_ids for s in g], dtype=torch.long),
                         dev)  # one copy
        input_ids, positions, query_start_loc, seq_lens, *slot_mapping = flat.split([n, n, b + 1, b] + [n] * groups)
        tables = [to_device(pack_block_tables([s.block_tables[g] for s, _ in out.scheduled]), dev)
                  for g in range(groups)]  # (B, M_g) each
        meta = AttentionMetadata(
            slot_mapping=slot_mapping[0], query_start_loc=query_start_loc, seq_lens=seq_lens,
            block_tables=tables[0], positions=positions, block_size=bs, query_lens_host=qlens,
            seq_lens_host=seqlens, groups=tuple(zip(slot_mapping, tables)) if groups > 1 else (),
            layer_groups=self.kv_cache.layer_groups if groups > 1 else ())
        return input_ids, positions, meta

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """One step: copy-on-write copies, the forward, sampling / verification. (A step's swaps, which
        come first, are Engine.step's call to self.swap.apply.)"""
        self.kv_cache.copy_blocks(out.block_copies)
        masks = self._grammar_masks(out)  # filled on a worker thread while the forward runs
        hidden = self.forward(out)  # (N, hidden)
        bitmasks = masks.result() if masks is not None else {}
        rows: list[int] = []
        sampling: list[Sequence] = []
        speculating: list[tuple[Sequence, int, int]] = []
        start = 0
        for seq, n in out.scheduled:
            if seq.params.prompt_logprobs is not None and seq.num_computed_tokens < seq.num_prompt_tokens:
                self._prompt_logprobs(seq, hidden[start:start + n], n)
            if seq.pooled is not None:  # an embedding request: the states its pooling needs
                seq.pooled.add(seq.num_computed_tokens, hidden[start:start + n])
            if seq.spec.num_draft:
                speculating.append((seq, start, n))
            elif seq.num_computed_tokens + n == seq.num_tokens:
                rows.append(start + n - 1)
                sampling.append(seq)
            start += n
        result = RunnerOutput({}, hidden=hidden)
        if sampling:
            last = hidden[:len(rows)] if rows[-1] == len(rows) - 1 else hidden[rows]  # (B, hidden); rows ascend
            logits = self.model.compute_logits(last)  # (B, V) float32
            beam = [i for i, s in enumerate(sampling) if s.params.use_beam_search]
            if beam:  # beam search decides from log-probs, in the engine, per request
                lps = logits[beam].log_softmax(dim=-1)  # (Bb, V)
                for j, i in enumerate(beam):
                    result.beam[sampling[i]] = lps[j]
                keep = [i for i in range(len(sampling)) if not sampling[i].params.use_beam_search]
                sampling, logits = [sampling[i] for i in keep], logits[keep]
        if sampling:
            bitmask = None
            if bitmasks:
                bitmask = torch.full((len(sampling), self.structured.width), -1, dtype=torch.int32)  # (B, W)
                for i, seq in enumerate(sampling):
                    if seq in bitmasks:
                        bitmask[i] = bitmasks[seq][0]
            res = self.sampler(logits, sampling, bitmask)
            for seq, tok, lp in zip(sampling, res.token_ids, res.logprobs):
                result.sampled[seq] = [tok]
                if lp is not None:
                    result.logprobs[seq] = [lp]
        for seq, start, n in speculating:
            self._verify(seq, hidden[start:start + n], result, bitmasks.get(seq))
        return result

    def _grammar_masks(self, out: SchedulerOutput):  # type: ignore[no-untyped-def]
        """Start filling the bitmask rows of the step's structured-output sequences that sample (one
        row, or one per verified position); None when there are none."""
        if self.structured is None:
            return None
        rows = [(seq, seq.token_ids[seq.num_tokens - seq.spec.num_draft:] if seq.spec.num_draft else [])
                for seq, n in out.scheduled
                if seq.grammar is not None and seq.num_computed_tokens + n == seq.num_tokens]
        return self.structured.fill_async(rows) if rows else None

    def _verify(self, seq: Sequence, hidden: torch.Tensor, result: RunnerOutput,
                bitmask: torch.Tensor | None = None) -> None:
        """Score the last committed token and the drafts in one pass, then rejection-sample."""
        k = seq.spec.num_draft
        base = seq.num_tokens - k  # committed tokens
        logits = self.model.compute_logits(hidden)  # (k+1, V): row i predicts token base + i
        views = [TokenView(seq, base + i) for i in range(k + 1)]
        drafts = seq.token_ids[base:]
        if seq.params.temperature == 0:  # the processed argmax decides: no (k+1, V) one-hot rows
            tokens, accepted = verify_greedy(self.sampler.target_argmax(logits, views, bitmask), drafts)
        else:
            probs = self.sampler.target_probs(logits, views, bitmask)  # (k+1, V); bitmask (k+1, W) or None
            tokens, accepted = verify(probs, drafts, seq.spec.draft_probs, seq.generator, False)
        result.sampled[seq] = tokens
        result.rejected[seq] = k - accepted
        if seq.params.needs_logprob:
            raw = logits.log_softmax(dim=-1)  # (k+1, V)
            result.logprobs[seq] = [make_logprob(raw[i], tok, seq.params.logprobs or 0)
                                    for i, tok in enumerate(tokens)]

    def _prompt_logprobs(self, seq: Sequence, hidden: torch.Tensor, n: int) -> None:
        """Record logprobs of prompt tokens predicted from this chunk's positions, with each token's rank
        and the top alternatives (one read back for the chunk). hidden: (n, hidden)."""
        c = seq.num_computed_tokens
        if not seq.prompt_logprobs:
            seq.prompt_logprobs.append(None)  # the first prompt token has no prediction
        first = max(0, len(seq.prompt_logprobs) - 1 - c)  # the chunk's first row not yet recorded
        last = min(n, seq.num_prompt_tokens - 1 - c)  # rows predicting a prompt token: [first, last)
        if last <= first:
            return
        lp = self.model.compute_logits(hidden[first:last]).log_softmax(dim=-1)  # (R, V)
        targets = to_device(torch.tensor(seq.token_ids[c + first + 1:c + last + 1]), lp.device)  # (R,)
        _, lps = read_logprobs(lp, targets, [seq.params.prompt_logprobs] * (last - first))
        ranks = (lp >= lp.gather(1, targets.unsqueeze(1))).sum(dim=1)  # (R,) vLLM's: at least as likely, itself too
        for row, r in zip(lps, ranks.tolist()):
            row.rank = r  # type: ignore[union-attr]
            seq.prompt_logprobs.append(row)

    def score(self, seq: Sequence, block_manager: BlockManager, last_only: bool = False,
              decode_from: int | None = None) -> torch.Tensor:
        """Logits (T, V) float32 at every position of seq's tokens (or (1, V) for the last), teacher-
        forced through the paged cache: one prefill, or with decode_from=P a prefill of the first P
        tokens and then one decode step per later token (the decode kernels and CUDA graphs, fed
        given tokens). Takes its blocks from block_manager step by step (a windowed KV group lets go
        of what its window left behind, as in serving) and frees them after.

        For teacher-forced checks and the naive (cache-less) baseline, which calls this once per
        generated token.
        """
        T = seq.num_tokens
        if decode_from is not None and not 1 <= decode_from <= T:
            raise ValueError(f"decode_from: must be in [1, {T}], got {decode_from}")
        try:
            chunks = [T] if decode_from is None else [decode_from] + [1] * (T - decode_from)
            logits = []
            with torch.inference_mode():
                for n in chunks:
                    start = seq.num_computed_tokens
                    if block_manager.reserve(seq.block_tables, start, start + n) is None:
                        raise RuntimeError(f"score: {n} tokens in one forward need more KV blocks than the "
                                           f"{block_manager.num_free_blocks} free (a windowed model keeps the whole "
                                           "prompt's within one forward); pass decode_from or raise kv_cache_memory")
                    hidden = self.forward(SchedulerOutput([(seq, n)]))  # (n, hidden)
                    if not last_only or seq.num_computed_tokens + n == T:
                        logits.append(self.model.compute_logits(hidden[-1:] if last_only else hidden))  # (n, V)
                    seq.num_computed_tokens += n
            return torch.cat(logits)  # (T, V)
        finally:
            block_manager.free(seq.block_tables)


@torch.inference_mode()
def profile_kv_budget(model: torch.nn.Module, cfg: ModelConfig, config: EngineConfig, max_model_len: int) -> int:
    """CUDA: run the largest step the scheduler can build (max_num_batched_tokens tokens, logits for
    max_num_seqs rows) on a scratch cache, read the real peak of allocated memory (the weights of
    every model loaded so far included), and give the KV cache what gpu_memory_utilization leaves."""
    n = max(1, min(config.max_num_batched_tokens, max_model_len - 1))
    blocks = -(-n // config.block_size)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    scratch = KVCache(cfg, blocks, config.block_size, config.torch_dtype, config.device)
    seq = Sequence("__profile__", [0] * n, SamplingParams(max_tokens=1))
    seq.block_tables = [list(range(blocks)) for _ in range(scratch.groups.num_groups)]  # groups may overlap here
    ids, pos, meta = ModelRunner(model, scratch, config.device).build_inputs(SchedulerOutput([(seq, n)]))
    hidden = model(ids, pos, scratch.layers, meta)  # (n, hidden)
    rows = hidden[-1:].expand(min(config.max_num_seqs, n), -1)
    model.compute_logits(rows).softmax(dim=-1).cumsum(dim=-1)  # the sampler's working set
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    scratch_bytes = sum(t.numel() * t.element_size() for t in scratch.tensors)
    del scratch, hidden, rows
    total = torch.cuda.get_device_properties(torch.device(config.device)).total_memory
    budget = kv_budget_from_profile(total, config.gpu_memory_utilization, peak, scratch_bytes)
    log.info("memory profile: peak %.2f GiB of %.1f GiB; KV cache gets %.2f GiB", peak / 2**30,
             total / 2**30, budget / 2**30)
    return budget


def kv_budget_from_profile(total: int, utilization: float, peak: int, scratch_kv: int) -> int:
    """Bytes left for the KV cache: utilization x device memory, minus the measured peak of the profile
    step (weights + activations + the scratch cache it used, which the real cache replaces)."""
    budget = int(total * utilization) - (peak - scratch_kv)
    if budget <= 0:
        raise ValueError(f"gpu_memory_utilization={utilization}: the model's profiled peak "
                         f"({(peak - scratch_kv) / 2**30:.2f} GiB) leaves nothing of {total * utilization / 2**30:.2f} "
                         f"GiB for the KV cache; raise it or lower max_num_batched_tokens")
    return budget
