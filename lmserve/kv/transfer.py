"""Moving a prompt's KV blocks between engines (prefill / decode disaggregation), as raw tensor bytes.

`export_prefix` (on the prefill instance, after a prompt ran) reads the prompt's full blocks that its
prefix cache holds; `import_prefix` (on the decode instance) writes them into free blocks and registers
their hashes in its prefix cache, so the request that follows - and any later one with the same prefix
- hits them and computes only the rest. Both run on the engine thread, between steps.

Wire format (little-endian; never pickle): a fixed header struct HEADER (magic, version, the model's
fingerprint, block size, layers per KV group, K/V parts, KV heads, head dim, element bytes, dtype code,
tokens, blocks, whether the blocks are salted, the salt: the request's block-hash salt, from its
cache_salt and LoRA adapter, so they land under the hashes the same request finds), then the
tokens as int64, then the KV elements of every tensor of the cache, block by block: (tensors, parts,
blocks x block_size, heads, head_dim) in the cache's dtype. The receiver checks every field against its
own cache, and that every element is finite, off the engine thread (`parse`), and refuses what does
not fit (a ValueError naming the field); only then does the engine thread write (`import_prefix`).
Both sides must serve the same weights: the fingerprint (sha256 over the model's config and a sample
of every weight tensor) tells two models of one shape apart, and a float from a quantized copy.
Sliding-window models do not take part (their caches drop blocks out of the window).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
from typing import Any

import numpy as np
import torch

MAGIC = b"LMKV"
VERSION = 4
HEADER = struct.Struct("<4sI32sqqqqqqqqqq32s")  # magic, version, fingerprint, block_size, tensors, parts, heads,
#                                                head_dim, elem, dtype, tokens, blocks, salted, salt
DTYPES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}


def check_engine(engine: Any) -> list[torch.Tensor]:
    """The cache tensors of an engine that can take part in a transfer; ValueError naming what cannot."""
    kv, c = engine.kv_cache, engine.config
    if kv.groups.num_groups != 1 or not all(isinstance(t, torch.Tensor) for t in kv.tensors) \
            or any(w is not None for w in kv.groups.windows):
        raise ValueError("KV transfer: only a float KV cache of one group without a sliding window (no "
                         "int8 / fp8 KV) moves between instances")
    if c.tensor_parallel_size > 1:
        raise ValueError("KV transfer: not with tensor_parallel_size > 1 (each rank holds only its KV heads)")
    if not c.enable_prefix_caching:
        raise ValueError("KV transfer: enable_prefix_caching must be on (the moved blocks live in the prefix cache)")
    return kv.tensors


def fingerprint(engine: Any) -> bytes:
    """An engine's model_fingerprint."""
    return model_fingerprint(engine.model_config, engine.model)


@torch.no_grad()
def model_fingerprint(model_config: Any, model: torch.nn.Module) -> bytes:
    """sha256 over the model's config and 16 evenly spaced elements of every weight tensor (as float64):
    equal for two loads of one checkpoint with one quantization, different otherwise (~ms)."""
    h = hashlib.sha256(json.dumps(dataclasses.asdict(model_config), sort_keys=True, default=str).encode())
    for name, t in model.state_dict().items():
        flat = t.detach().reshape(-1)
        h.update(name.encode() + flat[::max(1, flat.numel() // 16)][:16].to(torch.float64).cpu().numpy().tobytes())
    return h.digest()


def _slots(blocks: list[int], block_size: int, device: torch.device) -> torch.Tensor:
    b = torch.tensor(blocks, dtype=torch.long)
    return (b[:, None] * block_size + torch.arange(block_size)).reshape(-1).to(device)  # (n * block_size,)


def export_prefix(engine: Any, token_ids: list[int], model: bytes | None = None, salt: bytes | None = None) -> bytes:
    """The KV of token_ids' full blocks that the prefix cache holds under `salt` (Sequence.cache_salt: a
    salted or adapter request's), in the wire format (0 blocks: a header and nothing else). model: the
    engine's fingerprint, if the caller keeps it (else computed here)."""
    tensors = check_engine(engine)
    bm = engine.block_manager
    if salt is not None and len(salt) != 32:
        raise ValueError("KV transfer: a salt is a 32-byte digest")
    hit = bm.find_cached_prefix(token_ids, limit=len(token_ids), salt=salt)
    blocks = hit[0] if hit else []
    bs = bm.block_size
    tokens = token_ids[:len(blocks) * bs]
    parts, _, heads, dim = tensors[0].shape
    head = HEADER.pack(MAGIC, VERSION, model or fingerprint(engine), bs, len(tensors), parts, heads, dim, tensors[0].element_size(),
                       DTYPES[tensors[0].dtype], len(tokens), len(blocks), salt is not None, salt or bytes(32))
    if not blocks:
        return head
    idx = _slots(blocks, bs, tensors[0].device)
    data = torch.stack([t.index_select(1, idx) for t in tensors]).cpu().contiguous()  # (T, parts, n*bs, H, d)
    return head + np.asarray(tokens, dtype="<i8").tobytes() + data.view(torch.uint8).numpy().tobytes()


def parse(engine: Any, payload: bytes, model: bytes | None = None
          ) -> tuple[list[int], torch.Tensor | None, bytes | None]:
    """A peer's payload checked against this engine's cache and its fingerprint `model` (computed here if
    not given) (read-only: any thread may call it) -> (tokens, KV (tensors, parts, tokens, heads,
    head_dim) in the cache's dtype, or None for no blocks, the blocks' salt or None)."""
    tensors = check_engine(engine)
    if len(payload) < HEADER.size:
        raise ValueError("KV transfer: payload shorter than its header")
    magic, version, model_fp, bs, n_t, parts, heads, dim, elem, dtype, n_tok, n_blk, salted, salt = HEADER.unpack_from(payload)
    t0 = tensors[0]
    mine = (MAGIC, VERSION, engine.block_manager.block_size, len(tensors), t0.shape[0], t0.shape[2], t0.shape[3],
            t0.element_size(), DTYPES.get(t0.dtype))
    theirs = (magic, version, bs, n_t, parts, heads, dim, elem, dtype)
    names = ("magic", "version", "block_size", "tensors", "parts", "kv_heads", "head_dim", "element_bytes", "dtype")
    for name, a, b in zip(names, theirs, mine):
        if a != b:
            raise ValueError(f"KV transfer: {name} {a!r} does not match this instance's {b!r}")
    if model_fp != (model or fingerprint(engine)):
        raise ValueError("KV transfer: model fingerprint does not match this instance's (the peers serve "
                         "different weights, or one quantized differently)")
    if n_blk < 0 or n_tok != n_blk * bs or len(payload) != HEADER.size + 8 * n_tok + n_t * parts * n_tok * heads * dim * elem:
        raise ValueError("KV transfer: payload length does not match its header")
    tokens = np.frombuffer(payload, dtype="<i8", count=n_tok, offset=HEADER.size).tolist()
    if any(not 0 <= t < engine.model_config.vocab_size for t in tokens):
        raise ValueError("KV transfer: a token id outside the vocabulary")
    salt_or_none = salt if salted else None
    if n_blk == 0:
        return tokens, None, salt_or_none
    data = torch.frombuffer(bytearray(payload[HEADER.size + 8 * n_tok:]), dtype=torch.uint8)
    data = data.view(t0.dtype).view(n_t, parts, n_tok, heads, dim)
    if not torch.isfinite(data).all():
        raise ValueError("KV transfer: non-finite values")
    return tokens, data, salt_or_none


def import_prefix(engine: Any, payload: bytes | tuple[list[int], torch.Tensor | None, bytes | None]) -> int:
    """Write a peer's exported blocks (a payload, or what `parse` made of one) into free blocks of this
    engine and register them in its prefix cache (as cached, unreferenced blocks: evicted in LRU order
    like any other). Engine thread. Returns the blocks registered (0 when none were sent, all were
    cached already, or the pool has no room)."""
    tokens, data, salt = parse(engine, payload) if isinstance(payload, (bytes, bytearray)) else payload
    if data is None:
        return 0
    tensors, bm = engine.kv_cache.tensors, engine.block_manager
    bs, n_tok = bm.block_size, len(tokens)
    n_blk = n_tok // bs
    cached = bm.find_cached_prefix(tokens, limit=n_tok, salt=salt)
    have = len(cached[0]) if cached else 0
    if have == n_blk:
        return 0
    tables: list[list[int]] = []
    if not bm.allocate(tables, n_tok, cached):
        return 0  # no room: the request recomputes its prompt, as without a transfer
    new = tables[0][have:]
    idx = _slots(new, bs, tensors[0].device)
    for t, src in zip(tensors, data):  # (parts, n_tok, H, d): the blocks not cached here already
        t.index_copy_(1, idx, src[:, have * bs:].to(t.device))
    bm.cache_full_blocks(tables, tokens, n_tok, salt=salt)
    bm.free(tables)
    return len(new)
