"""Moving a prompt's KV blocks between engines (prefill / decode disaggregation), as raw tensor bytes.

`export_prefix` (on the prefill instance, after a prompt ran) reads the prompt's full blocks that its
prefix cache holds; `import_prefix` (on the decode instance) writes them into free blocks and registers
their hashes in its prefix cache, so the request that follows - and any later one with the same prefix
- hits them and computes only the rest. Both run on the engine thread, between steps.

Wire format (little-endian; never pickle): a fixed header struct HEADER (magic, version, block size,
layers per KV group, K/V parts, KV heads, head dim, element bytes, tokens, blocks), then the tokens as
int64, then the KV elements of every tensor of the cache, block by block: (tensors, parts, blocks x
block_size, heads, head_dim) in the cache's dtype. The receiver checks every field against its own
cache and refuses what does not fit (a ValueError naming the field).
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import torch

MAGIC = b"LMKV"
VERSION = 1
HEADER = struct.Struct("<4sIqqqqqqqq")  # magic, version, block_size, tensors, parts, heads, head_dim, elem, tokens, blocks


def _plain_cache(engine: Any) -> list[torch.Tensor]:
    kv = engine.kv_cache
    if kv.groups.num_groups != 1 or not all(isinstance(t, torch.Tensor) for t in kv.tensors):
        raise ValueError("KV transfer: only a float KV cache of one group (no sliding-window groups, no int8 / "
                         "fp8 KV) moves between instances")
    return kv.tensors


def _slots(blocks: list[int], block_size: int, device: torch.device) -> torch.Tensor:
    b = torch.tensor(blocks, dtype=torch.long)
    return (b[:, None] * block_size + torch.arange(block_size)).reshape(-1).to(device)  # (n * block_size,)


def export_prefix(engine: Any, token_ids: list[int]) -> bytes:
    """The KV of token_ids' full blocks that the prefix cache holds, in the wire format (0 blocks: a header
    and nothing else)."""
    tensors = _plain_cache(engine)
    bm = engine.block_manager
    hit = bm.find_cached_prefix(token_ids, limit=len(token_ids))
    blocks = hit[0] if hit else []
    bs = bm.block_size
    tokens = token_ids[:len(blocks) * bs]
    parts, _, heads, dim = tensors[0].shape
    head = HEADER.pack(MAGIC, VERSION, bs, len(tensors), parts, heads, dim, tensors[0].element_size(), len(tokens),
                       len(blocks))
    if not blocks:
        return head
    idx = _slots(blocks, bs, tensors[0].device)
    data = torch.stack([t.index_select(1, idx) for t in tensors]).cpu().contiguous()  # (T, parts, n*bs, H, d)
    return head + np.asarray(tokens, dtype="<i8").tobytes() + data.view(torch.uint8).numpy().tobytes()


def import_prefix(engine: Any, payload: bytes) -> int:
    """Write a peer's exported blocks into free blocks of this engine and register them in its prefix
    cache (as cached, unreferenced blocks: evicted in LRU order like any other). Returns the blocks
    registered (0 when none were sent, all were cached already, or the pool has no room)."""
    tensors = _plain_cache(engine)
    if len(payload) < HEADER.size:
        raise ValueError("KV transfer: payload shorter than its header")
    magic, version, bs, n_t, parts, heads, dim, elem, n_tok, n_blk = HEADER.unpack_from(payload)
    bm = engine.block_manager
    mine = (MAGIC, VERSION, bm.block_size, len(tensors), *tensors[0].shape[:1], *tensors[0].shape[2:],
            tensors[0].element_size())
    theirs = (magic, version, bs, n_t, parts, heads, dim, elem)
    names = ("magic", "version", "block_size", "tensors", "parts", "kv_heads", "head_dim", "element_bytes")
    for name, a, b in zip(names, theirs, mine):
        if a != b:
            raise ValueError(f"KV transfer: {name} {a!r} does not match this instance's {b!r}")
    if n_tok != n_blk * bs or len(payload) != HEADER.size + 8 * n_tok + n_t * parts * n_tok * heads * dim * elem:
        raise ValueError("KV transfer: payload length does not match its header")
    if n_blk == 0:
        return 0
    tokens = np.frombuffer(payload, dtype="<i8", count=n_tok, offset=HEADER.size).tolist()
    cached = bm.find_cached_prefix(tokens, limit=n_tok)
    have = len(cached[0]) if cached else 0
    if have == n_blk:
        return 0
    tables: list[list[int]] = []
    if not bm.allocate(tables, n_tok, cached):
        return 0  # no room: the request recomputes its prompt, as without a transfer
    data = torch.frombuffer(bytearray(payload[HEADER.size + 8 * n_tok:]), dtype=torch.uint8)
    data = data.view(tensors[0].dtype).view(n_t, parts, n_tok, heads, dim)
    new = tables[0][have:]
    idx = _slots(new, bs, tensors[0].device)
    for t, src in zip(tensors, data):  # (parts, n_tok, H, d): the blocks not cached here already
        t.index_copy_(1, idx, src[:, have * bs:].to(t.device))
    bm.cache_full_blocks(tables, tokens, n_tok)
    bm.free(tables)
    return len(new)
