"""Reference attention in plain torch: gathers pages into dense tensors and calls SDPA.

Runs on any device and is the oracle every fast kernel is tested against. Decodes (one new token)
are batched into one padded SDPA call; prefill chunks run one sequence at a time, each attending
causally over its cached prefix plus its own new tokens. A quantized cache (QuantizedKV: int8 / fp8
elements and a scale per slot, head and group of channels) is written quantized and read by gathering the elements and
scales of the needed slots, then dequantizing them to the model dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lmserve.attention.backend import AttentionMetadata
from lmserve.kv.cache import QuantizedKV


def _slots_for(meta: AttentionMetadata, seq: int, length: int) -> torch.Tensor:
    """Cache slots of the first `length` tokens of sequence `seq`: (length,)."""
    j = torch.arange(length, device=meta.block_tables.device)
    return meta.block_tables[seq, j // meta.block_size] * meta.block_size + j % meta.block_size


def _decode_plan(meta: AttentionMetadata) -> tuple[list[int], list[int]]:
    dec = [i for i, n in enumerate(meta.query_lens_host) if n == 1]
    pre = [i for i, n in enumerate(meta.query_lens_host) if n > 1]
    return dec, pre


def _decode_gather(meta: AttentionMetadata, dec: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For the decode sequences: token index (Bd,), slots (Bd, L) and key positions valid (Bd, L)."""
    dev = meta.block_tables.device
    L = max(meta.seq_lens_host[i] for i in dec)
    idx = torch.tensor(dec, device=dev)
    j = torch.arange(L, device=dev)  # (L,)
    bt = meta.block_tables[idx]  # (Bd, M)
    slots = bt.gather(1, (j // meta.block_size).expand(len(dec), L)) * meta.block_size + j % meta.block_size
    lens = meta.seq_lens[idx]  # (Bd,)
    valid = j.unsqueeze(0) < lens.unsqueeze(1)  # (Bd, L)
    tok = meta.query_start_loc[idx]  # (Bd,)
    return tok, slots.masked_fill(~valid, 0), valid


class TorchAttention:
    """Backend: torch SDPA over gathered pages."""

    supports_cuda_graphs = False  # gathers to the longest context, a host-side length


    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor | QuantizedKV,
                meta: AttentionMetadata, scale: float, window: int | None) -> torch.Tensor:
        if meta.static_decode:
            raise ValueError("the torch attention backend cannot run a static (CUDA-graph) decode batch")
        if isinstance(kv_cache, QuantizedKV):
            kv_cache.store(k, v, meta.slot_mapping)
        else:
            kv_cache[0].index_copy_(0, meta.slot_mapping, k)  # (S, Hkv, d)
            kv_cache[1].index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)  # (N, H, d)
        dec, pre = meta.memo("plan", lambda: _decode_plan(meta))
        if dec:
            self.decode(q, kv_cache, meta, dec, scale, window, out)
        for i in pre:
            n, L = meta.query_lens_host[i], meta.seq_lens_host[i]
            start = meta.query_starts_host[i]
            slots = meta.memo(("slots", i), lambda: _slots_for(meta, i, L))  # (L,)
            kk = _gather(kv_cache, 0, slots, q.dtype).transpose(0, 1).unsqueeze(0)  # (1, Hkv, L, d)
            vv = _gather(kv_cache, 1, slots, q.dtype).transpose(0, 1).unsqueeze(0)  # (1, Hkv, L, d)
            qq = q[start:start + n].transpose(0, 1).unsqueeze(0)  # (1, H, n, d)
            mask = meta.memo(("mask", i, window), lambda: _causal_mask(L - n, n, L, window, q.device))
            o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=scale,
                                               enable_gqa=True)  # (1, H, n, d)
            out[start:start + n] = o[0].transpose(0, 1)
        return out

    def decode(self, q: torch.Tensor, kv_cache: torch.Tensor | QuantizedKV, meta: AttentionMetadata, dec: list[int],
               scale: float, window: int | None, out: torch.Tensor) -> None:
        """The one-token sequences `dec`: their pages gathered into one padded SDPA call, written to out."""
        tok, slots, valid = meta.memo("decode", lambda: _decode_gather(meta, dec))
        Bd, L = slots.shape
        mask = valid if window is None else meta.memo(
            ("decode_mask", window), lambda: _window_mask(valid, meta.positions[tok], window))  # (Bd, L)
        flat = slots.reshape(-1)
        Hkv, d = kv_cache_shape(kv_cache)
        kk = _gather(kv_cache, 0, flat, q.dtype).view(Bd, L, Hkv, d).transpose(1, 2)  # (Bd, Hkv, L, d)
        vv = _gather(kv_cache, 1, flat, q.dtype).view(Bd, L, Hkv, d).transpose(1, 2)  # (Bd, Hkv, L, d)
        qq = q.index_select(0, tok).unsqueeze(2)  # (Bd, H, 1, d)
        o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask[:, None, None, :],
                                           scale=scale, enable_gqa=True)  # (Bd, H, 1, d)
        out.index_copy_(0, tok, o.squeeze(2))


def kv_cache_shape(kv_cache: torch.Tensor | QuantizedKV) -> tuple[int, int]:
    """(kv heads, head dim) of a layer's cache."""
    shape = kv_cache.data.shape if isinstance(kv_cache, QuantizedKV) else kv_cache.shape  # (2, S, Hkv, d)
    return shape[-2], shape[-1]


def _gather(kv_cache: torch.Tensor | QuantizedKV, i: int, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """K (i = 0) or V (i = 1) of the cache at `slots` (n,): (n, Hkv, d) in `dtype`."""
    if isinstance(kv_cache, QuantizedKV):
        return kv_cache.read(i, slots, dtype)
    return kv_cache[i].index_select(0, slots)


def _window_mask(valid: torch.Tensor, pos: torch.Tensor, window: int) -> torch.Tensor:
    """(Bd, L) decode mask: valid keys within `window` of each query position pos (Bd,)."""
    j = torch.arange(valid.shape[1], device=valid.device)
    return valid & (j.unsqueeze(0) > (pos.unsqueeze(1) - window))


def _causal_mask(first_pos: int, n: int, L: int, window: int | None, device: torch.device) -> torch.Tensor:
    """(n, L) bool: query i (at position first_pos + i) may see key j."""
    qpos = torch.arange(first_pos, first_pos + n, device=device).unsqueeze(1)  # (n, 1)
    j = torch.arange(L, device=device).unsqueeze(0)  # (1, L)
    mask = j <= qpos
    if window is not None:
        mask &= j > qpos - window
    return mask
