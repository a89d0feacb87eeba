"""The prefix cache's second tier: the KV of blocks the pool evicts, kept in host memory or in files under a
directory, by their chained hash, and written back into the pool when a later prompt reaches past the
pool's own hit (vLLM's KV offloading to the CPU, SGLang's hierarchical cache, llama.cpp's saved slots).

Data path. `BlockManager._take_free` calls `save(hash, block)` for a cached block it is about to hand
out for other tokens, while the block still holds its KV (so every writer of the pool - a step, a
score, an imported prefix - finds its blocks already saved); a write-back tier: a block costs a copy
only when the pool lets it go. The Scheduler, admitting a sequence, asks `lookup` for the blocks past
its pool hit that the tier holds (their data, in order, checked), allocates fresh blocks for them with
the rest, `write`s the data in and registers their hashes at once: from there they are ordinary cached
blocks, and the sequence computes only what follows. A sequence preempted by recompute finds its own
blocks there too.

State it owns: `index`, hash -> the block's bytes (host memory; None for a file on disk), least
recently used first, bounded by `capacity` blocks; the counters. A block's bytes are every cache
tensor's slots of the block (K/V, and a quantized cache's scales), each part padded to 8 bytes.

Directory tier (`kv_offloading_dir`): one file per block, `DIR/<layout id>/<hash hex>.kv`: a header
(magic, the hash, crc32 of the data) and the data. The layout id is a sha256 over the model's
fingerprint (kv/transfer.py) and the cache layout, so files of other weights or another layout are
never read. A thread writes the files (the engine thread only copies the block to host memory); a
save that finds the thread behind by WRITE_QUEUE blocks is skipped (it is a cache). Files survive
restarts: at close the pool's cached blocks not in the tier are saved too, and a new engine indexes the
files it finds (newest kept when over capacity). A file whose size, hash or crc is wrong is deleted and
counts as a miss. Replicas of one model may share a directory: files appear whole (written aside, then
renamed), and each process bounds what it indexes.

Models of one KV group without a sliding window (Gemma 3 with --disable-hybrid-kv-cache-manager);
not with tensor parallelism (each rank holds a share of the heads).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import struct
import threading
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from lmserve.kv.cache import KVCache, QuantizedKV, _raw
from lmserve.kv.transfer import model_fingerprint

log = logging.getLogger("lmserve")

MAGIC = b"LMKB"
HEADER = struct.Struct("<4s32sIQ")  # magic, block hash, crc32 of the data, data bytes
WRITE_QUEUE = 64  # blocks waiting for the writer thread at most


def _align(n: int) -> int:
    return -(-n // 8) * 8


class OffloadTier:
    """Evicted prefix blocks' KV by chained hash: in host memory (directory None) or in files under
    `directory`, at most `capacity` bytes; `model_id` (bytes) keys the files to the weights."""

    def __init__(self, kv: KVCache, capacity: int, directory: str | os.PathLike | None = None,
                 model_id: bytes = b"") -> None:
        self.kv = kv
        self.bs = kv.block_size
        self.parts: list[torch.Tensor] = []  # (P, slots, ...) views every block's slots are taken from
        for t in kv.tensors:
            self.parts += [_raw(t.data), t.scale] if isinstance(t, QuantizedKV) else [t]
        self.spans = []  # (offset, bytes) of each part in a block's bytes
        off = 0
        for t in self.parts:
            n = t[:, :self.bs].numel() * t.element_size()
            self.spans.append((off, n))
            off = _align(off + n)
        self.block_bytes = off
        self.padded = off != sum(n for _, n in self.spans)
        self.capacity = capacity // self.block_bytes
        if self.capacity < 1:
            raise ValueError(f"kv_offloading_size: {capacity} bytes holds no KV block of {self.block_bytes} bytes")
        self.index: OrderedDict[bytes, torch.Tensor | None] = OrderedDict()
        self.saved = self.loaded = self.dropped = self.skipped = 0
        self.lock = threading.Lock()  # index entries, between the engine thread and the writer
        self.dir: Path | None = None
        if directory is not None:
            layout = json.dumps([self.bs, [(list(t.shape[:1]) + list(t.shape[2:]), str(t.dtype)) for t in self.parts]])
            self.dir = Path(directory) / hashlib.sha256(model_id + layout.encode()).hexdigest()[:16]
            self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # prompts' KV: the owner's alone
            for p in self.dir.glob("*.tmp"):  # a file a stopped process was writing
                p.unlink(missing_ok=True)
            files = sorted(self.dir.glob("*.kv"), key=lambda p: p.stat().st_mtime)
            for p in files:
                if len(p.stem) == 64:
                    self.index[bytes.fromhex(p.stem)] = None
            self._trim()
            self.queue: queue.Queue[tuple[bytes, torch.Tensor] | None] = queue.Queue(WRITE_QUEUE)
            self.writer = threading.Thread(target=self._write_files, name="lmserve-kv-offload", daemon=True)
            self.writer.start()

    def __len__(self) -> int:
        return len(self.index)

    # ---------------------------------------------------------------- pool <-> host bytes
    def _read_block(self, block: int) -> torch.Tensor:
        """Block `block`'s bytes: every part's slots, (block_bytes,) uint8 on the host."""
        s, e = block * self.bs, (block + 1) * self.bs
        fill = torch.zeros if self.padded else torch.empty  # (padding: zeros, never stale memory in a file)
        buf = fill(self.block_bytes, dtype=torch.uint8, device=self.parts[0].device)
        for t, (off, n) in zip(self.parts, self.spans):
            src = t[:, s:e]  # (P, bs, ...)
            buf[off:off + n].view(t.dtype).view(src.shape).copy_(src)
        return buf.cpu()

    def write(self, blocks: list[int], datas: list[torch.Tensor]) -> None:
        """Copy saved bytes (lookup's) into pool blocks (fresh ones the caller holds)."""
        for block, data in zip(blocks, datas):
            s, e = block * self.bs, (block + 1) * self.bs
            data = data.to(self.parts[0].device)
            for t, (off, n) in zip(self.parts, self.spans):
                dst = t[:, s:e]
                dst.copy_(data[off:off + n].view(t.dtype).view(dst.shape))
        self.loaded += len(blocks)

    # ---------------------------------------------------------------- the index
    def save(self, h: bytes, block: int) -> None:
        """Keep block's KV under hash h (the pool is about to reuse the block)."""
        with self.lock:
            if h in self.index:
                self.index.move_to_end(h)
                return
        data = self._read_block(block)
        with self.lock:
            self.index[h] = data  # on disk: kept until the writer has the file
        if self.dir is not None:
            try:
                self.queue.put_nowait((h, data))
            except queue.Full:
                with self.lock:
                    self.index.pop(h, None)
                self.skipped += 1
                return
        self.saved += 1
        self._trim()

    def lookup(self, hashes: list[bytes]) -> list[torch.Tensor]:
        """The bytes of hashes' leading blocks that the tier holds (stops at the first it does not),
        each marked recently used."""
        out = []
        for h in hashes:
            with self.lock:
                data = self.index.get(h, False)
                if data is False:
                    break
                self.index.move_to_end(h)
            if data is None:
                data = self._read_file(h)
                if data is None:
                    break
            out.append(data)
        return out

    def hit(self, bm: Any, seq: Any, cached: int, limit: int | None) -> list[torch.Tensor]:
        """The bytes of the blocks the tier holds right after a sequence's pool hit of `cached` tokens,
        up to the block holding token `limit` (the scheduler's rule: default, the last token stays to run)."""
        last = seq.num_tokens - 1 if limit is None else limit
        hashes = bm.block_hashes(seq.token_ids, max(0, last) // self.bs, seq.block_hashes, seq.cache_salt)
        return self.lookup(hashes[cached // self.bs:])

    def load(self, bm: Any, seq: Any, cached: int, datas: list[torch.Tensor]) -> int:
        """Write `hit`'s blocks into the sequence's fresh blocks after its pool hit and register them in
        the prefix cache. Returns the tokens now cached."""
        first = cached // self.bs
        self.write(seq.block_tables[0][first:first + len(datas)], datas)
        end = cached + len(datas) * self.bs
        bm.cache_full_blocks(seq.block_tables, seq.token_ids, end, seq.block_hashes, first, seq.cache_salt)
        return end

    def _trim(self) -> None:
        with self.lock:
            gone = [self.index.popitem(last=False)[0] for _ in range(len(self.index) - self.capacity)]
        self.dropped += len(gone)
        for h in gone:
            self._unlink(h)

    def clear(self) -> None:
        """Forget every block (reset_prefix_cache), its files too."""
        with self.lock:
            gone = list(self.index)
            self.index.clear()
        for h in gone:
            self._unlink(h)

    def close(self, bm: Any) -> None:
        """A directory tier: save the pool's cached blocks it lacks, then wait for the writer."""
        if self.dir is None or not self.writer.is_alive():
            return
        for (_, h), b in list(bm.hash_to_block.items()):
            if h not in self.index:
                data = self._read_block(b)
                with self.lock:
                    self.index[h] = data
                self.queue.put((h, data))
                self.saved += 1
        self._trim()
        self.queue.put(None)
        self.writer.join()

    # ---------------------------------------------------------------- files
    def _path(self, h: bytes) -> Path:
        assert self.dir is not None
        return self.dir / f"{h.hex()}.kv"

    def _unlink(self, h: bytes) -> None:
        if self.dir is not None:
            self._path(h).unlink(missing_ok=True)

    def _write_files(self) -> None:
        while (item := self.queue.get()) is not None:
            h, data = item
            raw = memoryview(data.numpy())  # (no copy)
            tmp = self._path(h).with_suffix(f".{os.getpid()}.tmp")  # whole files only, by rename
            try:
                with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
                    f.write(HEADER.pack(MAGIC, h, zlib.crc32(raw), len(raw)))
                    f.write(raw)
                os.replace(tmp, self._path(h))
            except OSError as e:  # a full disk: the block stays in memory until dropped
                log.warning("KV offload: cannot write %s (%s)", tmp, e)
                tmp.unlink(missing_ok=True)
                continue
            with self.lock:
                if h in self.index:
                    if self.index[h] is data:
                        self.index[h] = None  # on disk now
                    continue
            self._unlink(h)  # dropped while it was being written

    def _read_file(self, h: bytes) -> torch.Tensor | None:
        """A file's data, checked (size, hash, crc); None, the file deleted and the entry dropped, if bad."""
        try:
            raw = self._path(h).read_bytes()
        except OSError:
            raw = b""
        ok = len(raw) == HEADER.size + self.block_bytes
        if ok:
            magic, key, crc, n = HEADER.unpack_from(raw)
            body = memoryview(raw)[HEADER.size:]
            ok = magic == MAGIC and key == h and n == self.block_bytes and zlib.crc32(body) == crc
        if not ok:
            log.warning("KV offload: %s is damaged or gone; dropped", self._path(h))
            with self.lock:
                self.index.pop(h, None)
            self._unlink(h)
            return None
        return torch.frombuffer(bytearray(body), dtype=torch.uint8)

    def stats(self) -> dict[str, int]:
        return {"blocks": len(self.index), "capacity_blocks": self.capacity, "saved_blocks": self.saved,
                "loaded_blocks": self.loaded, "dropped_blocks": self.dropped, "skipped_blocks": self.skipped}


def build_offload(config: Any, kv: KVCache, bm: Any, model: torch.nn.Module, model_config: Any) -> OffloadTier | None:
    """The engine's tier from its config (kv_offloading_size, kv_offloading_dir), hooked to the block
    manager's evictions; None when off. ValueError naming the field for a cache it cannot serve."""
    if not config.kv_offloading_size:
        return None
    if not config.enable_prefix_caching:
        raise ValueError("kv_offloading_size: the offload tier extends the prefix cache; enable_prefix_caching must be on")
    if kv.groups.num_groups != 1 or kv.groups.windows != (None,):
        raise ValueError("kv_offloading_size: the offload tier takes models of one KV group without a sliding "
                         "window (for Gemma 3: disable_hybrid_kv_cache_manager=True)")
    model_id = model_fingerprint(model_config, model) if config.kv_offloading_dir is not None else b""
    tier = OffloadTier(kv, int(config.kv_offloading_size), config.kv_offloading_dir, model_id)
    bm.on_evict = tier.save
    return tier
