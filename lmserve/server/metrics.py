"""Prometheus metrics: request outcomes and latencies (observed as requests finish), and engine state
and token counters (the snapshot of the engine's stats that the engine thread last published: a scrape
never touches the Engine, which that thread mutates). Tokens are counted by the engine as they are
processed, as vLLM counts them: an aborted request's tokens count, a request refused before it ran does
not.

Each series is also given under vLLM's name (`vllm:num_requests_waiting{model_name="..."}`, VLLM_NAMES), so
that dashboards, autoscalers and gateways written for vLLM read this server unchanged."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from lmserve.outputs import RequestOutput
from lmserve.sequence import SamplingParams
from lmserve.stats import LATENCY_BUCKETS, buckets_125

if TYPE_CHECKING:
    from lmserve.server.async_engine import AsyncEngine

_WORST_FIRST = ("error", "abort", "length", "stop")
# our series -> vLLM's names for the same quantity (vLLM's V1 engine; the KV usage under its older name too)
VLLM_NAMES: dict[str, tuple[str, ...]] = {
    "lmserve_num_requests_running": ("vllm:num_requests_running",),
    "lmserve_num_requests_waiting": ("vllm:num_requests_waiting",),
    "lmserve_kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "lmserve_prefix_cache_hit_tokens": ("vllm:prefix_cache_hits",),
    "lmserve_prefix_cache_queries": ("vllm:prefix_cache_queries",),
    "lmserve_prompt_tokens": ("vllm:prompt_tokens",),
    "lmserve_generation_tokens": ("vllm:generation_tokens",),
    "lmserve_preemptions": ("vllm:num_preemptions",),
    "lmserve_spec_decode_num_draft_tokens": ("vllm:spec_decode_num_draft_tokens",),
    "lmserve_spec_decode_num_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens",),
    "lmserve_spec_decode_num_drafts": ("vllm:spec_decode_num_drafts",),
    "lmserve_requests": ("vllm:request_success",),  # (its label is finished_reason there)
    "lmserve_time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    "lmserve_request_time_per_output_token_seconds": ("vllm:request_time_per_output_token_seconds",),
    "lmserve_e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    "lmserve_request_queue_time_seconds": ("vllm:request_queue_time_seconds",),
    "lmserve_lora_requests_info": ("vllm:lora_requests_info",),  # (what LoRA-aware gateways route by)
    # (time_per_output_token_seconds: the older name of inter_token_latency_seconds, which dashboards still read)
    "lmserve_inter_token_latency_seconds": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
    "lmserve_iteration_tokens": ("vllm:iteration_tokens_total",),
    "lmserve_request_prompt_tokens": ("vllm:request_prompt_tokens",),
    "lmserve_request_generation_tokens": ("vllm:request_generation_tokens",),
    "lmserve_request_max_num_generation_tokens": ("vllm:request_max_num_generation_tokens",),
    "lmserve_request_params_n": ("vllm:request_params_n",),
    "lmserve_request_params_max_tokens": ("vllm:request_params_max_tokens",),
    "lmserve_request_prefill_time_seconds": ("vllm:request_prefill_time_seconds",),
    "lmserve_request_decode_time_seconds": ("vllm:request_decode_time_seconds",),
    "lmserve_request_inference_time_seconds": ("vllm:request_inference_time_seconds",),
}


def finish_reason(out: RequestOutput) -> str:
    """A finished request's one finish reason: the worst of its choices' (an n > 1 request counts once)."""
    reasons = {c.finish_reason for c in out.outputs}
    return next((r for r in _WORST_FIRST if r in reasons), "unknown")


class _EngineCollector:
    """Engine gauges and counters, read from the AsyncEngine's published snapshot at scrape time."""

    def __init__(self, async_engine: AsyncEngine) -> None:
        self.ae = async_engine

    def collect(self):  # type: ignore[no-untyped-def]
        st = self.ae.stats
        g = GaugeMetricFamily
        yield g("lmserve_num_requests_running", "Sequences running in the engine", value=st.num_running)
        yield g("lmserve_num_requests_waiting", "Requests waiting to be scheduled", value=self.ae.num_waiting)
        yield g("lmserve_kv_blocks_used", "KV cache blocks in use", value=st.used_blocks)
        yield g("lmserve_kv_blocks_free", "KV cache blocks free (including cached)", value=st.free_blocks)
        yield g("lmserve_kv_blocks_total", "KV cache blocks in the pool", value=st.num_blocks)
        yield g("lmserve_kv_blocks_cached", "Free blocks still holding a reusable prefix", value=st.cached_blocks)
        yield g("lmserve_kv_cache_usage_perc", "KV cache blocks in use / in the pool (0..1)",
                value=st.used_blocks / st.num_blocks if st.num_blocks else 0.0)
        yield g("lmserve_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / looked up, "
                "since start", value=st.prefix_hit_rate)
        c = CounterMetricFamily
        yield c("lmserve_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache",
                value=st.prefix_hit_tokens)
        yield c("lmserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache (first admissions)",
                value=st.prompt_tokens_queried)
        yield c("lmserve_prompt_tokens", "Prompt tokens of requests that produced a first token",
                value=st.prompt_tokens)
        yield c("lmserve_generation_tokens", "Tokens generated (every sequence; aborted requests' too)",
                value=st.generation_tokens)
        yield c("lmserve_preemptions", "Sequences preempted", value=st.num_preemptions)
        if st.offload is not None:  # the prefix cache's second tier
            yield c("lmserve_kv_offload_hit_tokens", "Prompt tokens the offload tier gave back", value=st.offload_hit_tokens)
            yield g("lmserve_kv_offload_blocks", "Blocks the offload tier holds", value=st.offload["blocks"])
            yield c("lmserve_kv_offload_saved_blocks", "Blocks saved to the offload tier", value=st.offload["saved_blocks"])
        if st.spec is not None:
            yield c("lmserve_spec_decode_num_draft_tokens", "Draft tokens proposed", value=st.spec["proposed"])
            yield c("lmserve_spec_decode_num_accepted_tokens", "Draft tokens accepted", value=st.spec["accepted"])
            yield c("lmserve_spec_decode_num_drafts", "Verifications of drafts", value=st.spec["verifications"])
        yield g("lmserve_engine_alive", "1 while the engine loop runs", value=1.0 if self.ae.alive else 0.0)
        for name, doc, snap in (("lmserve_inter_token_latency_seconds", "Time between a sequence's steps with tokens",
                                 st.inter_token_latency),
                                ("lmserve_iteration_tokens", "Tokens run through the model in a step", st.step_tokens)):
            if snap is not None:  # (an engine's Histogram.snapshot(): bounds, cumulative counts, sum)
                bounds, cum, total = snap
                yield HistogramMetricFamily(name, doc, sum_value=total, buckets=[
                    *((str(float(b)), c) for b, c in zip(bounds, cum)), ("+Inf", cum[-1])])
        if st.max_loras:  # vLLM's: the adapters in the running and waiting queues as labels, the time as value
            info = g("lmserve_lora_requests_info", "Running and waiting LoRA adapters",
                     labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
            info.add_metric([str(st.max_loras), ",".join(st.running_loras), ",".join(st.waiting_loras)], time.time())
            yield info


class _VllmNames:
    """Every series of `sources` that VLLM_NAMES lists, again under vLLM's name(s), with vLLM's
    model_name label (and finished_reason for finish_reason), read at scrape time."""

    def __init__(self, sources: list, model_name: str) -> None:  # type: ignore[type-arg]
        self.sources, self.model_name = sources, model_name

    def collect(self):  # type: ignore[no-untyped-def]
        for source in self.sources:
            for fam in source.collect():
                for name in VLLM_NAMES.get(fam.name, ()):
                    out = Metric(name, fam.documentation, fam.type)
                    for s in fam.samples:
                        if s.name.endswith("_created"):  # (vLLM's series carry none)
                            continue
                        labels = {("finished_reason" if k == "finish_reason" else k): v for k, v in s.labels.items()}
                        out.add_sample(name + s.name[len(fam.name):], {**labels, "model_name": self.model_name},
                                       s.value)
                    yield out


class ServerMetrics:
    """One registry per app (tests start several servers in one process); model_name: the served model,
    vLLM's label on its series."""

    def __init__(self, async_engine: AsyncEngine, model_name: str = "") -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("lmserve_requests", "Finished requests by finish reason", ["finish_reason"], registry=r)
        for reason in _WORST_FIRST:  # every series from the start (a rate() over a new label has no past)
            self.requests.labels(reason)
        self.ttft = Histogram("lmserve_time_to_first_token_seconds", "TTFT", buckets=LATENCY_BUCKETS, registry=r)
        # one observation a request, its mean (vLLM's request_time_per_output_token_seconds)
        self.tpot = Histogram("lmserve_request_time_per_output_token_seconds", "A request's TPOT",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("lmserve_e2e_request_latency_seconds", "End-to-end latency", buckets=LATENCY_BUCKETS,
                             registry=r)
        self.queue = Histogram("lmserve_request_queue_time_seconds", "Arrival to first schedule",
                               buckets=LATENCY_BUCKETS, registry=r)
        # vLLM's per-request phases: first schedule -> first token -> last token
        phases = [Histogram(f"lmserve_request_{k}_time_seconds", doc, buckets=LATENCY_BUCKETS, registry=r)
                  for k, doc in (("prefill", "First schedule to first token"), ("decode", "First token to the last"),
                                 ("inference", "First schedule to the last token"))]
        self.prefill, self.decode, self.inference = phases
        tokens = buckets_125(max(async_engine.max_model_len, 1))
        sizes = [Histogram(f"lmserve_request_{k}", doc, buckets=b, registry=r) for k, doc, b in (
            ("prompt_tokens", "A request's prompt tokens", tokens),
            ("generation_tokens", "A request's generated tokens (all its choices)", tokens),
            ("max_num_generation_tokens", "A request's longest choice, in tokens", tokens),
            ("params_n", "A request's n", buckets_125(100)), ("params_max_tokens", "A request's max_tokens", tokens))]
        self.prompt_tokens, self.generation_tokens, self.max_generation_tokens, self.params_n, self.params_max = sizes
        engine = _EngineCollector(async_engine)
        r.register(engine)
        r.register(_VllmNames([engine, self.requests, self.ttft, self.tpot, self.e2e, self.queue, *phases, *sizes],
                              model_name))

    def observe(self, out: RequestOutput, params: SamplingParams | None = None) -> None:
        """Record a finished request (params: what it asked for, for vLLM's request_params_* series; an
        embedding request's are not)."""
        m = out.metrics
        params = None if out.embedding is not None else params
        self.requests.labels(finish_reason(out)).inc()
        if m.first_scheduled_time is None:  # refused before it ran (max_waiting_time): no latencies
            return
        last = m.finished_time if m.first_token_time is not None else None
        for hist, value in ((self.ttft, m.ttft), (self.tpot, m.tpot), (self.e2e, m.e2e), (self.queue, m.queue_time),
                            (self.prefill, m.first_token_time and m.first_token_time - m.first_scheduled_time),
                            (self.decode, last and last - m.first_token_time),
                            (self.inference, last and last - m.first_scheduled_time),
                            (self.prompt_tokens, m.num_prompt_tokens), (self.generation_tokens, m.num_output_tokens),
                            (self.max_generation_tokens, m.num_decode_tokens),
                            (self.params_n, params and params.n), (self.params_max, params and params.max_tokens)):
            if value is not None:
                hist.observe(value)

    def aborted(self, n: int = 1) -> None:
        """Record n requests aborted (client gone, timeout)."""
        self.requests.labels("abort").inc(n)

    def failed(self, n: int = 1) -> None:
        """Record n requests ended by an exception (a failed engine step, a reader cut off, the engine
        stopping) rather than by an output."""
        self.requests.labels("error").inc(n)

    def render(self) -> bytes:
        """The registry in Prometheus' text format."""
        return generate_latest(self.registry)
