"""The engine's counters in one snapshot (Engine.stats, LLM.stats, the server's /metrics and console):
read from the block manager, the scheduler and the speculation policy, which own them."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)  # seconds


def buckets_125(top: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to top (vLLM's token-count buckets)."""
    out, k = [], 1
    while k <= top:
        out += [b for b in (k, 2 * k, 5 * k) if b <= top]
        k *= 10
    return tuple(out)


class Histogram:
    """A Prometheus-style histogram kept by the engine thread (cumulative per bucket at snapshot time):
    what it observes per step or per sequence, the server exports (server/metrics.py)."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds, self.counts, self.sum = bounds, [0] * (len(bounds) + 1), 0.0  # counts[-1]: above every bound

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def snapshot(self) -> tuple[tuple[float, ...], tuple[int, ...], float]:
        """(bounds, count of observations <= each bound then in all, sum): a copy the engine no longer touches."""
        cum, total = [], 0
        for c in self.counts:
            total += c
            cum.append(total)
        return self.bounds, tuple(cum), self.sum


@dataclass
class SchedulerStats:
    """The scheduler's cumulative counters (it owns them; snapshot() copies them into EngineStats)."""

    num_preemptions: int = 0
    num_swapped: int = 0  # preemptions that swapped the KV out (the rest recompute)
    prefix_hit_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    prompt_tokens_queried: int = 0  # tokens looked up in the prefix cache at first admission (not a
    # readmission, which finds its own blocks, nor a prompt_logprobs request, which looks nothing up)
    prompt_tokens: int = 0  # prompt tokens of requests that produced their first token (once per request)
    generation_tokens: int = 0  # tokens generated (all of a request's sequences; aborted ones' so far too)
    computed_tokens: int = 0  # tokens run through the model (prefill + decode + recompute)
    peak_used_blocks: int = 0
    # vLLM's inter-token latency: a sequence's time since its previous tokens, once a step it gets some
    inter_token_latency: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))
    step_tokens: Histogram = field(default_factory=lambda: Histogram(buckets_125(1 << 20)))  # tokens run a step


@dataclass
class EngineStats:
    """A snapshot of the cache and scheduler counters (Engine.stats)."""

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
    num_swapped: int = 0  # preemptions that swapped the KV out instead of recomputing
    swap_free_blocks: int = 0  # host swap space left, in blocks
    prompt_tokens: int = 0  # prompt tokens of requests that produced a first token (once a request)
    generation_tokens: int = 0  # tokens generated, every sequence of every request (aborted ones' too)
    spec: dict | None = None  # speculative decoding counters, when it is on
    max_loras: int = 0  # LoRA (enable_lora): adapters kept loaded; 0 when off
    running_loras: tuple[str, ...] = ()  # the adapters of running sequences, by name
    waiting_loras: tuple[str, ...] = ()  # the adapters of waiting ones
    offload: dict | None = None  # the prefix cache's second tier (kv_offloading_size): blocks, saves, loads
    offload_hit_tokens: int = 0  # tokens the offload tier gave back (first admissions and readmissions)
    inter_token_latency: tuple | None = None  # Histogram.snapshot()s of SchedulerStats'
    step_tokens: tuple | None = None

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prompt_tokens_queried if self.prompt_tokens_queried else 0.0


def snapshot(bm: Any, scheduler: Any, spec: Any = None, lora: Any = None) -> EngineStats:
    """EngineStats now, from a BlockManager, a Scheduler (and its offload tier), a SpecPolicy and a
    LoRARegistry (or None)."""
    b, st = bm.stats(), scheduler.stats

    def names(seqs: Any) -> tuple[str, ...]:
        return tuple(sorted({s.lora.name for s in seqs if s.lora is not None})) if lora is not None else ()
    return EngineStats(
        block_size=bm.block_size, num_blocks=b.total, free_blocks=b.free, cached_blocks=b.cached, used_blocks=b.used,
        kv_capacity_tokens=b.total * bm.block_size // bm.num_groups,
        prefix_hit_tokens=st.prefix_hit_tokens, prompt_tokens_queried=st.prompt_tokens_queried,
        num_preemptions=st.num_preemptions, computed_tokens=st.computed_tokens,
        num_swapped=st.num_swapped, swap_free_blocks=scheduler.swap_free, peak_used_blocks=st.peak_used_blocks,
        prompt_tokens=st.prompt_tokens, generation_tokens=st.generation_tokens,
        num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
        spec=spec.stats.as_dict() if spec is not None else None, max_loras=lora.max_loras if lora is not None else 0,
        running_loras=names(scheduler.running), waiting_loras=names(scheduler.waiting),
        offload=scheduler.offload.stats() if scheduler.offload is not None else None,
        offload_hit_tokens=scheduler.offload.hit_tokens if scheduler.offload is not None else 0,
        inter_token_latency=st.inter_token_latency.snapshot(), step_tokens=st.step_tokens.snapshot())
