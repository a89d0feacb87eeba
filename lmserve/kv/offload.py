"""The prefix cache's second tier: the KV of blocks the pool evicts, kept in host memory or in files under a
directory, by their chained hash, and written back into the pool when a later prompt reaches past the
pool's own hit (vLLM's KV offloading to the CPU, SGLang's hierarchical cache, llama.cpp's saved slots).

Data path. `BlockManager._take_free` calls `save(group, hash, block)` for a cached block it is about to hand
out for other tokens, while the block still holds its KV (so every writer of the pool - a step, a
score, an imported prefix - finds its blocks already saved); a write-back tier: a block costs a copy
only when the pool lets it go. `save` never raises (a failure is a block not kept: it is a cache). The
Scheduler, admitting a sequence, looks its prefix up in the pool and the tier together
(`find_cached_prefix(..., tier=has)`: the tier's index alone, so no file is read for a sequence the pool
cannot take yet; a hit the tier holds is IN_TIER, a windowed group's block out of the hit's window is not
needed at all); once the pool has room for the sequence, `fetch` reads the tier's hits (a block gone or
damaged fails it and leaves the index: the scheduler looks again, twice at most, then the pool alone),
the scheduler allocates fresh blocks for them with the rest, and `load` writes them in and registers
their hashes: from there they are ordinary cached blocks. A
sequence preempted by recompute finds its own blocks there too.

State it owns: `index`, key (the group's byte + the block's chained hash) -> the block's bytes (host
memory; None for a file on disk), least recently used first, bounded by `capacity` blocks; the counters.
A block's bytes are every cache tensor's slots of the block (K/V, and a quantized cache's scales; a
pool block holds one KV group's layers), each part padded to 8 bytes.

Directory tier (`kv_offloading_dir`): one file per block, `DIR/<layout id>/<key hex>.kv`: a header
(magic, the key, crc32 of the data) and the data. The layout id is a sha256 over FORMAT, the model's
fingerprint (kv/transfer.py) and the cache layout, so files of other weights, another layout or an
older format are never read (nor deleted: other folders are the operator's). `_Files`' thread writes
them (the engine thread only copies the block to host memory); it holds no KV tensor, so an engine
dropped without `close` frees its cache (its writer finishes the queue and ends). A save that finds the
writer QUEUE_BYTES behind is skipped; a write that fails drops the block (warned once). Files survive
restarts: `close` (and interpreter exit) saves the pool's cached blocks the tier lacks, and a new engine
indexes the files it finds (newest kept when over capacity; unreadable names skipped). A file whose
size, hash or crc is wrong is deleted and counts as a miss. Replicas of one model may share a
directory: files appear whole (written aside, then renamed; a stray temporary file is removed after an
hour), and each process bounds what it indexes (N replicas: up to N x the size on disk).

Any KV groups (Gemma 3's hybrid cache, all-windowed models); not with tensor parallelism (each rank
holds a share of the heads).
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
import weakref
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from lmserve.kv.block_manager import IN_TIER
from lmserve.kv.cache import KVCache
from lmserve.kv.transfer import model_fingerprint

log = logging.getLogger("lmserve")

FORMAT = 2  # the files' layout: part in the layout id, so a change never reads old files as valid
MAGIC = b"LMKB"
HEADER = struct.Struct("<4s33sIQ")  # magic, key (group byte + block hash), crc32 of the data, data bytes
KEY_HEX = 66
QUEUE_BYTES = 256 << 20  # blocks waiting for the writer thread, at most (and at least 64 blocks)
STALE_TMP_S = 3600  # a temporary file older than this belongs to no live writer


def _align(n: int) -> int:
    return -(-n // 8) * 8


def _key(group: int, h: bytes) -> bytes:
    """A block's key in the tier (and its file's name and header): the KV group's byte + the chained hash."""
    return bytes([group]) + h


class _Files:
    """A directory tier's files and writer thread. Shares the tier's index and lock; holds no KV."""

    def __init__(self, folder: Path, index: OrderedDict, lock: threading.Lock, block_bytes: int) -> None:
        self.dir, self.index, self.lock, self.block_bytes = folder, index, lock, block_bytes
        self.queue: queue.Queue[tuple[bytes, torch.Tensor, Any] | None] = queue.Queue(max(64, QUEUE_BYTES // block_bytes))
        self.failed = 0
        self.thread = threading.Thread(target=self._run, name="lmserve-kv-offload", daemon=True)
        self.thread.start()

    def scan(self) -> list[bytes]:
        """The hashes of the folder's block files, oldest first; stale temporary files removed."""
        found = []
        for p in self.dir.iterdir():
            try:
                if p.suffix == ".tmp":
                    if time.time() - p.stat().st_mtime > STALE_TMP_S:
                        p.unlink(missing_ok=True)
                elif p.suffix == ".kv" and len(p.stem) == KEY_HEX:
                    found.append((p.stat().st_mtime, bytes.fromhex(p.stem)))
            except (OSError, ValueError):  # gone meanwhile (a replica's trim), or not one of ours
                continue
        return [h for _, h in sorted(found)]

    def path(self, h: bytes) -> Path:
        return self.dir / f"{h.hex()}.kv"

    def unlink(self, h: bytes) -> None:
        try:
            self.path(h).unlink(missing_ok=True)
        except OSError as e:  # a read-only folder: the file stays, the index forgets it
            log.debug("KV offload: cannot remove %s (%s)", self.path(h), e)

    def put(self, h: bytes, data: torch.Tensor, block: bool = False) -> None:
        """Queue a block's bytes for its file (from the engine thread, after the copy was issued)."""
        copied = None
        if data.is_pinned() and torch.cuda.is_available():
            copied = torch.cuda.Event()
            copied.record()
        self.queue.put((h, data, copied), block=block)

    def stop(self, wait: bool = True) -> None:
        """Write what is queued, then end the thread."""
        if self.thread.is_alive():
            self.queue.put(None)
            if wait:
                self.thread.join()

    def _run(self) -> None:
        while (item := self.queue.get()) is not None:
            h, data, copied = item
            if copied is not None:  # a CUDA event: the device-to-host copy has landed
                copied.synchronize()
            raw = memoryview(data.numpy())  # (no copy)
            tmp = self.path(h).with_suffix(f".{os.getpid()}.tmp")  # whole files only, by rename
            try:
                with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
                    f.write(HEADER.pack(MAGIC, h, zlib.crc32(raw), len(raw)))
                    f.write(raw)
                os.replace(tmp, self.path(h))
            except OSError as e:  # a full or read-only disk: the block is not kept (never held in memory)
                if not self.failed:
                    log.warning("KV offload: cannot write %s (%s); blocks that cannot be written are dropped", tmp, e)
                self.failed += 1
                with self.lock:
                    if self.index.get(h) is data:
                        del self.index[h]
                try:
                    tmp.unlink(missing_ok=True)
                except OSError:
                    pass
                continue
            with self.lock:
                if h in self.index:
                    if self.index[h] is data:
                        self.index[h] = None  # on disk now
                    continue
            self.unlink(h)  # dropped while it was being written

    def read(self, h: bytes) -> torch.Tensor | None:
        """A file's data, checked (size, hash, crc); None, the file deleted and the entry dropped, if bad."""
        try:
            raw = self.path(h).read_bytes()
        except OSError:
            raw = b""
        ok = len(raw) == HEADER.size + self.block_bytes
        if ok:
            magic, key, crc, n = HEADER.unpack_from(raw)
            body = memoryview(raw)[HEADER.size:]
            ok = magic == MAGIC and key == h and n == self.block_bytes and zlib.crc32(body) == crc
        if not ok:
            log.warning("KV offload: %s is damaged or gone; dropped", self.path(h))
            with self.lock:
                self.index.pop(h, None)
            self.unlink(h)
            return None
        return torch.frombuffer(bytearray(body), dtype=torch.uint8)


class OffloadTier:
    """Evicted prefix blocks' KV by chained hash: in host memory (directory None) or in files under
    `directory`, at most `capacity` bytes; `model_id` (bytes) keys the files to the weights."""

    def __init__(self, kv: KVCache, capacity: int, directory: str | os.PathLike | None = None,
                 model_id: bytes = b"") -> None:
        self.bs = kv.block_size
        self.parts = kv.parts()  # (P, slots, ...) views every block's slots are taken from
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
        self.saved = self.loaded = self.dropped = self.skipped = self.hit_tokens = 0
        self.lock = threading.Lock()  # index entries, between the engine thread and the writer
        self.files: _Files | None = None
        if directory is not None:
            layout = json.dumps([FORMAT, self.bs, [(list(t.shape[:1]) + list(t.shape[2:]), str(t.dtype)) for t in self.parts]])
            folder = Path(directory) / hashlib.sha256(model_id + layout.encode()).hexdigest()[:16]
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)  # prompts' KV: the owner's alone
            self.files = _Files(folder, self.index, self.lock, self.block_bytes)
            self.index.update((h, None) for h in self.files.scan())
            self._trim()
            weakref.finalize(self, self.files.stop, False)  # dropped without close: the writer still ends

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
        if buf.device.type == "cpu":
            return buf
        host = torch.empty(self.block_bytes, dtype=torch.uint8, pin_memory=True)  # no sync per evicted block:
        return host.copy_(buf, non_blocking=True)  # a later load is stream-ordered; the writer waits on an event

    def write(self, blocks: list[int], datas: list[torch.Tensor]) -> None:
        """Copy saved bytes into pool blocks (fresh ones the caller holds)."""
        for block, data in zip(blocks, datas):
            s, e = block * self.bs, (block + 1) * self.bs
            data = data.to(self.parts[0].device)
            for t, (off, n) in zip(self.parts, self.spans):
                dst = t[:, s:e]
                dst.copy_(data[off:off + n].view(t.dtype).view(dst.shape))
        self.loaded += len(blocks)

    # ---------------------------------------------------------------- the index
    def save(self, group: int, h: bytes, block: int) -> None:
        """Keep block's KV (group's layers) under hash h (the pool is about to reuse the block). Never
        raises: the block manager calls it mid-allocation, and a block not kept is only a miss later."""
        h = _key(group, h)
        try:
            with self.lock:
                if h in self.index:
                    self.index.move_to_end(h)
                    return
            if self.files is not None and (self.files.queue.full() or not self.files.thread.is_alive()):
                self.skipped += 1  # the writer is behind (or closed): no copy for nothing
                return
            self._keep(h, block)
            self._trim()
        except Exception as e:  # noqa: BLE001 - out of host memory, a device error: the block is not kept
            with self.lock:
                self.index.pop(h, None)
            self.skipped += 1
            log.warning("KV offload: a block was not saved (%s: %s)", type(e).__name__, e)

    def _keep(self, key: bytes, block: int, wait: bool = False) -> None:
        """Copy block's bytes into the index under key (and queue its file; wait: for room in the queue)."""
        data = self._read_block(block)
        with self.lock:
            self.index[key] = data  # on disk: kept until the writer has the file
        if self.files is not None:
            self.files.put(key, data, block=wait)  # (save: only the engine thread puts, and it was not full)
        self.saved += 1

    def has(self, group: int, h: bytes) -> bool:
        """Whether the tier holds group's block of hash h: find_cached_prefix's `tier`. The index alone,
        nothing read, no entry's place in the LRU order moved (load marks what a hit used)."""
        with self.lock:
            return _key(group, h) in self.index

    def fetch(self, seq: Any, prefix: list[list[int]]) -> list[torch.Tensor] | None:
        """The bytes of the blocks a hit (find_cached_prefix's `prefix`) takes from the tier, in its places'
        order, each marked recently used; None if one is gone or damaged (it leaves the index). Read before
        the allocation, whose evictions would otherwise be written out beside the reads."""
        datas = []
        for g, i in self._places(prefix):
            key = _key(g, seq.block_hashes[i])
            with self.lock:
                data = self.index.get(key, False)
                if data is not False:
                    self.index.move_to_end(key)  # recently used
            if data is None and self.files is not None:
                data = self.files.read(key)
            if data is None or data is False:
                return None
            datas.append(data)
        return datas

    def load(self, bm: Any, seq: Any, prefix: list[list[int]], cached: int, datas: list[torch.Tensor]) -> None:
        """Write `fetch`'s bytes into the fresh blocks the sequence's tables hold in the hit's IN_TIER places
        and register the hit's blocks in the prefix cache."""
        todo = self._places(prefix)
        self.write([seq.block_tables[g][i] for g, i in todo], datas)
        self.hit_tokens += self.bs * len({i for _, i in todo})  # (token positions: a block per group each)
        bm.cache_full_blocks(seq.block_tables, seq.token_ids, cached, seq.block_hashes, 0, seq.cache_salt)

    @staticmethod
    def _places(prefix: list[list[int]]) -> list[tuple[int, int]]:
        """(group, block index) of a hit's IN_TIER places."""
        return [(g, i) for g, p in enumerate(prefix) for i, b in enumerate(p) if b == IN_TIER]

    def _trim(self) -> None:
        with self.lock:
            gone = [self.index.popitem(last=False)[0] for _ in range(len(self.index) - self.capacity)]
        self.dropped += len(gone)
        if self.files is not None:
            for h in gone:
                self.files.unlink(h)

    def clear(self) -> None:
        """Forget every block (reset_prefix_cache), its files too."""
        with self.lock:
            gone = list(self.index)
            self.index.clear()
        if self.files is not None:
            for h in gone:
                self.files.unlink(h)

    def close(self, bm: Any = None) -> None:
        """A directory tier: save the pool's cached blocks it lacks (bm given: nothing else may touch the
        pool meanwhile), write what is queued, stop the writer, unhook from bm's evictions."""
        if self.files is None or not self.files.thread.is_alive():
            return
        if bm is not None:
            bm.on_evict = None
            for (g, h), b in list(bm.hash_to_block.items()):
                if _key(g, h) not in self.index:
                    self._keep(_key(g, h), b, wait=True)  # (waits for room in the queue: the writer runs)
            self._trim()
        self.files.stop()

    def stats(self) -> dict[str, int]:
        return {"blocks": len(self.index), "capacity_blocks": self.capacity, "saved_blocks": self.saved,
                "loaded_blocks": self.loaded, "dropped_blocks": self.dropped, "skipped_blocks": self.skipped,
                "failed_writes": self.files.failed if self.files is not None else 0}


def _close_at_exit(tier: weakref.ref, bm: weakref.ref) -> None:
    t, b = tier(), bm()
    if t is not None:
        t.close(b)


def build_offload(config: Any, kv: KVCache, bm: Any, model: torch.nn.Module, model_config: Any) -> OffloadTier | None:
    """The engine's tier from its config (kv_offloading_size, kv_offloading_dir), hooked to the block
    manager's evictions; None when off. ValueError naming the field for a cache it cannot serve."""
    if not config.kv_offloading_size:
        return None
    if not config.enable_prefix_caching:
        raise ValueError("kv_offloading_size: the offload tier extends the prefix cache; enable_prefix_caching must be on")
    if kv.groups.num_groups > 255:  # (a key's group is one byte)
        raise ValueError(f"kv_offloading_size: a model of {kv.groups.num_groups} KV groups; the tier keys at most 255")
    model_id = model_fingerprint(model_config, model) if config.kv_offloading_dir is not None else b""
    tier = OffloadTier(kv, int(config.kv_offloading_size), config.kv_offloading_dir, model_id)
    bm.on_evict = tier.save
    if tier.files is not None:  # an engine never closed (a script, `lmserve chat`) still saves its pool at exit
        atexit.register(_close_at_exit, weakref.ref(tier), weakref.ref(bm))
    return tier
