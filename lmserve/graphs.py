"""CUDA graphs for decode steps.

A decode step of a small model is a few hundred small kernels; launched one by one from Python, the
launches, not the memory traffic, set the step time. DecodeGraphs captures the model's forward once
per batch size in `sizes` (largest first, all in one memory pool) and replays it: a live batch of b
decodes is padded up to the smallest captured size >= b.

A graph replays fixed device addresses, so every input lives in a static buffer owned here, and the
metadata of a captured batch is `static_decode` (see AttentionMetadata): row i is sequence i's one
new token, and padding rows carry slot -1 (the store kernel skips them) and context length 0 (the
decode kernel reads nothing for them, and they output zeros). Rows are independent in every other
layer, so padding cannot touch the live rows. The LM head and the sampler run eagerly on the live
rows afterwards.

Prefill, mixed steps, speculative verification (several tokens per sequence) and batches larger
than the largest size run eagerly. A size whose capture fails is dropped (logged), not fatal. With
capture=False the same padded static-buffer path runs without a graph: that is how the CPU tests
check it (the attention kernels under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import logging
import time

import torch

from lmserve.attention import AttentionMetadata, get_backend, pack_block_tables
from lmserve.config import EngineConfig
from lmserve.kv.cache import KVCache, slot
from lmserve.scheduler import SchedulerOutput
from lmserve.utils import to_device

log = logging.getLogger("lmserve")


class DecodeGraphs:
    """Owns the static decode inputs and one captured graph (with its output buffer) per batch size."""

    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, sizes: list[int], max_model_len: int,
                 capture: bool = True) -> None:
        if not sizes or min(sizes) < 1:
            raise ValueError(f"graph batch sizes must be positive, got {sizes}")
        self.model = model
        self.kv_cache = kv_cache
        self.sizes = sorted(set(sizes))
        self.max_batch = self.sizes[-1]
        self.block_size = kv_cache.block_size
        self.capture = capture
        dev = kv_cache.tensors[0].device
        b, m = self.max_batch, -(-max_model_len // self.block_size)
        self.num_groups = kv_cache.groups.num_groups
        # static inputs, filled by one copy per step; a graph of size s reads columns [:s]
        self.columns = torch.zeros(3 + self.num_groups, b, dtype=torch.long, device=dev)  # (3 + G, B)
        self.input_ids, self.positions, self.seq_lens = self.columns[:3]  # (B,) each
        self.slot_mapping = self.columns[3:]  # (G, B): each KV group's slots
        self.block_tables = torch.zeros(self.num_groups, b, m, dtype=torch.long, device=dev)  # (G, B, max blocks)
        self.query_start_loc = torch.arange(b + 1, dtype=torch.long, device=dev)  # (B+1,): one token each
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, AttentionMetadata]] = {}
        self.capture_time = 0.0
        self.replays = 0  # decode steps run through this path
        self.padded_rows = 0  # padding rows computed, in all

    def _meta(self, size: int) -> AttentionMetadata:
        groups = tuple((self.slot_mapping[g, :size], self.block_tables[g, :size]) for g in range(self.num_groups))
        return AttentionMetadata(
            slot_mapping=groups[0][0], query_start_loc=self.query_start_loc[:size + 1],
            seq_lens=self.seq_lens[:size], block_tables=groups[0][1], positions=self.positions[:size],
            block_size=self.block_size, query_lens_host=[1] * size, seq_lens_host=[0] * size, static_decode=True,
            groups=groups if self.num_groups > 1 else (),
            layer_groups=self.kv_cache.layer_groups if self.num_groups > 1 else ())

    def _forward(self, size: int, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_cache.layers, meta)  # (size, hidden)

    @torch.inference_mode()
    def capture_all(self) -> float:
        """Warm up and capture every size, largest first, all in one memory pool; returns the seconds
        it took. A size that fails (a Triton compile or out-of-resources error, a launcher build's
        CalledProcessError, a capture error: any Exception) is logged and dropped: its batches pad
        up to the next captured size, or run eagerly above the largest. RuntimeError (which the
        engine answers by serving eagerly) only if no size is left. With capture=False each size
        runs its warm-up forward only: the CPU check of this path."""
        t0 = time.perf_counter()
        self.columns.zero_()
        self.slot_mapping.fill_(-1)  # the warm-up and capture runs write no KV and read none
        pool = None
        failed: list[int] = []
        for size in reversed(self.sizes):
            try:
                pool = self._capture(size, pool)
            except Exception as e:  # noqa: BLE001 - one size must not take the others (or the engine) down
                log.warning("decode graph for batch size %d failed (%s: %s); dropped, its batches pad up "
                            "to the next size or run eagerly", size, type(e).__name__, str(e)[:300])
                failed.append(size)
        self.sizes = [s for s in self.sizes if s not in failed]
        if not self.sizes:
            raise RuntimeError(f"no decode graph could be captured (batch sizes {_ranges(failed[::-1])})")
        self.max_batch = self.sizes[-1]
        if self.capture:
            torch.cuda.synchronize()
        self.capture_time = time.perf_counter() - t0
        if self.capture:
            log.info("captured %d CUDA graphs for decode (batch sizes %s) in %.1f s%s", len(self.sizes),
                     _ranges(self.sizes), self.capture_time, f"; failed: {_ranges(failed[::-1])}" if failed else "")
        return self.capture_time

    def _capture(self, size: int, pool):  # type: ignore[no-untyped-def]
        """Warm up one size (compiles its kernels, settles allocations) and capture it into `pool`;
        returns the pool for the next size."""
        for _ in range(2 if self.capture else 1):
            self._forward(size, self._meta(size))
        if not self.capture:
            return pool
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        meta = self._meta(size)  # its per-step memo (rotary rows, kernel plan) is computed inside the graph
        with torch.cuda.graph(graph, pool=pool):
            out = self._forward(size, meta)  # (size, hidden)
        self.graphs[size] = (graph, out, meta)
        return graph.pool()

    def bucket(self, num_seqs: int) -> int | None:
        """The smallest captured size that holds num_seqs, or None."""
        return next((s for s in self.sizes if s >= num_seqs), None)

    def can_run(self, out: SchedulerOutput) -> bool:
        """A step every sequence of which computes exactly one token, and that fits a captured size."""
        return (len(out.scheduled) <= self.max_batch and all(n == 1 for _, n in out.scheduled)
                and max(len(t) for s, _ in out.scheduled for t in s.block_tables) <= self.block_tables.shape[2])

    @torch.inference_mode()
    def run(self, out: SchedulerOutput) -> torch.Tensor:
        """Hidden states (b, hidden) of the step's b one-token sequences, through the padded graph.

        The returned rows are a view of the graph's output buffer: valid until the next replay."""
        b = len(out.scheduled)
        size = self.bucket(b)
        assert size is not None and self.can_run(out)
        bs = self.block_size
        pad = size - b
        cols: list[list[int]] = [[] for _ in range(3 + self.num_groups)]  # input id, position, length, slots
        for seq, _ in out.scheduled:
            c = seq.num_computed_tokens
            cols[0].append(seq.token_ids[c])
            cols[1].append(c)
            cols[2].append(c + 1)
            for g, table in enumerate(seq.block_tables):
                cols[3 + g].append(slot(table, c, bs))
        for i, col in enumerate(cols):
            col.extend([-1 if i >= 3 else 0] * pad)
        host = torch.tensor(cols, dtype=torch.long)  # (3 + G, size)
        self.columns[:, :size].copy_(to_device(host, self.columns.device))
        for g in range(self.num_groups):  # rows past b keep stale ids they never read
            tables = pack_block_tables([seq.block_tables[g] for seq, _ in out.scheduled])  # (b, width)
            self.block_tables[g, :b, :tables.shape[1]].copy_(to_device(tables, self.block_tables.device))
        self.replays += 1
        self.padded_rows += pad
        if self.capture:
            graph, hidden, _ = self.graphs[size]
            graph.replay()
        else:
            hidden = self._forward(size, self._meta(size))
        return hidden[:b]


def graphs_wanted(c: EngineConfig, model: torch.nn.Module | None = None) -> bool:
    """Whether decode steps run as CUDA graphs: on CUDA, one process, not enforce_eager, an attention
    backend that can be captured, and a model that can (`cuda_graphs`, default yes: MLA in
    deterministic mode cannot)."""
    if c.enforce_eager or c.tensor_parallel_size > 1 or not str(c.device).startswith("cuda"):
        return False
    if not get_backend(c.attention_backend, c.device, c.deterministic).supports_cuda_graphs:
        log.info("attention backend %r cannot run in a CUDA graph: decode runs eagerly", c.attention_backend)
        return False
    if not getattr(model, "cuda_graphs", True):
        log.info("%s cannot run in a CUDA graph here: decode runs eagerly", type(model).__name__)
        return False
    return True


def _ranges(sizes: list[int]) -> str:
    return ", ".join(map(str, sizes)) if len(sizes) <= 6 else f"{sizes[0]}, {sizes[1]}, ... {sizes[-1]}"
