"""The KV tensors, sized from a memory budget. One entry per layer: (2, num_slots, kv_heads, head_dim)
in the model dtype, or, with kv_cache_dtype int8 / fp8, a `QuantizedKV` (the same layout in one byte
per element, plus a float32 scale per slot, head and group of KV_GROUP = 32 channels).

A slot is `block * block_size + offset`; the flat slot axis is what the store path indexes with the
runner's slot_mapping, and what the gather path indexes through block tables.

Quantization is symmetric absmax per token, head and group of 32 channels (the whole head when
head_dim is not a multiple of 32): scale = max|x| / QMAX over the group's elements, element =
round(x / scale) (int8: to the nearest integer in [-127, 127]; fp8 e4m3fn: to the nearest float8,
the absmax mapping to 448), x ~ element * scale. Round-trip error per element: int8 <= scale / 2 =
absmax / 254; fp8 <= max(|x| / 16, scale / 1024) (3 mantissa bits; subnormals below 2^-6 are
spaced 2^-9). Groups, not one scale per head: keys carry a few large channels that set a whole
head's step. On SmolLM2-135M (head_dim 64, fp32, 1,023 tokens of eval text) one scale per head cost
+0.90% perplexity and a KL divergence from the float cache's next-token distribution of 2.6e-3 nats
(keys alone 2.4e-3, values alone 0.2e-3); groups of 32 cost +0.46% and 1.2e-3. The scales cost 4
bytes per token, head, group and K/V, which bytes_per_block counts, so the pool from a budget holds
(32 * d_bytes) / (32 + 4) times the tokens of the float cache (int8 vs bf16: 1.78x; vs fp32: 3.56x;
head_dim 16, one scale per head: 1.6x / 3.2x).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from typing import Any

import torch

from lmserve.config import ModelConfig
from lmserve.kv.groups import KVGroups
from lmserve.utils import to_device

SCALE_DTYPE = torch.float32
SCALE_BYTES = 4
KV_GROUP = 32  # channels of a K / V row that share a scale


def kv_group_size(head_dim: int) -> int:
    """Channels per scale: KV_GROUP, or the whole head when head_dim is not a multiple of it."""
    return KV_GROUP if head_dim % KV_GROUP == 0 else head_dim


def kv_scale_groups(head_dim: int) -> int:
    """Scales per token, head and K/V."""
    return head_dim // kv_group_size(head_dim)


def slot(block_table: list[int], pos: int, block_size: int) -> int:
    """The cache slot of token position `pos` of a sequence: block * block_size + offset."""
    return block_table[pos // block_size] * block_size + pos % block_size


def slots(block_table: list[int], start: int, n: int, block_size: int) -> list[int]:
    """The cache slots of token positions [start, start + n) of a sequence (vectorised `slot`)."""
    if n == 1:  # a decode: the common case, without numpy
        return [block_table[start // block_size] * block_size + start % block_size]
    p = np.arange(start, start + n)  # (n,)
    return (np.asarray(block_table)[p // block_size] * block_size + p % block_size).tolist()


def kv_quant_dtype(kv_cache_dtype: str) -> torch.dtype | None:
    """The element dtype of a quantized cache ('int8', 'fp8'), None for 'auto' (the model dtype)."""
    if kv_cache_dtype == "auto":
        return None
    if kv_cache_dtype == "int8":
        return torch.int8
    if kv_cache_dtype == "fp8":
        fp8 = getattr(torch, "float8_e4m3fn", None)
        if fp8 is None:
            raise ValueError("kv_cache_dtype='fp8' needs a torch build with torch.float8_e4m3fn")
        return fp8
    raise ValueError(f"kv_cache_dtype must be one of auto, int8, fp8, got {kv_cache_dtype!r}")


def qmax(dtype: torch.dtype) -> float:
    """The element value the absmax of a (token, head) row maps to: 127 (int8), 448 (fp8 e4m3fn)."""
    return 127.0 if dtype == torch.int8 else 448.0


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., d) -> (elements (..., d) in `dtype`, scales (..., d // g) float32), absmax per group of
    g = kv_group_size(d) channels.

    Computed in float32 with IEEE division (what the Triton store kernel does too, bit for bit). The
    divisor is a tensor on x's device: CUDA divides by a host scalar as a multiply by its reciprocal,
    which is one bit off for some values (4.6% of absmaxes / 127, 54% / 448)."""
    d = x.shape[-1]
    g = kv_group_size(d)
    xf = x.float().reshape(*x.shape[:-1], d // g, g)  # (..., G, g)
    qm = qmax(dtype)
    scale = xf.abs().amax(dim=-1) / torch.full((), qm, device=xf.device)  # (..., G)
    y = (xf / torch.where(scale > 0, scale, 1.0).unsqueeze(-1)).clamp(-qm, qm)
    if dtype == torch.int8:
        y = y.round()  # half to even
    return y.reshape(x.shape).to(dtype), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """elements (..., d), scales (..., G) (a scale per d // G channels) -> (..., d) in `dtype` (the
    product is taken in float32)."""
    groups = scale.shape[-1]
    x = q.float().reshape(*q.shape[:-1], groups, -1) * scale.float().unsqueeze(-1)  # (..., G, g)
    return x.reshape(q.shape).to(dtype)


def _raw(t: torch.Tensor) -> torch.Tensor:
    """A view for indexing: float8 as uint8 (CPU index_copy_ / index_select lack float8 kernels)."""
    return t.view(torch.uint8) if t.dtype.itemsize == 1 and t.dtype != torch.int8 else t


@dataclass
class QuantizedKV:
    """One layer's quantized cache: data (2, S, Hkv, d) int8 / float8_e4m3fn, scale (2, S, Hkv, G) float32
    with G = kv_scale_groups(d) (a scale per kv_group_size(d) channels).

    What the model hands each attention backend in place of the float tensor; the backends check
    for it (isinstance) to store quantized and read dequantized."""

    data: torch.Tensor
    scale: torch.Tensor

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @classmethod
    def empty(cls, slots: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
              device: str | torch.device) -> QuantizedKV:
        return cls(torch.zeros(2, slots, kv_heads, head_dim, dtype=dtype, device=device),
                   torch.zeros(2, slots, kv_heads, kv_scale_groups(head_dim), dtype=SCALE_DTYPE, device=device))

    @classmethod
    def from_float(cls, cache: torch.Tensor, dtype: torch.dtype) -> QuantizedKV:
        """A float cache (2, S, Hkv, d) quantized slot by slot (tests; a cache written earlier)."""
        return cls(*quantize(cache, dtype))

    def store(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Quantize k, v (N, Hkv, d) and write them, with their scales, at slot_mapping (N,)."""
        for i, x in enumerate((k, v)):
            q, s = quantize(x, self.data.dtype)
            _raw(self.data[i]).index_copy_(0, slot_mapping, _raw(q))
            self.scale[i].index_copy_(0, slot_mapping, s)

    def read(self, i: int, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """K (i = 0) or V (i = 1) at `slots` (n,), dequantized: (n, Hkv, d) in `dtype`."""
        q = _raw(self.data[i]).index_select(0, slots).view(self.data.dtype)
        return dequantize(q, self.scale[i].index_select(0, slots), dtype)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole cache as a float tensor (2, S, Hkv, d) (tests, the float64 oracle)."""
        return dequantize(self.data, self.scale, dtype)

    def copy_slots(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy slots src -> dst, elements and scales (copy-on-write)."""
        raw = _raw(self.data)
        raw.index_copy_(1, dst, raw.index_select(1, src))
        self.scale.index_copy_(1, dst, self.scale.index_select(1, src))

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scale.numel() * self.scale.element_size()


class KVCache:
    """Owns the K/V tensors (float tensors, or QuantizedKV with kv_cache_dtype int8 / fp8): one per
    place in a KV group (kv/groups.py), which the layers at that place of every group share; `layers[i]`
    is layer i's. A model of one layer kind has one group, so one tensor per layer."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: str | torch.device, kv_cache_dtype: str = "auto", hybrid: bool = True) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.kv_cache_dtype = kv_cache_dtype
        self.groups = KVGroups.from_config(cfg, hybrid)
        qdtype = kv_quant_dtype(kv_cache_dtype)
        parts, heads, width = cfg.kv_entry_shape
        if qdtype is not None and parts != 2:
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r}: quantized caches hold K and V per head; "
                             f"{cfg.architecture} caches another row (use kv_cache_dtype='auto')")
        slots = num_blocks * block_size
        self.tensors: list[torch.Tensor | QuantizedKV] = [
            torch.zeros(parts, slots, heads, width, dtype=dtype, device=device) if qdtype is None
            else QuantizedKV.empty(slots, heads, width, qdtype, device)
            for _ in range(self.groups.layers_per_group)]
        self.layers = [self.tensors[self.groups.place(i)[1]] for i in range(cfg.num_layers)]
        self.layer_groups = tuple(self.groups.place(i)[0] for i in range(cfg.num_layers))
        self.mirror: Any = None  # tensor parallel, rank 0: sends each block copy to the other ranks' caches

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto",
                        hybrid: bool = True) -> int:
        """Bytes of one pool block: block_size tokens of one group's layers (every layer, for a model of
        one kind): K/V elements, plus, when quantized, their float32 scales (one per token, head,
        group of channels and K/V)."""
        qdtype = kv_quant_dtype(kv_cache_dtype)
        parts, heads, width = cfg.kv_entry_shape
        layers = KVGroups.from_config(cfg, hybrid).layers_per_group
        elems = layers * parts * heads * width  # per token
        if qdtype is None:
            return elems * block_size * torch.tensor([], dtype=dtype).element_size()
        scales_per_token = layers * parts * heads * kv_scale_groups(width)
        return block_size * (elems * qdtype.itemsize + scales_per_token * SCALE_BYTES)

    @classmethod
    def blocks_for_budget(cls, cfg: ModelConfig, block_size: int, dtype: torch.dtype, budget: int,
                          kv_cache_dtype: str = "auto", hybrid: bool = True) -> int:
        return budget // cls.bytes_per_block(cfg, block_size, dtype, kv_cache_dtype, hybrid)

    def parts(self) -> list[torch.Tensor]:
        """Every tensor of the cache as a (parts, slots, ...) view that a block's slots are taken from: the
        K/V elements (float8 as uint8: CPU index_copy_ lacks it) and a quantized cache's scales."""
        out: list[torch.Tensor] = []
        for t in self.tensors:
            out += [_raw(t.data), t.scale] if isinstance(t, QuantizedKV) else [t]
        return out

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst in every layer (copy-on-write for forked sequences); a quantized
        layer copies its scales too."""
        if not copies:
            return
        if self.mirror is not None:
            self.mirror(copies)
        bs = self.block_size
        dev = self.tensors[0].device
        off = torch.arange(bs, device=dev)
        pairs = to_device(torch.tensor(copies, dtype=torch.long), dev)  # (C, 2): src, dst
        src = (pairs[:, :1] * bs + off).reshape(-1)  # (C*bs,)
        dst = (pairs[:, 1:] * bs + off).reshape(-1)  # (C*bs,)
        for layer in self.tensors:  # (2, slots, Hkv, d), or QuantizedKV
            if isinstance(layer, QuantizedKV):
                layer.copy_slots(dst, src)
            else:
                layer.index_copy_(1, dst, layer.index_select(1, src))
