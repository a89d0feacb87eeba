"""The block manager: which physical KV blocks are free, who holds each one, and the prefix cache.

State it owns: a reference count per block, the free queue (LRU order: the block at the front is
reused first), and the map from a full block's chained token hash to the block holding it. It never
touches tensors; the Sequence owns its block tables and the manager edits them only through the
methods below.

KV groups (kv/groups.py): a sequence holds one block table per group (`tables[g]`, all drawing from
the one pool). A group with a sliding window frees the blocks that fall wholly out of the window of
the next step's first token (they are never read again) and keeps NULL_BLOCK in their place, so a
long sequence's windowed groups hold at most window / block_size + 1 blocks at a decode step. A
model of one kind has one group, and every table list is `[table]`.

Prefix caching: a full block's hash is sha256(hash of the block before + its token ids), so equal
hashes mean equal whole prefixes (a cryptographic hash, as vLLM uses: with Python's `hash()` a
crafted prompt could collide with another tenant's block and read its KV). A block whose last holder leaves keeps its hash and goes to the
back of the free queue; a new request with the same prefix takes it back (a hit) until it is reused
for other tokens (then its hash is dropped). Blocks are cached per group (a block holds one group's
layers). A hit of n blocks needs, in full-attention groups, all n; in a windowed group only the
blocks the window of token n * block_size reaches back to (the ones before it may be long gone).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass
from itertools import accumulate


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


NULL_BLOCK = -1  # a windowed group's table entry for a block out of the window (freed; read as block 0, masked)
IN_TIER = -2  # find_cached_prefix with a tier: a hit the offload tier holds (allocate gives it a fresh block to load)


class BlockManager:
    """Free list + reference counts + prefix hash map over `num_blocks` blocks of `block_size` tokens,
    shared by the KV groups whose sliding windows are `windows` (None: full attention)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 windows: Seq[int | None] = (None,), max_step_tokens: int | None = None) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache has no blocks: raise kv_cache_memory")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.windows = tuple(windows)
        self.max_step_tokens = max_step_tokens  # bounds a windowed group's blocks at one step
        self.ref_count = [0] * num_blocks  # holders and pins
        self.pins: dict[int, int] = {}  # block -> the references of ref_count that are pins (pin()), not holders
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.block_group = [0] * num_blocks  # the group a hashed block is cached for
        self.hash_to_block: dict[tuple[int, bytes], int] = {}  # (group, hash) -> block
        # called with (group, hash, block) for a cached block about to be reused, while it still holds its
        # KV (the offload tier, kv/offload.py, copies it out)
        self.on_evict: Callable[[int, bytes, int], None] | None = None

    # ---------------------------------------------------------------- queries
    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def stats(self) -> BlockStats:
        cached = sum(1 for b in self.free_queue if self.block_hash[b] is not None)
        return BlockStats(self.num_blocks, len(self.free_queue), cached, self.num_blocks - len(self.free_queue))

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks one table needs to cover num_tokens tokens."""
        return -(-num_tokens // self.block_size)

    def max_blocks(self, num_tokens: int) -> int:
        """The most blocks a sequence of num_tokens tokens holds at once, every group counted (a
        windowed group: what one step's queries can see, with at most max_step_tokens new tokens)."""
        full = self.blocks_needed(num_tokens)
        step = self.max_step_tokens or num_tokens
        return sum(full if w is None else min(full, self.blocks_needed(w - 1 + step) + 1) for w in self.windows)

    def first_needed(self, g: int, start: int) -> int:
        """The first block of group g a step starting at token `start` reads (0 without a window):
        the token start - window + 1 is the earliest its first query sees."""
        w = self.windows[g]
        return 0 if w is None else max(0, start - w + 1) // self.block_size

    def block_hashes(self, token_ids: Seq[int], num_full: int, known: list[bytes] | None = None,
                     salt: bytes | None = None) -> list[bytes]:
        """Chained hashes of the first `num_full` full blocks of token_ids; the first block's chain
        starts from `salt` (a LoRA adapter's: its KV differs from the base model's for the same tokens).

        `known` is the caller's memo of hashes already computed for these tokens (a Sequence keeps
        one); it is extended in place, so each block is hashed once in a sequence's life.
        """
        out = known if known is not None else []
        bs = self.block_size
        for i in range(len(out), num_full):
            out.append(chain_hash(out[-1] if out else salt, token_ids[i * bs:(i + 1) * bs]))
        return out[:num_full]

    def find_cached_prefix(self, token_ids: Seq[int], known: list[bytes] | None = None,
                           limit: int | None = None, salt: bytes | None = None,
                           tier: Callable[[int, bytes], bool] | None = None) -> list[list[int]]:
        """Per group, the blocks of the longest cached prefix of token_ids that ends at least one token
        before `limit` (default: the last token, which is always computed, so there are logits to
        sample from); NULL_BLOCK where a windowed group does not need the block. [] for no hit.
        tier(group, hash): whether the offload tier holds a block the pool lacks (IN_TIER in the hit)."""
        if not self.enable_prefix_caching:
            return []
        limit = len(token_ids) - 1 if limit is None else limit
        hashes = self.block_hashes(token_ids, max(0, limit) // self.block_size, known, salt)
        hits = [[self.hash_to_block.get((g, h)) for h in hashes] for g in range(self.num_groups)]
        for g, row in enumerate(hits if tier is not None else ()):  # the pool's misses the tier holds
            for i, b in enumerate(row):
                if b is None and tier(g, hashes[i]):  # type: ignore[misc]
                    row[i] = IN_TIER
                elif b is None and self.windows[g] is None:
                    break  # a full group's hit ends at its first miss: nothing after it is asked
        n = len(hashes)
        for g, w in enumerate(self.windows):  # a full group needs every block of the hit
            if w is None:
                n = next((i for i, b in enumerate(hits[g][:n]) if b is None), n)
        runs = []  # per windowed group: runs[i] = cached blocks in a row ending at block i
        for g, w in enumerate(self.windows):
            if w is not None:
                run = list(accumulate((b is not None for b in hits[g]), lambda r, hit: r + 1 if hit else 0))
                runs.append((g, run))
        while n > 0 and any(run[n - 1] < n - self.first_needed(g, n * self.block_size) for g, run in runs):
            n -= 1  # a windowed group lacks a block its window needs at n: try a shorter hit
        if n == 0:
            return []
        return [[b if i >= self.first_needed(g, n * self.block_size) else NULL_BLOCK  # type: ignore[misc]
                 for i, b in enumerate(hits[g][:n])] for g in range(self.num_groups)]

    # ---------------------------------------------------------------- mutations
    def allocate(self, tables: list[list[int]], num_tokens: int, cached_prefix: Seq[list[int]] = ()) -> bool:
        """Give a sequence with no blocks one table per group: the cached prefix blocks
        (find_cached_prefix; a fresh block where it says IN_TIER, for the tier's bytes) plus fresh blocks
        up to num_tokens. Returns False (changing nothing) when the pool cannot supply them."""
        assert not tables, "allocate() is for a sequence that holds no blocks"
        prefix = list(cached_prefix) or [[] for _ in self.windows]
        held = [b for p in prefix for b in p if b >= 0]
        if not self.can_allocate(num_tokens, prefix):
            return False
        for b in held:
            if self.ref_count[b] == 0:
                del self.free_queue[b]
            self.ref_count[b] += 1
        for p in prefix:
            table = [self._take_free() if b == IN_TIER else b for b in p]
            table.extend(self._take_free() for _ in range(self.blocks_needed(num_tokens) - len(p)))
            tables.append(table)
        return True

    def can_allocate(self, num_tokens: int, cached_prefix: Seq[list[int]] = ()) -> bool:
        """Whether allocate(tables, num_tokens, cached_prefix) would succeed now (it changes nothing)."""
        prefix = list(cached_prefix) or [[] for _ in self.windows]
        need_new = self.num_groups * self.blocks_needed(num_tokens) - sum(len(p) for p in prefix) \
            + sum(p.count(IN_TIER) for p in prefix)  # an IN_TIER place takes a fresh block
        revived = sum(1 for p in prefix for b in p if b >= 0 and self.ref_count[b] == 0)
        return need_new + revived <= len(self.free_queue)

    def restore(self, template: list[list[int]]) -> list[list[int]] | None:
        """Fresh blocks in the places of a swapped-out sequence's tables (NULL_BLOCK where it held none:
        out of a window); None (changing nothing) when the pool is short."""
        need = sum(1 for t in template for b in t if b != NULL_BLOCK)
        if need > len(self.free_queue):
            return None
        return [[NULL_BLOCK if b == NULL_BLOCK else self._take_free() for b in t] for t in template]

    def reserve(self, tables: list[list[int]], start: int, end: int, keep_from: int | None = None
                ) -> list[tuple[int, int]] | None:
        """Make token positions [start, end) of a sequence writable: append fresh blocks to cover
        `end`, and give the sequence a private copy of any block in the range that others still hold
        (copy-on-write). Returns the (src, dst) block copies the runner must do before writing, or
        None (changing nothing else) when the pool is short. First, windowed groups let go of the
        blocks no step from `keep_from` (default: `start`) on reads: a caller that may roll back
        below `start` (a draft model's speculative steps) passes the position it may roll back to."""
        bs = self.block_size
        if end - start == 1 and self.windows == (None,) and len(tables) == 1:  # a decode token, one full-attention
            i = start // bs  # group (every step of most sequences: kept lean): its block is there, held alone
            if i < len(tables[0]) and self.ref_count[b := tables[0][i]] - self.pins.get(b, 0) <= 1:
                return []
        horizon = start if keep_from is None else min(start, keep_from)
        if not tables:  # holds nothing yet (a draft model's new mirror): empty tables to grow
            tables.extend([] for _ in self.windows)
        self.drop_out_of_window(tables, horizon)
        shared = [(table, i) for table in tables for i in range(start // bs, min(len(table), -(-end // bs)))
                  if self.ref_count[table[i]] - self.pins.get(table[i], 0) > 1]  # other holders: a pin is none
        grow = sum(max(0, self.blocks_needed(end) - len(table)) for table in tables)
        if grow + len(shared) > len(self.free_queue):
            return None
        copies = []
        for table, i in shared:
            src = table[i]
            dst = self._take_free()
            self.ref_count[src] -= 1  # still > 0: another holder keeps it
            table[i] = dst
            copies.append((src, dst))
        for table in tables:
            table.extend(self._take_free() for _ in range(self.blocks_needed(end) - len(table)))
        return copies

    def drop_out_of_window(self, tables: list[list[int]], start: int) -> None:
        """Windowed groups let go of the blocks no step from token `start` on reads (NULL_BLOCK in their
        place); full-attention groups keep everything."""
        for g, table in enumerate(tables):
            for i in range(min(self.first_needed(g, start), len(table)) - 1, -1, -1):
                if table[i] == NULL_BLOCK:
                    break  # everything before was dropped on an earlier step
                self._release(table[i])
                table[i] = NULL_BLOCK

    def shrink(self, tables: list[list[int]], num_tokens: int) -> None:
        """Release the blocks past what num_tokens needs (speculative rollback)."""
        keep = self.blocks_needed(num_tokens)
        for table in tables:
            tail = table[keep:]
            del table[keep:]
            for b in reversed(tail):
                self._release(b)

    def fork(self, tables: list[list[int]]) -> list[list[int]]:
        """New block tables sharing every block of `tables` (one more reference each)."""
        for table in tables:
            for b in table:
                if b >= 0:
                    self.ref_count[b] += 1
        return [list(table) for table in tables]

    def free(self, tables: list[list[int]]) -> None:
        """Drop one reference to each block of every table (tables left empty); tail blocks enter the
        free queue first (evicted first)."""
        for table in tables:
            for b in reversed(table):
                self._release(b)
        tables.clear()

    def pin(self, blocks: list[int]) -> list[int]:
        """Keep `blocks` out of the free queue until unpin(blocks): a copy-on-write source the runner still
        reads this step. A pin is a reference but no holder: the last sequence holding the block writes
        it in place (reserve), after the step's copies have read it. Returns blocks."""
        for b in blocks:
            self.ref_count[b] += 1
            self.pins[b] = self.pins.get(b, 0) + 1
        return blocks

    def unpin(self, blocks: list[int]) -> None:
        for b in reversed(blocks):
            self.pins[b] -= 1
            if not self.pins[b]:
                del self.pins[b]
            self._release(b)

    def cache_full_blocks(self, tables: list[list[int]], token_ids: Seq[int], num_computed: int,
                          known: list[bytes] | None = None, first: int = 0, salt: bytes | None = None) -> None:
        """Register the hashes of the full, computed blocks of a sequence so others can share them;
        blocks before `first` were seen on an earlier step; `salt` as for block_hashes."""
        if not self.enable_prefix_caching or not tables:
            return
        num_full = min(num_computed // self.block_size, len(tables[0]))
        hashes = self.block_hashes(token_ids, num_full, known, salt)
        for g, table in enumerate(tables):
            for i in range(first, num_full):
                b, key = table[i], (g, hashes[i])
                if b == NULL_BLOCK or self.block_hash[b] is not None:
                    continue  # out of the window, or already registered (a hit, or an earlier step)
                if key in self.hash_to_block:
                    continue  # another block holds the same content; keep the first
                self.block_hash[b] = hashes[i]
                self.block_group[b] = g
                self.hash_to_block[key] = b

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (vLLM's reset_prefix_cache): False, and nothing forgotten,
        while any block is held (a request running, waiting swapped out, or a pinned copy source)."""
        if len(self.free_queue) < self.num_blocks:
            return False
        self.hash_to_block.clear()
        self.block_hash = [None] * self.num_blocks
        return True

    def _release(self, b: int) -> None:
        if b < 0:  # NULL_BLOCK (IN_TIER never reaches a table: allocate replaces it)
            return
        self.ref_count[b] -= 1
        assert self.ref_count[b] >= 0, f"block {b} freed more often than held"
        if self.ref_count[b] == 0:
            self.free_queue[b] = None

    def _take_free(self) -> int:
        b, _ = self.free_queue.popitem(last=False)
        h = self.block_hash[b]
        if h is not None:  # evict: its old content is about to be overwritten
            if self.on_evict is not None:
                self.on_evict(self.block_group[b], h, b)
            del self.hash_to_block[(self.block_group[b], h)]
            self.block_hash[b] = None
        self.ref_count[b] = 1
        return b
