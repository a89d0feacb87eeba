"""Engine: process / add / abort requests, and step(). One step = schedule -> run -> update.

The engine wires the parts together and owns only the request table. Each other job has its own
owner: the Scheduler (queues, progress), the BlockManager (blocks), the ModelRunner (tensors, the
forward, sampling), the OutputProcessor (text, stop strings, logprobs, RequestOutputs), FanOut
(n / best_of children, beams) and, with speculation on, the SpecPolicy (drafts). A request is
tokenized and validated once, before it touches any of them, so a bad request raises a ValueError
naming the field and leaves the engine and the other requests as they were.
"""

from __future__ import annotations

import functools
import logging
import random
import time
from typing import Any

from lmserve.config import EngineConfig
from lmserve.fanout import FanOut
from lmserve.graphs import graphs_wanted
from lmserve.inputs import InputProcessor, init_sequence
from lmserve.kv import BlockManager, KVCache
from lmserve.kv.offload import build_offload
from lmserve.kv.swap import swap_policy
from lmserve.lora import LoRARegistry
from lmserve.models.loader import load_model
from lmserve.parallel.driver import load_tensor_parallel
from lmserve.outputs import OutputProcessor, RequestOutput
from lmserve.runner import ModelRunner, profile_kv_budget
from lmserve.scheduler import Scheduler, SchedulerOutput
from lmserve.stats import EngineStats, snapshot  # EngineStats: part of the engine API
from lmserve.sequence import Request, SamplingParams, Sequence
from lmserve.spec.build import build_proposer, kv_share
from lmserve.spec.policy import SpecPolicy
from lmserve.structured import StructuredOutputs
from lmserve.utils import EngineFatalError

log = logging.getLogger("lmserve")


class Engine:
    """The serving core: requests in, incremental RequestOutputs out, one step at a time."""

    def __init__(self, config: EngineConfig) -> None:
        t0 = time.perf_counter()
        self.config = c = config
        self.model_config, self.model, self.tokenizer = (load_tensor_parallel if c.tensor_parallel_size > 1 else load_model)(c)
        try:
            num_blocks = self._build(c)
        except BaseException:  # tensor parallel: the other ranks stop and the group goes (a next engine
            self.close()  # in this process would otherwise join the stale group and its old shards)
            raise
        self.load_time = time.perf_counter() - t0
        log.info("engine ready in %.1f s: %d KV blocks of %d tokens (%d tokens)%s", self.load_time,
                 num_blocks, c.block_size, num_blocks * c.block_size, "" if self.graph_capture_time is None
                 else f"; decode CUDA graphs captured in {self.graph_capture_time:.1f} s")

    def _build(self, c: EngineConfig) -> int:
        """Everything past the weights: the KV cache and the parts around it. Returns the KV blocks."""
        cfg = self.model_config
        self.max_model_len = c.max_model_len or cfg.max_position_embeddings
        if self.max_model_len > cfg.max_position_embeddings:  # past it the rotary table (and the training) end
            raise ValueError(f"max_model_len: {c.max_model_len} exceeds the model's context ({cfg.max_position_embeddings})")
        draft = None  # a draft model's weights are loaded before the memory profile, so it counts them
        if c.speculative_method == "draft":
            dcfg, dmodel, _ = load_model(c.replace(model=c.draft_model or c.model, chat_template=None), c.draft_num_layers)
            draft = (dcfg, dmodel)
        self.kv_budget = c.kv_cache_memory if c.kv_cache_memory is not None else \
            profile_kv_budget(self.model, cfg, c, self.max_model_len)
        hybrid = not c.disable_hybrid_kv_cache_manager
        kvc = getattr(self.model, "local_config", cfg)  # tensor parallel: this rank's share of the KV heads
        kv = dict(cfg=kvc, block_size=c.block_size, dtype=c.torch_dtype, kv_cache_dtype=c.kv_cache_dtype,
                  hybrid=hybrid)  # + scales
        # one budget for every KV cache: a draft model's or an EAGLE head's takes its share by bytes per token
        draft_budget = kv_share(c, self.kv_budget, KVCache.bytes_per_block(**kv) / c.block_size, draft and draft[0])
        num_blocks = KVCache.blocks_for_budget(**kv, budget=self.kv_budget - draft_budget)
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory={self.kv_budget} bytes holds no KV block of {KVCache.bytes_per_block(**kv)} bytes")
        self.kv_cache = KVCache(kvc, num_blocks, c.block_size, c.torch_dtype, c.device, c.kv_cache_dtype, hybrid)
        if c.tensor_parallel_size > 1:  # the other ranks build their caches alike; block copies mirrored
            self.model.attach(self.kv_cache)
        self.block_manager = BlockManager(num_blocks, c.block_size, c.enable_prefix_caching,
                                          self.kv_cache.groups.windows, c.max_num_batched_tokens)
        self.offload = build_offload(c, self.kv_cache, self.block_manager, self.model, cfg)  # None: no second tier
        swap = swap_policy(c.preemption_mode, int(c.swap_space), KVCache.bytes_per_block(**kv),
                           sum(p.numel() for p in self.model.parameters()), str(c.device))
        self.scheduler = Scheduler(self.block_manager, c.max_num_seqs, c.max_num_batched_tokens, *swap, self.offload)
        self.structured = StructuredOutputs(self.tokenizer, cfg.vocab_size, c.grammar_compile_timeout)
        self.lora = LoRARegistry(self.model, c.max_loras, c.max_lora_rank, c.torch_dtype, c.device) if c.enable_lora else None
        self.runner = ModelRunner(self.model, self.kv_cache, c.device, self.structured)
        self.graph_capture_time: float | None = None  # seconds spent capturing decode CUDA graphs
        if graphs_wanted(c, self.model):
            try:
                self.graph_capture_time = self.runner.enable_graphs(c.graph_sizes, self.max_model_len)
            except Exception as e:  # a model or kernel that cannot be captured at all: serve eagerly, say so
                log.warning("CUDA graph capture failed (%s); decode steps run eagerly", e)
                self.runner.graphs = None
        self.spec = None if not c.speculative_method else SpecPolicy(
            build_proposer(c, cfg, draft_budget, draft, self.model, self.max_model_len), c, self.max_model_len)
        self.inputs = InputProcessor(self.tokenizer, cfg.vocab_size, self.max_model_len, c.max_num_seqs,
                                     self.block_manager, self.structured, c.max_logprobs, self.lora, cfg)
        self.output = OutputProcessor(self.tokenizer, self.scheduler.finish)
        # not a bound method: an engine <-> fan-out cycle would keep a dropped engine's KV cache until a GC pass
        self._init_seq = functools.partial(init_sequence, random.Random(c.seed), self.output, self.structured)
        self.fanout = FanOut(self.scheduler, self.block_manager, self._init_seq, self.output.fail)
        self.requests: dict[str, list[Sequence]] = {}  # the request table: each request's sequences
        self.final_only: set[str] = set()  # requests whose caller wants only the finished output
        return num_blocks

    # ---------------------------------------------------------------- requests
    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    def tokenize_prompt(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        """A prompt (text or token ids) -> validated token ids; ValueError naming the problem."""
        return self.inputs.tokenize(prompt, add_special_tokens)

    def process_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                        lora_request: Any = None) -> Request:
        """Tokenize and validate a request once (with a LoRARequest: its adapter loaded); ValueError naming
        the field if it is bad. Reads only what never changes after start-up, so any thread may call it."""
        return self.inputs.process(prompt, params, lora_request)

    def add_request(self, request_id: str, request: Request | str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None, final_only: bool = False, lora_request: Any = None) -> None:
        """Queue a request: a Request from process_request, or a prompt (text or token ids) with its
        params (and LoRARequest), processed here. Raises ValueError (naming the field) and changes nothing if bad.

        final_only: step() returns its output once, at its end (batch callers: LLM.generate); streams leave it off.
        """
        if not isinstance(request, Request):
            request = self.process_request(request, params, lora_request)
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        eos = tuple(self.tokenizer.eos_token_ids if self.tokenizer else self.model_config.eos_token_ids)
        seq = Sequence.from_request(request_id, request, eos, arrival_time or time.time())
        self._init_seq(seq)
        family = self.requests[request_id] = [seq]
        self.scheduler.add(seq)  # before fanout.start: a one-token prompt's children queue behind it
        self.fanout.start(seq, family)
        if final_only:
            self.final_only.add(request_id)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its blocks. Returns False if it is unknown or already done."""
        seqs = self.requests.get(request_id)
        if seqs is None:
            return False
        for seq in seqs:
            self.scheduler.finish(seq, "abort")
        self.runner.swap.apply([], [], self.scheduler.take_swap_dropped())  # swapped-out copies go now, not next step
        self._forget(request_id)
        if not self.requests:  # a step cut short (Ctrl-C) left its copies' sources pinned: none are needed now
            self.scheduler.release_pins()
        return True

    def _forget(self, request_id: str) -> None:
        self.fanout.forget(request_id)
        self.final_only.discard(request_id)
        seqs = self.requests.pop(request_id, [])
        if self.spec is not None:
            self.spec.release(seqs)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Run one iteration; return an output for every request that advanced (finished ones last seen here)."""
        expired = self._expire()
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)
        out = self.scheduler.schedule()
        self.runner.swap.apply(out.swap_out, out.swap_in, out.swap_dropped)  # before any block is written
        if self.spec is not None:
            self.spec.trim(out)
        if out.is_empty:
            if self.requests and not expired:  # never legitimate: every request can run alone (validation)
                raise RuntimeError(f"scheduler stalled with {len(self.requests)} requests "
                                   f"(running {len(self.scheduler.running)}, waiting {len(self.scheduler.waiting)}, "
                                   f"free blocks {self.block_manager.num_free_blocks})")
            return self._outputs(out, expired)
        try:
            res = self.runner.execute(out)
        except EngineFatalError:  # a lost tensor-parallel rank: nothing more can run
            raise
        except Exception as e:  # noqa: BLE001 - a failed forward or sampler fails this step's requests alone
            log.exception("a step failed; its %d sequences end with an error", len(out.scheduled))
            self.scheduler.release_pins()
            if self.spec is not None:
                self.spec.discard()  # unverified drafts are no output
            for seq in self.fanout.failing([seq for seq, _ in out.scheduled], self.requests):
                self.output.fail(seq, f"{type(e).__name__}: {e}")
                if self.spec is not None:
                    self.spec.release([seq])
            return self._outputs(out, expired)
        if self.spec is not None:
            self.spec.settle(out, res.rejected, res.hidden)
        for seq, new in self.scheduler.update_from_output(out, res.sampled, res.rejected).items():
            counted = seq.num_output_tokens
            if seq.grammar is not None:  # tokens past a complete grammar, or from a refused one, go
                new = self.structured.keep(seq, new, self.scheduler.finish)
            self.output.process(seq, new, res.logprobs.get(seq, []))  # (a refused grammar: it fails it)
            if counted != seq.num_output_tokens:  # cut by a stop string or a grammar
                self.scheduler.took_back(counted - seq.num_output_tokens)
        self.fanout.after_step(out, res.beam, self.requests)
        if self.spec is not None:  # sequences that ended this step (stopped, pruned) let their draft state go
            self.spec.release(seq for seq, _ in out.scheduled)
        return self._outputs(out, expired)

    def _expire(self) -> set[str]:
        """Requests none of whose sequences started within max_waiting_time end with a 503 error (n > 1
        children may wait for room after their parent has started: not a request that waited)."""
        limit = self.config.max_waiting_time
        waited = {s.request_id for s in self.scheduler.expired(time.time() - limit)} if limit else set()
        rids = {r for r in waited if all(s.first_scheduled_time is None for s in self.requests.get(r, []))}
        for seq in (s for r in rids for s in self.requests[r]):
            self.output.fail(seq, f"waited more than {limit:g} s for its first step (max_waiting_time)", status=503)
        return rids

    def _outputs(self, out: SchedulerOutput, extra: set[str] = frozenset()) -> list[RequestOutput]:  # type: ignore[assignment]
        """A RequestOutput for each request of the step that has one to give (and for `extra`: requests
        ended before the step); finished ones forgotten."""
        outputs = []
        for rid in {seq.request_id for seq, _ in out.scheduled} | extra:
            seqs = self.requests.get(rid)
            if seqs is None:
                continue
            finished = seqs[0].is_finished if len(seqs) == 1 else all(s.is_finished for s in seqs)
            if finished or rid not in self.final_only:
                outputs.append(self.output.make(rid, seqs, self.fanout.beams.get(rid)))
            if finished:
                self._forget(rid)
        return outputs

    # ---------------------------------------------------------------- state
    def stats(self) -> EngineStats:
        return snapshot(self.block_manager, self.scheduler, self.spec, self.lora)

    def close(self, save_offload: bool = True) -> None:  # a directory offload tier writes its files (and the
        if getattr(self, "offload", None) is not None:  # pool's cached blocks: not while a step may run); TP ranks stop
            self.offload.close(self.block_manager if save_offload else None)
        getattr(self.model, "close", lambda: None)()

    def info(self) -> dict[str, Any]:
        return {"model": self.config.model, "architecture": self.model_config.architecture,
                "dtype": str(self.config.torch_dtype).removeprefix("torch."), "device": self.config.device,
                "max_model_len": self.max_model_len, "load_time_s": round(self.load_time, 2)}
