"""Property test of the block manager: random allocate / grow / free / prefix hits never leak blocks."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from lmserve.kv.block_manager import BlockManager


def check_invariants(bm: BlockManager, holders: dict[int, tuple[list[int], list[int]]]) -> None:
    counts = [0] * bm.num_blocks
    for table, _ in holders.values():
        for b in table:
            counts[b] += 1
    assert counts == bm.ref_count, "reference counts must equal the number of holders"
    free = set(bm.free_queue)
    assert all((bm.ref_count[b] == 0) == (b in free) for b in range(bm.num_blocks))
    for h, b in bm.hash_to_block.items():
        assert bm.block_hash[b] == h
    assert sum(h is not None for h in bm.block_hash) == len(bm.hash_to_block)


ops = st.lists(st.tuples(st.sampled_from(["alloc", "grow", "free", "commit", "fork", "write"]), st.integers(0, 5),
                         st.integers(1, 40), st.integers(0, 2)), min_size=1, max_size=120)


@settings(max_examples=300, deadline=None)
@given(ops=ops, num_blocks=st.integers(4, 24), block_size=st.sampled_from([1, 2, 4]))
def test_random_ops_no_leak(ops, num_blocks, block_size):  # type: ignore[no-untyped-def]
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=True)
    holders: dict[int, tuple[list[int], list[int]]] = {}  # id -> (block table, token ids)
    content: dict[int, list[int | None]] = {}  # block -> the token whose KV each slot holds (the "cache")
    prefixes = [[1, 2, 3, 4, 5, 6, 7, 8] * 3, [9, 9, 9, 9] * 5, [4, 3, 2, 1] * 6]

    def write(table: list[int], tokens: list[int], start: int, copies: list[tuple[int, int]]) -> None:
        for src, dst in copies:  # the runner copies before the forward writes
            content[dst] = list(content.get(src, [None] * block_size))
        for pos in range(start, len(tokens)):
            content.setdefault(table[pos // block_size], [None] * block_size)[pos % block_size] = tokens[pos]

    for op, who, n, family in ops:
        if op == "alloc" and who not in holders:
            tokens = prefixes[family][: n % 20 + 1] + list(range(100 + who, 100 + who + n))
            table: list[int] = []
            prefix = bm.find_cached_prefix(tokens)
            assert len(prefix) * block_size < len(tokens)
            for i, b in enumerate(prefix):  # a hit block holds exactly these tokens' KV
                assert content[b] == tokens[i * block_size:(i + 1) * block_size]
            if bm.allocate(table, len(tokens), prefix):
                assert table[: len(prefix)] == prefix
                holders[who] = (table, tokens)
                write(table, tokens, len(prefix) * block_size, [])
            else:
                assert table == []
        elif op == "grow" and who in holders:
            table, tokens = holders[who]
            before = list(table)
            tokens.extend(range(n % 7))
            copies = bm.reserve(table, len(tokens) - n % 7, len(tokens))
            if copies is None:
                assert table == before
                tokens[:] = tokens[: len(tokens) - n % 7]
            else:
                write(table, tokens, len(tokens) - n % 7, copies)
        elif op == "commit" and who in holders:
            table, tokens = holders[who]
            bm.cache_full_blocks(table, tokens, len(tokens))
        elif op == "fork" and who in holders:
            child = next((k for k in range(6) if k not in holders), None)
            if child is not None:
                table, tokens = holders[who]
                holders[child] = (bm.fork(table), list(tokens))
        elif op == "write" and who in holders:
            # write the next n % 5 + 1 positions: shared blocks in range are copied first
            table, tokens = holders[who]
            start = len(tokens)
            before = list(table)
            copies = bm.reserve(table, start, start + n % 5 + 1)
            if copies is None:
                assert table == before
            else:
                for src, dst in copies:
                    assert src in before and dst in table and dst not in before
                    assert bm.ref_count[src] >= 1 and bm.ref_count[dst] == 1
                for i in range(start // block_size, len(table)):
                    assert bm.ref_count[table[i]] == 1  # every block written is private
                tokens.extend([7] * (n % 5 + 1))
                write(table, tokens, start, copies)
        elif op == "free" and who in holders:
            table, _ = holders.pop(who)
            bm.free(table)
        check_invariants(bm, holders)
    for table, _ in holders.values():
        bm.free(table)
    holders.clear()
    check_invariants(bm, holders)
    assert bm.num_free_blocks == num_blocks
    assert bm.stats().used == 0


def test_prefix_hit_and_lru_eviction():
    bm = BlockManager(4, 2)
    a: list[int] = []
    toks = [1, 2, 3, 4, 5]
    assert bm.allocate(a, 5)
    bm.cache_full_blocks(a, toks, 5)
    bm.free(a)
    assert bm.stats().cached == 2
    b: list[int] = []
    prefix = bm.find_cached_prefix(toks)
    assert len(prefix) == 2  # 4 of 5 tokens cached; the last is always recomputed
    assert bm.allocate(b, 5, prefix) and b[:2] == prefix
    bm.free(b)
    # fill the pool with other tokens: cached blocks are evicted in LRU order and their hashes dropped
    c: list[int] = []
    assert bm.allocate(c, 8)
    assert bm.hash_to_block == {} and bm.find_cached_prefix(toks) == []
    assert bm.reserve(c, 8, 9) is None
    bm.free(c)
    assert bm.num_free_blocks == 4


def test_block_hash_is_sha256_of_parent_and_tokens():
    """Prefix hashes are sha256 (vLLM's choice after CVE-2025-25183: with Python's hash() a crafted
    prompt could collide with another tenant's block), chained through the parent block's hash."""
    import hashlib
    from array import array

    from lmserve.kv.block_manager import chain_hash
    h0 = chain_hash(None, [5, 6, 7, 8])
    assert h0 == hashlib.sha256(array("q", [5, 6, 7, 8]).tobytes()).digest()
    assert chain_hash(h0, [1, 2]) == hashlib.sha256(h0 + array("q", [1, 2]).tobytes()).digest()
    assert chain_hash(None, [5, 6, 7, 18]) != h0 and chain_hash(h0, [5, 6, 7, 8]) != h0
    bm = BlockManager(8, 4)
    table: list[int] = []
    toks = [5, 6, 7, 8, 1, 2, 3, 4, 9]
    assert bm.allocate(table, 9)
    bm.cache_full_blocks(table, toks, 9)
    assert bm.block_hash[table[0]] == h0 and bm.block_hash[table[1]] == chain_hash(h0, [1, 2, 3, 4])
