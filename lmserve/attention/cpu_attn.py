"""The CPU attention backend: decode tokens read the paged cache in place with our C kernel
(layers/csrc/paged_attn.c: no gather of every page into a dense copy per layer per step), and so do
steps of a few new tokens a sequence (speculative verification, short chunks: each token a row of its
own, AttentionMetadata.token_rows); longer prefill chunks go through the torch reference (SDPA over
the gathered pages: compute-bound, where the gather is a small share). The kernel reads float32, bf16
and int8 caches (kv_cache_dtype int8: a QuantizedKV, quantized on store as QuantizedKV.store does);
an fp8 cache or an unusual dtype takes the reference path whole; tests/test_cpu_attn.py holds the
kernel to the float64 oracle.
"""

from __future__ import annotations

import torch

from lmserve.attention.backend import AttentionMetadata
from lmserve.attention.torch_ref import TorchAttention
from lmserve.kv.cache import QuantizedKV
from lmserve.layers import cpu_native

ROWS_PER_SEQ = 16  # up to this many new tokens a sequence, a step's tokens are all kernel rows


class CpuAttention(TorchAttention):
    """TorchAttention with the decode part through cpu_native.paged_decode_attention; a step of at most
    `rows_per_seq` new tokens a sequence (decode, verification) stores its K/V and attends in one call
    per layer, a token a row. rows_per_seq None: every step so (deterministic mode: a token's
    attention is then computed the same way however its prompt was chunked or batched)."""

    def __init__(self, rows_per_seq: int | None = ROWS_PER_SEQ) -> None:
        self.rows_per_seq = rows_per_seq

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor | QuantizedKV,
                meta: AttentionMetadata, scale: float, window: int | None) -> torch.Tensor:
        if _reads(q, kv_cache) and not meta.static_decode and (self.rows_per_seq is None
                                                                 or meta.max_query_len <= self.rows_per_seq):
            tables, lens = meta.token_rows()  # (N, M), (N,)
            want = torch.float32 if isinstance(kv_cache, QuantizedKV) else kv_cache.dtype  # what the store reads
            new_kv = (k.to(want), v.to(want), meta.slot_mapping)  # a bf16 model's K/V into an int8 cache: float32
            o = cpu_native.paged_decode_attention(q, kv_cache, tables, lens, meta.block_size,
                                                  scale, window, new_kv=new_kv)  # (N, H, d)
            return o if o.dtype == q.dtype else o.to(q.dtype)
        return super().forward(q, k, v, kv_cache, meta, scale, window)

    def decode(self, q: torch.Tensor, kv_cache: torch.Tensor | QuantizedKV, meta: AttentionMetadata, dec: list[int],
               scale: float, window: int | None, out: torch.Tensor) -> None:
        if not _reads(q, kv_cache):
            return super().decode(q, kv_cache, meta, dec, scale, window, out)
        idx = torch.tensor(dec)
        tok, tables, lens = meta.query_start_loc[idx], meta.block_tables[idx], meta.seq_lens[idx]
        o = cpu_native.paged_decode_attention(q.index_select(0, tok), kv_cache, tables, lens,  # type: ignore[arg-type]
                                              meta.block_size, scale, window)  # (Bd, H, d)
        out.index_copy_(0, tok, o.to(out.dtype))


def _reads(q: torch.Tensor, kv_cache: torch.Tensor | QuantizedKV) -> bool:
    """The kernel reads this cache: a float32 / bf16 tensor or an int8 QuantizedKV on the CPU (fp8: the
    reference)."""
    return q.device.type == "cpu" and cpu_native.kv_reads(kv_cache)
