"""The CPU attention backend: decode tokens read the paged cache in place with our C kernel
(layers/csrc/paged_attn.c: no gather of every page into a dense copy per layer per step), prefill
chunks go through the torch reference (SDPA over the gathered pages: compute-bound, where the gather
is a small share). A quantized cache (QuantizedKV) or an unusual cache dtype takes the reference path
whole; tests/test_cpu_attn.py holds the kernel to the float64 oracle.
"""

from __future__ import annotations

import torch

from lmserve.attention.backend import AttentionMetadata
from lmserve.attention.torch_ref import TorchAttention
from lmserve.kv.cache import QuantizedKV
from lmserve.layers import cpu_native


class CpuAttention(TorchAttention):
    """TorchAttention with the decode part through cpu_native.paged_decode_attention."""

    def decode(self, q: torch.Tensor, kv_cache: torch.Tensor | QuantizedKV, meta: AttentionMetadata, dec: list[int],
               scale: float, window: int | None, out: torch.Tensor) -> None:
        if isinstance(kv_cache, QuantizedKV) or kv_cache.dtype not in (torch.float32, torch.bfloat16) \
                or q.device.type != "cpu":
            return super().decode(q, kv_cache, meta, dec, scale, window, out)
        tok, tables, lens = meta.memo("cpu_decode", lambda: _decode_rows(meta, dec))
        o = cpu_native.paged_decode_attention(q.index_select(0, tok), kv_cache[0], kv_cache[1], tables, lens,
                                              meta.block_size, scale, window)  # (Bd, H, d)
        out.index_copy_(0, tok, o.to(out.dtype))


def _decode_rows(meta: AttentionMetadata, dec: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token index (Bd,), block tables (Bd, T) and context lengths (Bd,) of the decode sequences."""
    if len(dec) == meta.num_seqs:  # an all-decode step: every row, no copies
        return meta.query_start_loc[:-1], meta.block_tables, meta.seq_lens
    idx = torch.tensor(dec)
    return meta.query_start_loc[idx], meta.block_tables[idx], meta.seq_lens[idx]
