"""Engine: add_request / abort_request / step(). One step = schedule -> run -> update.

The engine owns the request table and output processing (detokenization, stop strings); it
delegates block accounting to the BlockManager, queueing to the Scheduler and tensors to the
ModelRunner. Every request is validated before it touches any of them, so a bad request raises a
ValueError naming the field and leaves the engine and the other requests as they were.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from dataclasses import dataclass
from typing import Any

import torch

from lmserve.attention import get_backend
from lmserve.config import EngineConfig, ModelConfig
from lmserve.kv import BlockManager, KVCache
from lmserve.models.loader import GGUFFile, hf_config, hf_weights, random_weights, resolve_model
from lmserve.models.registry import build_model
from lmserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from lmserve.runner import ModelRunner
from lmserve.sampling.beam import BeamState
from lmserve.scheduler import Scheduler, SchedulerOutput
from lmserve.sequence import SamplingParams, Sequence, Status
from lmserve.spec.build import build_proposer
from lmserve.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger("lmserve")


@dataclass
class EngineStats:
    """A snapshot of the cache and scheduler counters."""

    block_size: int
    num_blocks: int
    free_blocks: int
    cached_blocks: int
    used_blocks: int
    kv_capacity_tokens: int
    prefix_hit_tokens: int
    prompt_tokens_queried: int
    num_preemptions: int
    computed_tokens: int
    peak_used_blocks: int
    num_running: int
    num_waiting: int
    spec: dict | None = None  # speculative decoding counters, when it is on

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prompt_tokens_queried if self.prompt_tokens_queried else 0.0


def load_model(config: EngineConfig, num_layers: int | None = None
               ) -> tuple[ModelConfig, torch.nn.Module, Tokenizer | None]:
    """Resolve config.model on disk, build our model, load its weights, and its tokenizer.

    num_layers keeps only the first N decoder layers (with the final norm and head): a truncated
    copy, the honest baseline draft model for speculative decoding on a CPU.
    """
    src = resolve_model(config.model)
    backend = get_backend(config.attention_backend, config.device)
    tokenizer: Tokenizer | None = None
    if src.kind == "shape":
        from lmserve.models.shapes import shape_config
        cfg = shape_config(config.model.removeprefix("shape:"))
        weights = random_weights(cfg, config.seed)
    elif src.kind == "gguf":
        g = GGUFFile(src.path)
        cfg = g.config()
        weights = g.weights(cfg)
        tokenizer = Tokenizer.from_gguf(g, cfg.eos_token_ids)
    else:
        cfg = hf_config(src.path)
        weights = hf_weights(src.path)
        tok_dir = config.tokenizer or src.path
        if any((src.path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")) or config.tokenizer:
            tokenizer = Tokenizer.from_hf_dir(tok_dir, cfg.eos_token_ids)
    if num_layers is not None:
        if not 1 <= num_layers <= cfg.num_layers:
            raise ValueError(f"draft_num_layers must be in [1, {cfg.num_layers}], got {num_layers}")
        cfg = dataclasses.replace(cfg, num_layers=num_layers)
        weights = ((n, t) for n, t in weights
                   if not (n.startswith("model.layers.") and int(n.split(".")[2]) >= num_layers))
    model = build_model(cfg, backend)
    model.load_weights(weights)
    model = model.to(device=config.device, dtype=config.torch_dtype).eval()
    return cfg, model, tokenizer


def kv_budget_from_profile(total: int, utilization: float, peak: int, scratch_kv: int) -> int:
    """Bytes left for the KV cache: utilization x device memory, minus the measured peak of the profile
    step (weights + activations + the scratch cache it used, which the real cache replaces)."""
    budget = int(total * utilization) - (peak - scratch_kv)
    if budget <= 0:
        raise ValueError(f"gpu_memory_utilization={utilization}: the model's profiled peak "
                         f"({(peak - scratch_kv) / 2**30:.2f} GiB) leaves nothing of {total * utilization / 2**30:.2f} "
                         f"GiB for the KV cache; raise it or lower max_num_batched_tokens")
    return budget


class Engine:
    """The serving core: requests in, incremental RequestOutputs out, one step at a time."""

    def __init__(self, config: EngineConfig) -> None:
        t0 = time.perf_counter()
        self.config = config
        self.model_config, self.model, self.tokenizer = load_model(config)
        cfg = self.model_config
        self.max_model_len = min(cfg.max_position_embeddings, config.max_model_len or cfg.max_position_embeddings)
        draft = None  # a draft model's weights are loaded before the memory profile, so it counts them
        if config.speculative_method == "draft":
            dcfg, dmodel, _ = load_model(config.replace(model=config.draft_model or config.model),
                                         config.draft_num_layers)
            draft = (dcfg, dmodel)
        self.kv_budget = config.kv_cache_memory if config.kv_cache_memory is not None else self._profile_kv_budget()
        # one budget for every KV cache: a draft model's cache takes its share by bytes per token
        draft_budget = 0 if draft is None else \
            self.kv_budget * draft[0].kv_elems_per_token // (draft[0].kv_elems_per_token + cfg.kv_elems_per_token)
        num_blocks = KVCache.blocks_for_budget(cfg, config.block_size, config.torch_dtype,
                                               self.kv_budget - draft_budget)
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory={self.kv_budget} bytes holds no KV block of "
                             f"{KVCache.bytes_per_block(cfg, config.block_size, config.torch_dtype)} bytes")
        self.kv_cache = KVCache(cfg, num_blocks, config.block_size, config.torch_dtype, config.device)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.runner = ModelRunner(self.model, self.kv_cache, config.device)
        self.graph_capture_time: float | None = None  # seconds spent capturing decode CUDA graphs
        if self._use_graphs():
            try:
                self.graph_capture_time = self.runner.enable_graphs(config.graph_sizes, self.max_model_len)
            except RuntimeError as e:  # a model or kernel that cannot be captured: serve eagerly, say so
                log.warning("CUDA graph capture failed (%s); decode steps run eagerly", e)
                self.runner.graphs = None
        self.proposer = build_proposer(config, cfg, draft_budget, draft) if config.speculative_method else None
        self.requests: dict[str, list[Sequence]] = {}
        self.beams: dict[str, BeamState] = {}  # beam-search requests: their search state
        self.final_only: set[str] = set()  # requests whose caller wants only the finished output
        self._rng = random.Random(config.seed)
        self.load_time = time.perf_counter() - t0
        log.info("engine ready in %.1f s: %d KV blocks of %d tokens (%d tokens)%s", self.load_time,
                 num_blocks, config.block_size, num_blocks * config.block_size,
                 "" if self.graph_capture_time is None else
                 f"; decode CUDA graphs captured in {self.graph_capture_time:.1f} s")

    def _use_graphs(self) -> bool:
        c = self.config
        if c.enforce_eager or not str(c.device).startswith("cuda"):
            return False
        if not get_backend(c.attention_backend, c.device).supports_cuda_graphs:
            log.info("attention backend %r cannot run in a CUDA graph: decode runs eagerly", c.attention_backend)
            return False
        return True

    @torch.inference_mode()
    def _profile_kv_budget(self) -> int:
        """CUDA: run the largest step the scheduler can build (max_num_batched_tokens tokens, logits
        for max_num_seqs rows) on a scratch cache, read the real peak of allocated memory, and give
        the KV cache what gpu_memory_utilization leaves."""
        cfg, c = self.model_config, self.config
        n = max(1, min(c.max_num_batched_tokens, self.max_model_len - 1))
        blocks = -(-n // c.block_size)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        scratch = KVCache(cfg, blocks, c.block_size, c.torch_dtype, c.device)
        seq = Sequence("__profile__", [0] * n, SamplingParams(max_tokens=1))
        seq.block_table = list(range(blocks))
        ids, pos, meta = ModelRunner(self.model, scratch, c.device).build_inputs(SchedulerOutput([(seq, n)]))
        hidden = self.model(ids, pos, scratch.layers, meta)  # (n, hidden)
        rows = hidden[-1:].expand(min(c.max_num_seqs, n), -1)
        self.model.compute_logits(rows).softmax(dim=-1).cumsum(dim=-1)  # the sampler's working set
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        scratch_bytes = sum(t.numel() * t.element_size() for t in scratch.layers)
        del scratch, hidden, rows
        total = torch.cuda.get_device_properties(torch.device(c.device)).total_memory
        budget = kv_budget_from_profile(total, c.gpu_memory_utilization, peak, scratch_bytes)
        log.info("memory profile: peak %.2f GiB of %.1f GiB; KV cache gets %.2f GiB", peak / 2**30,
                 total / 2**30, budget / 2**30)
        return budget

    # ---------------------------------------------------------------- requests
    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    def tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        """A prompt (text or token ids) -> validated token ids; ValueError naming the problem."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass token ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            if any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
                raise ValueError("prompt_token_ids: must be a list of integers")
        if not ids:
            raise ValueError("prompt: must not be empty")
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt_token_ids: token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        return ids

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """The request's options, then the checks that need the model: lengths, vocabulary, KV capacity."""
        if not isinstance(params, SamplingParams):
            raise ValueError("params: must be a SamplingParams")
        params.validate()
        n = len(prompt_ids)
        if n >= self.max_model_len:
            raise ValueError(f"prompt: {n} tokens, but the model's context is {self.max_model_len}")
        if n + params.max_tokens > self.max_model_len:
            raise ValueError(f"max_tokens: prompt ({n}) + max_tokens ({params.max_tokens}) exceeds the "
                             f"model's context ({self.max_model_len})")
        for name, ids in (("logit_bias", list(params.logit_bias or {})), ("stop_token_ids", params.stop_token_ids)):
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise ValueError(f"{name}: token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: this model has no tokenizer, so stop strings cannot be matched; "
                             "use stop_token_ids")
        # beams are scheduled and preempted as a whole, so all of them must fit at once, each at its
        # longest (shared blocks are not counted on: a readmitted beam recomputes its own copy)
        family = params.beam_width if params.use_beam_search else 1
        field = "max_tokens" if family == 1 else ("best_of" if params.best_of else "n")
        if family > self.config.max_num_seqs:
            raise ValueError(f"{field}: {family} sequences for one request, but max_num_seqs is "
                             f"{self.config.max_num_seqs}")
        need = family * self.block_manager.blocks_needed(n + params.max_tokens)
        if need > self.block_manager.num_blocks:
            raise ValueError(f"{field}: the request needs {need} KV blocks"
                             f"{f' ({family} sequences)' if family > 1 else ''} but the cache has "
                             f"{self.block_manager.num_blocks}; raise kv_cache_memory or lower max_tokens")

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None, prompt_token_ids: list[int] | None = None,
                    final_only: bool = False) -> None:
        """Validate and queue a request. Raises ValueError (naming the field) and changes nothing if bad.

        prompt_token_ids: the caller's tokenization of a text prompt, so it is not tokenized twice.
        final_only: step() returns this request's output once, when it finishes (no per-step
        outputs to build: what a batch caller such as LLM.generate wants); streaming callers leave it off.
        """
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        ids = self.tokenize_prompt(prompt if prompt_token_ids is None else prompt_token_ids)
        self.validate(ids, params)
        eos = tuple(self.tokenizer.eos_token_ids if self.tokenizer else self.model_config.eos_token_ids)
        seq = Sequence(request_id, ids, params, prompt=prompt if isinstance(prompt, str) else None,
                       eos_token_ids=eos, arrival_time=arrival_time or time.time())
        self._init_sampling_state(seq)
        self.requests[request_id] = [seq]
        if params.use_beam_search:
            ends = tuple(params.stop_token_ids) + (() if params.ignore_eos else eos)
            self.beams[request_id] = BeamState(params.beam_width, params.max_tokens, ends, params.length_penalty,
                                               params.early_stopping)
        elif params.num_samples > 1 and len(ids) == 1:  # nothing to share: independent children
            for i in range(1, params.num_samples):
                child = self._new_child(seq, i)
                self.requests[request_id].append(child)
                self.scheduler.add(child)
        else:
            seq.forks_pending = params.num_samples - 1
        if final_only:
            self.final_only.add(request_id)
        self.scheduler.add(seq)

    # ---------------------------------------------------------------- speculation
    def _num_draft_tokens(self, seq: Sequence) -> int:
        """The dynamic rule: k drafts, or 0 when the batch is large (decode is no longer memory-bound,
        so verification costs real compute) or this request's drafts have mostly been rejected (then
        speculation pauses for a while and probes again)."""
        c = self.config
        if (not seq.params.speculative or seq.params.use_beam_search or seq.forks_pending
                or len(self.scheduler.running) > c.spec_max_batch):
            return 0
        if seq.spec_pause > 0:
            seq.spec_pause -= 1
            return 0
        if seq.spec_acceptance < c.spec_min_acceptance:
            seq.spec_pause, seq.spec_acceptance = 16, c.spec_min_acceptance  # pause, then probe again
            return 0
        room = min(seq.params.max_tokens - seq.num_output_tokens - 1, self.max_model_len - seq.num_tokens - 1)
        return max(0, min(c.num_speculative_tokens, room))

    def _propose(self) -> list[Sequence]:
        """Append drafts to the decoding sequences that speculate this step; returns those sequences."""
        seqs = [s for s in self.scheduler.running if s.num_tokens - s.num_computed_tokens == 1]
        ks = [self._num_draft_tokens(s) for s in seqs]
        if not any(ks):
            return []
        drafted = []
        for seq, prop in zip(seqs, self.proposer.propose(seqs, ks)):
            if prop.tokens:
                seq.token_ids.extend(prop.tokens)
                seq.num_draft = len(prop.tokens)
                seq.draft_probs = prop.probs
                drafted.append(seq)
        return drafted

    def _trim_drafts(self, out: SchedulerOutput, drafted: list[Sequence]) -> None:
        """Drop drafts the scheduler could not fit (or of preempted sequences) before the forward."""
        got = dict(out.scheduled)
        for seq in drafted:
            keep = max(0, got.get(seq, 0) - 1) if seq.status is Status.RUNNING else 0
            if keep < seq.num_draft:
                del seq.token_ids[len(seq.token_ids) - (seq.num_draft - keep):]
                seq.num_draft = keep
                seq.draft_probs = None if not keep or seq.draft_probs is None else seq.draft_probs[:keep]

    def _init_sampling_state(self, seq: Sequence) -> None:
        """Per-sequence generator (request seed + child index, else a draw from the engine's RNG). It
        lives on the host: a draw costs no device call, and its uniforms reach the device in one copy."""
        p = seq.params
        seq.generator = random.Random(p.seed + seq.index if p.seed is not None else self._rng.randrange(2**63))
        if self.tokenizer is not None:
            seq.detok = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, p.skip_special_tokens)

    def _new_child(self, parent: Sequence, index: int) -> Sequence:
        child = Sequence(parent.request_id, parent.prompt_token_ids, parent.params, prompt=parent.prompt,
                         eos_token_ids=parent.eos_token_ids, arrival_time=parent.arrival_time, index=index)
        self._init_sampling_state(child)
        return child

    def _fork(self, parent: Sequence) -> None:
        """Parent has computed all but its last prompt token: children take its blocks by reference.

        Each child then runs the last prompt token itself, writing into the shared last block, which
        the scheduler copies for it first (copy-on-write), and samples its own first token.
        """
        after = parent
        for i in range(1, parent.forks_pending + 1):
            after = self._clone(parent, i, after)
        parent.forks_pending = 0

    def _clone(self, parent: Sequence, index: int, after: Sequence) -> Sequence:
        """A running copy of `parent` holding its blocks by reference (copy-on-write later)."""
        child = self._new_child(parent, index)
        child.token_ids = list(parent.token_ids)
        child.block_table = self.block_manager.fork(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child.first_scheduled_time = parent.first_scheduled_time
        child.first_token_time = parent.first_token_time
        child.cumulative_logprob = parent.cumulative_logprob
        self.requests[parent.request_id].append(child)
        self.scheduler.add_running(child, after=after)
        return child

    def _beam_step(self, rid: str) -> None:
        """Advance a beam-search request once every running beam has its next-token log-probs."""
        st = self.beams[rid]
        seqs = [s for s in self.requests[rid] if not s.is_finished]
        if any(s.pending_logprobs is None or s.status is not Status.RUNNING for s in seqs):
            return  # a beam was preempted (with its family) or not scheduled yet: wait for it
        lp = torch.stack([s.pending_logprobs for s in seqs])  # (B, V)
        for s in seqs:
            s.pending_logprobs = None
        nxt = st.step([s.output_token_ids for s in seqs], [s.cumulative_logprob for s in seqs], lp)
        used: set[int] = set()
        plan = []
        for b, tok, score in nxt:  # fork first: a clone copies its parent before the parent moves on
            parent = seqs[b]
            child = parent if b not in used else self._clone(parent, len(self.requests[rid]), parent)
            used.add(b)
            plan.append((child, tok, score))
        now = time.time()
        for child, tok, score in plan:
            child.append_token(tok)
            child.cumulative_logprob = score
            if child.first_token_time is None:
                child.first_token_time = now
        for b, s in enumerate(seqs):
            if b not in used or st.done:
                self.scheduler.finish(s, "length")  # pruned, or the search is over: blocks freed now

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its blocks. Returns False if it is unknown or already done."""
        seqs = self.requests.get(request_id)
        if seqs is None:
            return False
        for seq in seqs:
            self.scheduler.finish(seq, "abort")
        self._forget(request_id)
        return True

    def _forget(self, request_id: str) -> None:
        self.beams.pop(request_id, None)
        self.final_only.discard(request_id)
        for seq in self.requests.pop(request_id, []):
            if self.proposer is not None:
                self.proposer.release(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    # ---------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Run one iteration; return an output for every request that advanced (finished ones last seen here)."""
        drafted = self._propose() if self.proposer is not None else []
        out = self.scheduler.schedule()
        if drafted:
            self._trim_drafts(out, drafted)
        if out.is_empty:
            if self.requests:  # never legitimate: validation guarantees every request can run alone
                raise RuntimeError(f"scheduler stalled with {len(self.requests)} requests "
                                   f"(running {len(self.scheduler.running)}, waiting {len(self.scheduler.waiting)}, "
                                   f"free blocks {self.block_manager.num_free_blocks})")
            return []
        res = self.runner.execute(out)
        for seq, new in self.scheduler.update_from_output(out, res.sampled, res.rejected).items():
            try:
                kept = self._process_text(seq, new)
            except Exception as e:  # one request's failure must not reach the others
                log.exception("output processing failed for %s", seq.request_id)
                seq.error = f"{type(e).__name__}: {e}"
                self.scheduler.finish(seq, "error")
                continue
            for lp in res.logprobs.get(seq, [])[:kept]:  # only the tokens that stayed
                if seq.params.logprobs is not None:
                    seq.logprobs.append(lp)
                seq.cumulative_logprob += lp.logprob
        for seq, _ in out.scheduled:
            if seq.forks_pending and seq.num_computed_tokens == seq.num_prompt_tokens - 1 and not seq.is_finished:
                self._fork(seq)
        for rid in {s.request_id for s in res.beam}:
            self._beam_step(rid)
        touched = {seq.request_id for seq, _ in out.scheduled}
        outputs = []
        for rid in touched:
            seqs = self.requests.get(rid)
            if seqs is None:
                continue
            finished = all(s.is_finished for s in seqs)
            if finished or rid not in self.final_only:
                outputs.append(self._make_output(rid, seqs))
            if finished:
                self._forget(rid)
        return outputs

    def _process_text(self, seq: Sequence, new_tokens: list[int]) -> int:
        """Detokenize the new tokens one by one and apply stop strings (the stop string itself is not
        emitted). Tokens after a stop string (possible when several arrive at once) are dropped.
        Returns how many of new_tokens the sequence keeps.

        Several tokens arrive at once from speculation; they are checked in order, exactly as if each
        had come in its own step: a stop string completed by an earlier token wins over an EOS or
        stop token that comes after it (which ended the sequence in the scheduler already), while a
        token-level stop on the last token wins over a stop string on that same token, as it does
        one token at a time.
        """
        if seq.detok is None:
            return len(new_tokens)
        p = seq.params
        last = len(new_tokens) - 1
        for i, tok in enumerate(new_tokens):
            before = len(seq.text)
            seq.text += seq.detok.step([tok])
            if not p.stop or (i == last and seq.finish_reason not in (None, "length")):
                continue
            for stop in p.stop:
                idx = seq.text.find(stop, max(0, before - len(stop) + 1))
                if idx == -1:
                    continue
                seq.text = seq.text[:idx + len(stop)] if p.include_stop_str_in_output else seq.text[:idx]
                if i < last:
                    del seq.token_ids[len(seq.token_ids) - (last - i):]
                if seq.is_finished:  # ended on a later token (EOS, length): the stop string wins
                    seq.finish_reason, seq.stop_reason = "stop", stop
                else:
                    self.scheduler.finish(seq, "stop", stop_reason=stop)
                return i + 1
        return len(new_tokens)

    def _make_output(self, rid: str, seqs: list[Sequence]) -> RequestOutput:
        if rid in self.beams:
            return self._beam_output(rid, seqs)
        outs = []
        s0 = seqs[0]
        finished = all(s.is_finished for s in seqs)
        ranked = finished and s0.params.num_samples > s0.params.n  # best_of: the n most likely, re-indexed
        shown = (sorted(seqs, key=lambda s: -s.cumulative_logprob)[:s0.params.n] if ranked
                 else sorted(seqs, key=lambda s: s.index))
        for rank, s in enumerate(shown):
            hold = 0 if s.is_finished or not s.params.stop else max(map(len, s.params.stop)) - 1
            visible = max(s.num_emitted_chars, len(s.text) - hold)
            delta = s.text[s.num_emitted_chars:visible]
            s.num_emitted_chars = visible
            out_ids = s.output_token_ids
            delta_ids = out_ids[s.num_emitted_tokens:]
            s.num_emitted_tokens = len(out_ids)
            outs.append(CompletionOutput(
                index=rank if ranked else s.index, text=s.text, token_ids=out_ids,
                finish_reason=s.finish_reason, stop_reason=s.stop_reason,
                cumulative_logprob=s.cumulative_logprob if s.params.needs_logprob else None,
                logprobs=list(s.logprobs) if s.params.logprobs is not None else None,
                delta_text=delta, delta_token_ids=delta_ids, error=s.error))
        metrics = self._metrics(seqs, finished, sum(s.num_output_tokens for s in seqs))
        return RequestOutput(rid, s0.prompt, s0.prompt_token_ids, outs, finished,
                             metrics, list(s0.prompt_logprobs) if s0.params.prompt_logprobs is not None else None)

    @staticmethod
    def _metrics(seqs: list[Sequence], finished: bool, num_output_tokens: int) -> RequestMetrics:
        """A request's metrics from its sequences (the first holds the prompt-side facts)."""
        s0 = seqs[0]
        return RequestMetrics(
            arrival_time=s0.arrival_time, first_scheduled_time=s0.first_scheduled_time,
            first_token_time=min((s.first_token_time for s in seqs if s.first_token_time), default=None),
            finished_time=max((s.finished_time or 0) for s in seqs) if finished else None,
            num_prompt_tokens=s0.num_prompt_tokens, num_output_tokens=num_output_tokens,
            num_cached_tokens=s0.num_cached_tokens, num_preemptions=sum(s.num_preemptions for s in seqs))

    def score(self, token_ids: list[int], last_only: bool = False, decode_from: int | None = None) -> torch.Tensor:
        """Logits (T, V) float32 at every position of token_ids (or (1, V) for the last), teacher-forced
        through the paged cache: one prefill, or with decode_from=P a prefill of the first P tokens and
        then one decode step per later token (the decode kernels and CUDA graphs, fed given tokens).

        For teacher-forced checks and the naive (cache-less) baseline, which calls this once per
        generated token; uses and then frees its own blocks.
        """
        ids = self.tokenize_prompt(token_ids)
        if decode_from is not None and not 1 <= decode_from <= len(ids):
            raise ValueError(f"decode_from: must be in [1, {len(ids)}], got {decode_from}")
        seq = Sequence("__score__", ids, SamplingParams(max_tokens=1))
        if not self.block_manager.allocate(seq.block_table, len(ids)):
            raise RuntimeError("score: not enough free KV blocks")
        try:
            chunks = [len(ids)] if decode_from is None else [decode_from] + [1] * (len(ids) - decode_from)
            logits = []
            with torch.inference_mode():
                for n in chunks:
                    hidden = self.runner.forward(SchedulerOutput([(seq, n)]))  # (n, hidden)
                    if not last_only or seq.num_computed_tokens + n == len(ids):
                        logits.append(self.model.compute_logits(hidden[-1:] if last_only else hidden))  # (n, V)
                    seq.num_computed_tokens += n
            return torch.cat(logits)  # (T, V)
        finally:
            self.block_manager.free(seq.block_table)

    def _beam_output(self, rid: str, seqs: list[Sequence]) -> RequestOutput:
        st = self.beams[rid]
        s0 = seqs[0]
        finished = all(s.is_finished for s in seqs)
        outs = []
        if finished:
            for i, h in enumerate(st.best(s0.params.n)):
                text = self.tokenizer.decode(h.tokens, s0.params.skip_special_tokens) if self.tokenizer else ""
                outs.append(CompletionOutput(index=i, text=text, token_ids=h.tokens, cumulative_logprob=h.score,
                                             finish_reason="stop" if h.ended_by_eos else "length",
                                             delta_text=text, delta_token_ids=h.tokens))
        metrics = self._metrics(seqs, finished, sum(len(o.token_ids) for o in outs))
        return RequestOutput(rid, s0.prompt, s0.prompt_token_ids, outs, finished, metrics)

    # ---------------------------------------------------------------- state
    def stats(self) -> EngineStats:
        b = self.block_manager.stats()
        st = self.scheduler.stats
        return EngineStats(
            block_size=self.block_manager.block_size, num_blocks=b.total, free_blocks=b.free,
            cached_blocks=b.cached, used_blocks=b.used,
            kv_capacity_tokens=b.total * self.block_manager.block_size,
            prefix_hit_tokens=st.prefix_hit_tokens, prompt_tokens_queried=st.prompt_tokens_queried,
            num_preemptions=st.num_preemptions, computed_tokens=st.computed_tokens,
            peak_used_blocks=st.peak_used_blocks,
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            spec=self.runner.spec_stats.as_dict() if self.proposer is not None else None)

    def info(self) -> dict[str, Any]:
        return {"model": self.config.model, "architecture": self.model_config.architecture,
                "dtype": str(self.config.torch_dtype).removeprefix("torch."), "device": self.config.device,
                "max_model_len": self.max_model_len, "load_time_s": round(self.load_time, 2)}
