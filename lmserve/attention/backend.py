"""The attention backend protocol and the per-step metadata every backend reads.

The runner builds one `AttentionMetadata` per step from the scheduler's decisions and passes it
down explicitly (no global context). Tokens are flattened: the batch is `[num_tokens, ...]` and
`query_start_loc` marks where each sequence's new tokens begin. A sequence's keys live in the paged
cache at the slots its block table names; the new tokens' K/V are written at `slot_mapping` first,
so attention always reads the whole context from the cache. With kv_cache_dtype int8 / fp8 a layer's
cache is a `lmserve.kv.cache.QuantizedKV` (elements + a float32 scale per slot, head and 32 channels): the store
quantizes, every reader dequantizes (see the backends).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from itertools import accumulate, chain
from typing import Protocol

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step, for every sequence in the batch.

    slot_mapping:    (N,)    cache slot (block * block_size + offset) for each new token's K/V
    query_start_loc: (B+1,)  offsets of each sequence's new tokens in the flattened batch
    seq_lens:        (B,)    context length of each sequence after this step (cached + new)
    block_tables:    (B, M)  physical block ids per sequence, padded with 0
    positions:       (N,)    absolute position of each new token
    Host copies (lists) of the lengths are kept so the reference path needs no device sync.

    groups: with several KV groups (kv/groups.py), each group's own slot_mapping and block_tables,
    group 0's being the fields above; a layer reads `for_group(its group)`.

    static_decode marks a CUDA-graph decode batch (built by DecodeGraphs): row i is the one new token
    of sequence i, rows past the live batch are padding (slot -1, seq_len 0), and the host lists
    describe the captured shape only, so a backend must plan from tensor shapes alone.
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    positions: torch.Tensor
    block_size: int
    query_lens_host: list[int]
    seq_lens_host: list[int]
    static_decode: bool = False
    groups: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()  # per KV group: (slot_mapping, block_tables)
    layer_groups: tuple[int, ...] = ()  # each layer's KV group (empty: one group)
    _cache: dict = field(default_factory=dict, repr=False)

    def for_layer(self, i: int) -> AttentionMetadata:
        """The metadata layer i's attention reads (its KV group's)."""
        return self.for_group(self.layer_groups[i]) if self.layer_groups else self

    def for_group(self, g: int) -> AttentionMetadata:
        """The metadata a layer of KV group g reads: this step with that group's slots and block tables
        (memoised: one object per group and step, so per-step memos are shared by the group's layers)."""
        if g == 0:
            return self
        def build() -> AttentionMetadata:
            slot_mapping, block_tables = self.groups[g]
            return dataclasses.replace(self, slot_mapping=slot_mapping, block_tables=block_tables, groups=(),
                                       layer_groups=(),
                                       _cache={k: v for k, v in self._cache.items() if k in _SHARED_MEMOS})
        return self.memo(("group", g), build)

    @property
    def query_starts_host(self) -> list[int]:
        return self.memo("qstarts", lambda: [0, *accumulate(self.query_lens_host)][:-1])

    def query_start_loc_host_ends(self) -> list[int]:
        """Flat index of each sequence's last new token."""
        return [a + n - 1 for a, n in zip(self.query_starts_host, self.query_lens_host)]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def all_decode(self) -> bool:
        """Every sequence of the step has one new token (no prefill chunk)."""
        return self.memo("all_decode", lambda: max(self.query_lens_host, default=0) == 1)

    @property
    def max_query_len(self) -> int:
        """The most new tokens any sequence has in this step."""
        return self.memo("max_query_len", lambda: max(self.query_lens_host, default=0))

    def token_seqs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each new token as its own attention row, as a decode token is: its sequence's index (N,) and
        the number of keys it sees (N,): the sequence's earlier tokens and the new ones up to itself
        (causal within the step). All-decode steps (a CUDA-graph batch too): arange(B) and seq_lens."""
        def build() -> tuple[torch.Tensor, torch.Tensor]:
            dev = self.block_tables.device
            if self.all_decode:
                return torch.arange(self.seq_lens.shape[0], device=dev), self.seq_lens
            q = np.asarray(self.query_lens_host, dtype=np.int64)  # (B,)
            seq = np.repeat(np.arange(len(q)), q)  # (N,) each token's sequence
            first = np.repeat(np.cumsum(q) - q, q)  # (N,) flat index of its sequence's first new token
            lens = np.asarray(self.seq_lens_host, dtype=np.int64)[seq] - q[seq] + np.arange(len(seq)) - first + 1
            return torch.from_numpy(seq).to(dev), torch.from_numpy(lens).to(dev)
        return self.memo("token_seqs", build)

    def token_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """token_seqs with each token's block table gathered: (N, M) and the keys it sees (N,).
        All-decode steps: block_tables and seq_lens as they are."""
        def build() -> tuple[torch.Tensor, torch.Tensor]:
            if self.all_decode:
                return self.block_tables, self.seq_lens
            seq, lens = self.token_seqs()
            return self.block_tables[seq], lens
        return self.memo("token_rows", build)

    def memo(self, key: object, build):  # type: ignore[no-untyped-def]
        """Per-step memo for derived tensors (gather indices, masks) shared by all layers."""
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]


# per-step memos that do not depend on a group's slots or tables: computed once, shared by every group
_SHARED_MEMOS = ("qstarts", "all_decode", "max_query_len", "token_seqs")


def pack_block_tables(tables: list[list[int]]) -> torch.Tensor:
    """Block tables as a (B, M) int64 host tensor, rows padded with 0 (M = the longest table); a
    windowed group's dropped blocks (NULL_BLOCK, -1) become 0 too: masked, never read for a result.
    All ids in one np.fromiter pass, scattered by a row-length mask: far cheaper than torch.tensor
    on nested lists, and than row-by-row numpy assignment, at large batches (host work per step)."""
    lens = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))  # (B,)
    width = int(lens.max()) if len(tables) else 0
    flat = np.fromiter(chain.from_iterable(tables), dtype=np.int64, count=int(lens.sum()))  # (sum of lengths,)
    out = np.zeros((len(tables), width), dtype=np.int64)  # (B, M)
    out[np.arange(width) < lens[:, None]] = np.maximum(flat, 0)  # row-major: each row's ids in order
    return torch.from_numpy(out)


class AttentionBackend(Protocol):
    """Stores the new K/V into the paged cache and attends over each sequence's whole context."""

    supports_cuda_graphs: bool  # can run a static_decode batch (no host-side lengths, padding rows)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, window: int | None) -> torch.Tensor:
        """q: (N, H, d), k/v: (N, Hkv, d), kv_cache: (2, num_slots, Hkv, d) or a QuantizedKV
        (data (2, num_slots, Hkv, d) int8 / float8, scale (2, num_slots, Hkv) float32) -> (N, H, d)."""
        ...
