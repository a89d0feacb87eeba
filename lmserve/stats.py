"""The engine's counters in one snapshot (Engine.stats, LLM.stats, the server's /metrics and console):
read from the block manager, the scheduler and the speculation policy, which own them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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
        offload_hit_tokens=scheduler.offload.hit_tokens if scheduler.offload is not None else 0)
