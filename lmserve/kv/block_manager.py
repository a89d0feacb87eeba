"""The block manager: which physical KV blocks are free, who holds each one, and the prefix cache.

State it owns: a reference count per block, the free queue (LRU order: the block at the front is
reused first), and the map from a full block's chained token hash to the block holding it. It never
touches tensors; the Sequence owns its own block table (a list of block ids) and the manager
edits it only through the methods below.

Prefix caching: a full block's hash is sha256(hash of the block before + its token ids), so equal
hashes mean equal whole prefixes (a cryptographic hash, as vLLM uses: with Python's `hash()` a
crafted prompt could collide with another tenant's block and read its KV). A block whose last holder leaves keeps its hash and goes to the
back of the free queue; a new request with the same prefix takes it back (a hit) until it is reused
for other tokens (then its hash is dropped).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass


@dataclass
class BlockStats:
    """A snapshot of the pool: total / free (including cached) / cached-free / in use."""

    total: int
    free: int
    cached: int
    used: int


def chain_hash(parent: bytes | None, tokens: Seq[int]) -> bytes:
    """sha256 over the parent block's hash and this block's token ids (int64 each)."""
    return hashlib.sha256((parent or b"") + array("q", tokens).tobytes()).digest()


class BlockManager:
    """Free list + reference counts + prefix hash map over `num_blocks` blocks of `block_size` tokens."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache has no blocks: raise kv_cache_memory")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.hash_to_block: dict[bytes, int] = {}

    # ---------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def stats(self) -> BlockStats:
        cached = sum(1 for b in self.free_queue if self.block_hash[b] is not None)
        return BlockStats(self.num_blocks, len(self.free_queue), cached, self.num_blocks - len(self.free_queue))

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_hashes(self, token_ids: Seq[int], num_full: int, known: list[bytes] | None = None) -> list[bytes]:
        """Chained hashes of the first `num_full` full blocks of token_ids.

        `known` is the caller's memo of hashes already computed for these tokens (a Sequence keeps
        one); it is extended in place, so each block is hashed once in a sequence's life.
        """
        out = known if known is not None else []
        bs = self.block_size
        for i in range(len(out), num_full):
            out.append(chain_hash(out[-1] if out else None, token_ids[i * bs:(i + 1) * bs]))
        return out[:num_full]

    def find_cached_prefix(self, token_ids: Seq[int], known: list[bytes] | None = None) -> list[int]:
        """Blocks holding the longest cached prefix of token_ids, leaving >= 1 token to compute."""
        if not self.enable_prefix_caching:
            return []
        num_full = (len(token_ids) - 1) // self.block_size
        blocks = []
        for h in self.block_hashes(token_ids, num_full, known):
            b = self.hash_to_block.get(h)
            if b is None:
                break
            blocks.append(b)
        return blocks

    # ---------------------------------------------------------------- mutations
    def allocate(self, block_table: list[int], num_tokens: int, cached_prefix: list[int] = ()) -> bool:  # type: ignore[assignment]
        """Give an empty block table the cached prefix blocks plus fresh blocks up to num_tokens.

        Returns False (changing nothing) when the pool cannot supply them.
        """
        assert not block_table, "allocate() is for a sequence that holds no blocks"
        need_new = self.blocks_needed(num_tokens) - len(cached_prefix)
        revived = sum(1 for b in cached_prefix if self.ref_count[b] == 0)
        if need_new + revived > len(self.free_queue):
            return False
        for b in cached_prefix:
            if self.ref_count[b] == 0:
                del self.free_queue[b]
            self.ref_count[b] += 1
            block_table.append(b)
        for _ in range(need_new):
            block_table.append(self._take_free())
        return True

    def reserve(self, block_table: list[int], start: int, end: int) -> list[tuple[int, int]] | None:
        """Make token positions [start, end) of a sequence writable: append fresh blocks to cover
        `end`, and give the sequence a private copy of any block in the range that others still hold
        (copy-on-write). Returns the (src, dst) block copies the runner must do before writing, or
        None (changing nothing) when the pool is short.
        """
        bs = self.block_size
        shared = [i for i in range(start // bs, min(len(block_table), -(-end // bs)))
                  if self.ref_count[block_table[i]] > 1]
        grow = max(0, self.blocks_needed(end) - len(block_table))
        if grow + len(shared) > len(self.free_queue):
            return None
        copies = []
        for i in shared:
            src = block_table[i]
            dst = self._take_free()
            self.ref_count[src] -= 1  # still > 0: another holder keeps it
            block_table[i] = dst
            copies.append((src, dst))
        for _ in range(grow):
            block_table.append(self._take_free())
        return copies

    def shrink(self, block_table: list[int], num_tokens: int) -> None:
        """Release the blocks past what num_tokens needs (speculative rollback)."""
        keep = self.blocks_needed(num_tokens)
        tail = block_table[keep:]
        del block_table[keep:]
        self.free(tail)

    def fork(self, block_table: list[int]) -> list[int]:
        """A new block table sharing every block of `block_table` (one more reference each)."""
        for b in block_table:
            self.ref_count[b] += 1
        return list(block_table)

    def free(self, block_table: list[int]) -> None:
        """Drop one reference to each block; tail blocks enter the free queue first (evicted first)."""
        for b in reversed(block_table):
            self.ref_count[b] -= 1
            assert self.ref_count[b] >= 0, f"block {b} freed more often than held"
            if self.ref_count[b] == 0:
                self.free_queue[b] = None
        block_table.clear()

    def cache_full_blocks(self, block_table: list[int], token_ids: Seq[int], num_computed: int,
                          known: list[bytes] | None = None, first: int = 0) -> None:
        """Register the hashes of the full, computed blocks of a sequence so others can share them;
        blocks before `first` were seen on an earlier step."""
        if not self.enable_prefix_caching:
            return
        num_full = min(num_computed // self.block_size, len(block_table))
        hashes = self.block_hashes(token_ids, num_full, known)
        for i in range(first, num_full):
            b, h = block_table[i], hashes[i]
            if self.block_hash[b] is not None:
                continue  # already registered (a hit, or registered on an earlier step)
            if h in self.hash_to_block:
                continue  # another block holds the same content; keep the first
            self.block_hash[b] = h
            self.hash_to_block[h] = b

    def _take_free(self) -> int:
        b, _ = self.free_queue.popitem(last=False)
        h = self.block_hash[b]
        if h is not None:  # evict: its old content is about to be overwritten
            del self.hash_to_block[h]
            self.block_hash[b] = None
        self.ref_count[b] = 1
        return b
