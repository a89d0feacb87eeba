"""The KV tensors, sized from a memory budget. One tensor per layer: (2, num_slots, kv_heads, head_dim).

A slot is `block * block_size + offset`; the flat slot axis is what the store path indexes with the
runner's slot_mapping, and what the gather path indexes through block tables.
"""

from __future__ import annotations

import numpy as np
import torch

from lmserve.config import ModelConfig
from lmserve.utils import to_device


def slot(block_table: list[int], pos: int, block_size: int) -> int:
    """The cache slot of token position `pos` of a sequence: block * block_size + offset."""
    return block_table[pos // block_size] * block_size + pos % block_size


def slots(block_table: list[int], start: int, n: int, block_size: int) -> list[int]:
    """The cache slots of token positions [start, start + n) of a sequence (vectorised `slot`)."""
    if n == 1:
        return [slot(block_table, start, block_size)]
    p = np.arange(start, start + n)  # (n,)
    return (np.asarray(block_table)[p // block_size] * block_size + p % block_size).tolist()


class KVCache:
    """Owns the per-layer K/V tensors."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: str | torch.device) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        slots = num_blocks * block_size
        self.layers = [torch.zeros(2, slots, cfg.num_kv_heads, cfg.head_dim, dtype=dtype, device=device)
                       for _ in range(cfg.num_layers)]

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        return cfg.kv_elems_per_token * block_size * torch.tensor([], dtype=dtype).element_size()

    @classmethod
    def blocks_for_budget(cls, cfg: ModelConfig, block_size: int, dtype: torch.dtype, budget: int) -> int:
        return budget // cls.bytes_per_block(cfg, block_size, dtype)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst in every layer (copy-on-write for forked sequences)."""
        if not copies:
            return
        bs = self.block_size
        dev = self.layers[0].device
        off = torch.arange(bs, device=dev)
        pairs = to_device(torch.tensor(copies, dtype=torch.long), dev)  # (C, 2): src, dst
        src = (pairs[:, :1] * bs + off).reshape(-1)  # (C*bs,)
        dst = (pairs[:, 1:] * bs + off).reshape(-1)  # (C*bs,)
        for layer in self.layers:  # (2, slots, Hkv, d)
            layer.index_copy_(1, dst, layer.index_select(1, src))
