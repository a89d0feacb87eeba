"""Property test of the block manager: random allocate / grow / free / fork / prefix hits never leak
blocks, a hit always holds the tokens it claims, and windowed KV groups hold only their window."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from lmserve.kv.block_manager import NULL_BLOCK, BlockManager

Tables = list[list[int]]


def check_invariants(bm: BlockManager, holders: dict[int, tuple[Tables, list[int]]]) -> None:
    counts = [0] * bm.num_blocks
    for tables, _ in holders.values():
        for table in tables:
            for b in table:
                if b != NULL_BLOCK:
                    counts[b] += 1
    assert counts == bm.ref_count, "reference counts must equal the number of holders"
    free = set(bm.free_queue)
    assert all((bm.ref_count[b] == 0) == (b in free) for b in range(bm.num_blocks))
    for (g, h), b in bm.hash_to_block.items():
        assert bm.block_hash[b] == h and bm.block_group[b] == g
    assert sum(h is not None for h in bm.block_hash) == len(bm.hash_to_block)


ops = st.lists(st.tuples(st.sampled_from(["alloc", "grow", "free", "commit", "fork", "write"]), st.integers(0, 5),
                         st.integers(1, 40), st.integers(0, 2)), min_size=1, max_size=120)
# KV groups: one full group (a plain model), full + windowed groups (Gemma 3's shape), windowed only (Mistral)
WINDOWS = [(None,), (None, 3), (None, 5, 5), (4,)]


@settings(max_examples=300, deadline=None)
@given(ops=ops, num_blocks=st.integers(4, 24), block_size=st.sampled_from([1, 2, 4]), windows=st.sampled_from(WINDOWS))
def test_random_ops_no_leak(ops, num_blocks, block_size, windows):  # type: ignore[no-untyped-def]
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=True, windows=windows)
    holders: dict[int, tuple[Tables, list[int]]] = {}  # id -> (block tables, token ids)
    content: dict[int, list[int | None]] = {}  # block -> the token whose KV each slot holds (the "cache")
    prefixes = [[1, 2, 3, 4, 5, 6, 7, 8] * 3, [9, 9, 9, 9] * 5, [4, 3, 2, 1] * 6]

    def write(tables: Tables, tokens: list[int], start: int, copies: list[tuple[int, int]]) -> None:
        for src, dst in copies:  # the runner copies before the forward writes
            content[dst] = list(content.get(src, [None] * block_size))
        for table in tables:
            for pos in range(start, len(tokens)):
                content.setdefault(table[pos // block_size], [None] * block_size)[pos % block_size] = tokens[pos]

    def check_window(tables: Tables, start: int, end: int) -> None:
        """After reserve(start, end): a windowed group holds exactly the blocks its step can read."""
        for g, table in enumerate(tables):
            first = bm.first_needed(g, start)
            assert all(b == NULL_BLOCK for b in table[:first]) and NULL_BLOCK not in table[first:], (g, table)
            assert len(table) == bm.blocks_needed(end)

    for op, who, n, family in ops:
        if op == "alloc" and who not in holders:
            tokens = prefixes[family][: n % 20 + 1] + list(range(100 + who, 100 + who + n))
            tables: Tables = []
            prefix = bm.find_cached_prefix(tokens)
            hit = len(prefix[0]) if prefix else 0
            assert hit * block_size < len(tokens)
            for g, table in enumerate(prefix):
                assert len(table) == hit
                for i, b in enumerate(table):  # a hit block holds exactly these tokens' KV
                    if b == NULL_BLOCK:
                        assert i < bm.first_needed(g, hit * block_size)  # only what the window no longer reads
                    else:
                        assert content[b] == tokens[i * block_size:(i + 1) * block_size]
            if bm.allocate(tables, len(tokens), prefix):
                assert all(t[:hit] == p for t, p in zip(tables, prefix)) and len(tables) == len(windows)
                holders[who] = (tables, tokens)
                write(tables, tokens, hit * block_size, [])
            else:
                assert tables == []
        elif op == "grow" and who in holders:
            tables, tokens = holders[who]
            start = len(tokens)
            tokens.extend(range(n % 7))
            copies = bm.reserve(tables, start, len(tokens))
            if copies is None:
                tokens[:] = tokens[:start]
            else:
                check_window(tables, start, len(tokens))
                write(tables, tokens, start, copies)
        elif op == "commit" and who in holders:
            tables, tokens = holders[who]
            bm.cache_full_blocks(tables, tokens, len(tokens))
        elif op == "fork" and who in holders:
            child = next((k for k in range(6) if k not in holders), None)
            if child is not None:
                tables, tokens = holders[who]
                holders[child] = (bm.fork(tables), list(tokens))
        elif op == "write" and who in holders:
            # write the next n % 5 + 1 positions: shared blocks in range are copied first
            tables, tokens = holders[who]
            start = len(tokens)
            before = [b for t in tables for b in t]
            copies = bm.reserve(tables, start, start + n % 5 + 1)
            if copies is not None:
                now = [b for t in tables for b in t]
                for src, dst in copies:
                    assert src in before and dst in now and dst not in before
                    assert bm.ref_count[src] >= 1 and bm.ref_count[dst] == 1
                for table in tables:
                    for i in range(start // block_size, len(table)):
                        assert bm.ref_count[table[i]] == 1  # every block written is private
                check_window(tables, start, start + n % 5 + 1)
                tokens.extend([7] * (n % 5 + 1))
                write(tables, tokens, start, copies)
        elif op == "free" and who in holders:
            tables, _ = holders.pop(who)
            bm.free(tables)
            assert tables == []
        check_invariants(bm, holders)
    for tables, _ in holders.values():
        bm.free(tables)
    holders.clear()
    check_invariants(bm, holders)
    assert bm.num_free_blocks == num_blocks
    assert bm.stats().used == 0


def test_prefix_hit_and_lru_eviction():
    bm = BlockManager(4, 2)
    a: Tables = []
    toks = [1, 2, 3, 4, 5]
    assert bm.allocate(a, 5)
    bm.cache_full_blocks(a, toks, 5)
    bm.free(a)
    assert bm.stats().cached == 2
    b: Tables = []
    prefix = bm.find_cached_prefix(toks)
    assert len(prefix[0]) == 2  # 4 of 5 tokens cached; the last is always recomputed
    assert bm.allocate(b, 5, prefix) and b[0][:2] == prefix[0]
    bm.free(b)
    # fill the pool with other tokens: cached blocks are evicted in LRU order and their hashes dropped
    c: Tables = []
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
    tables: Tables = []
    toks = [5, 6, 7, 8, 1, 2, 3, 4, 9]
    assert bm.allocate(tables, 9)
    bm.cache_full_blocks(tables, toks, 9)
    table = tables[0]
    assert bm.block_hash[table[0]] == h0 and bm.block_hash[table[1]] == chain_hash(h0, [1, 2, 3, 4])


def test_windowed_group_holds_only_its_window():
    """Decoding a sequence 8x a window of 8 tokens (blocks of 4): the windowed group holds at most
    window / block_size + 1 blocks at every step, the full group every block; the pool gets the rest."""
    bs, w = 4, 8
    bm = BlockManager(200, bs, windows=(None, w))
    tables: Tables = []
    assert bm.allocate(tables, 5)  # a 5-token prompt
    for n in range(5, 8 * w):  # each decode step computes token n
        assert bm.reserve(tables, n, n + 1) is not None
        held = [b for b in tables[1] if b != NULL_BLOCK]
        assert len(held) <= w // bs + 1, (n, tables[1])
        assert len(tables[0]) == n // bs + 1 and NULL_BLOCK not in tables[0]
    assert bm.num_free_blocks == 200 - len(tables[0]) - len(held) and held == tables[1][-2:]  # 56..63
    blind = BlockManager(200, bs, windows=(None, None))  # the window-blind cache keeps both groups whole
    t2: Tables = []
    assert blind.allocate(t2, 8 * w)
    assert 200 - blind.num_free_blocks == 2 * (8 * w // bs) > 200 - bm.num_free_blocks


def test_windowed_prefix_hit_needs_only_the_window():
    """A finished long sequence leaves its full group's blocks cached and, in the windowed group, only
    the blocks still in the window at its end. A new request with the same prefix hits them all: the
    windowed group's table is NULL before the window of its first computed token. Once a window block
    is evicted, the hit shrinks to a length whose window is still cached (here: none)."""
    bs, w = 4, 8
    bm = BlockManager(64, bs, windows=(None, w))
    toks = list(range(1, 42))  # 41 tokens: 10 full blocks
    a: Tables = []
    assert bm.allocate(a, 40)
    bm.cache_full_blocks(a, toks, 40)
    assert bm.reserve(a, 40, 41) is not None  # the window moves on: blocks before (40 - 8 + 1) // 4 = 8 go
    assert a[1][:8] == [NULL_BLOCK] * 8
    bm.free(a)
    prefix = bm.find_cached_prefix(toks)  # the last token is always computed: a 40-token (10-block) hit
    assert len(prefix[0]) == 10 and NULL_BLOCK not in prefix[0]
    first = bm.first_needed(1, 40)  # (40 - 8 + 1) // 4 = 8: blocks 8 and 9 hold the window
    assert first == 8 and prefix[1][:8] == [NULL_BLOCK] * 8 and NULL_BLOCK not in prefix[1][8:]
    b: Tables = []
    assert bm.allocate(b, 41, prefix) and b[1][:8] == [NULL_BLOCK] * 8
    bm.free(b)
    # a shorter request (the same first 21 tokens): its window's blocks (3 and 4) were let go by the
    # windowed group when the window moved on, but stay cached (free, hashed) until reused: a hit
    short = bm.find_cached_prefix(toks[:21])
    assert len(short[0]) == 5 and short[1][:3] == [NULL_BLOCK] * 3 and NULL_BLOCK not in short[1][3:]
    # evict one block of the long request's window (block 8 of the windowed group): the 10-block hit
    # is gone; a shorter hit is served only where its own window is still cached
    gone = prefix[1][8]
    while gone in bm.free_queue:
        bm._take_free()
    hit = bm.find_cached_prefix(toks)
    n = len(hit[0]) if hit else 0
    assert n < 10
    if n:
        assert all(b != NULL_BLOCK and b != gone for b in hit[1][bm.first_needed(1, n * bs):])


def test_tier_hits_take_fresh_blocks_and_are_asked_only_where_needed():
    """find_cached_prefix with an offload tier: a block the pool lacks and the tier holds is IN_TIER (a
    pool block stays the pool's), the windowed rule decides the hit as for the pool, a full group asks the
    tier nothing past its first miss; allocate gives each IN_TIER place a fresh block and needs exactly
    the pool's count of free blocks (one fewer: refused, nothing changed)."""
    from lmserve.kv.block_manager import IN_TIER
    bs, w = 4, 8
    bm = BlockManager(40, bs, windows=(None, w))
    toks = list(range(1, 42))  # a 40-token (10-block) hit at most
    hashes = bm.block_hashes(toks, 10)
    a: Tables = []
    assert bm.allocate(a, 40)
    bm.cache_full_blocks(a, toks, 40)
    bm.free(a)
    pool_full = {bm.hash_to_block[(0, hashes[i])] for i in (0, 1, 2)}
    for (g, h), b in list(bm.hash_to_block.items()):  # the pool keeps the full group's blocks 0-2 only
        if b not in pool_full:
            del bm.hash_to_block[(g, h)]
            bm.block_hash[b] = None
    held = {(0, i) for i in range(3, 7)} | {(1, i) for i in range(0, 10)}  # the tier: full 3-6, windowed all
    asked: list[tuple[int, int]] = []

    def tier(g: int, h: bytes) -> bool:
        i = hashes.index(h)
        asked.append((g, i))
        return (g, i) in held
    prefix = bm.find_cached_prefix(toks, tier=tier)
    assert (0, 7) in asked and not any(g == 0 and i > 7 for g, i in asked)  # stopped at the first miss
    assert len(prefix[0]) == 7  # full group: 0-2 pool, 3-6 tier, 7 missing
    assert prefix[0][:3] == [bm.hash_to_block[(0, hashes[i])] for i in range(3)] and prefix[0][3:] == [IN_TIER] * 4
    first = bm.first_needed(1, 7 * bs)  # (28 - 8 + 1) // 4 = 5
    assert prefix[1] == [NULL_BLOCK] * first + [IN_TIER] * (7 - first)
    free_before = bm.num_free_blocks
    need = (11 - 7) + 4 + (11 - 7) + (7 - first)  # full: 4 new + 4 tier; windowed: 4 new + tier places
    assert need + 3 <= free_before
    t: Tables = []
    assert bm.allocate(t, 44, prefix)
    assert all(b >= 0 for b in t[0]) and t[1][:first] == [NULL_BLOCK] * first and all(b >= 0 for b in t[1][first:])
    assert free_before - bm.num_free_blocks == need + 3  # + the three pool blocks revived
    bm.free(t)
    while bm.num_free_blocks > need + 3 - 1:  # one block short
        bm._take_free()
    u: Tables = []
    before = (bm.num_free_blocks, list(bm.ref_count))
    assert not bm.allocate(u, 44, prefix) and u == [] and (bm.num_free_blocks, bm.ref_count) == before


def test_a_decode_token_copies_only_a_block_someone_else_holds():
    """reserve() for one new token of a one-group model (every decode step: its fast path) writes in place
    only into a block the sequence holds alone (a pin is no holder); a block a fork shares is copied."""
    bm = BlockManager(16, 4)
    a: Tables = []
    assert bm.allocate(a, 6)  # blocks for tokens 0..5: the second one half full
    b = bm.fork(a)
    shared = a[0][1]
    (src, dst), = bm.reserve(a, 6, 7)  # token 6 lands in the shared block: a takes a copy
    assert src == shared and a[0][1] == dst != shared and bm.ref_count[shared] == 1
    assert bm.reserve(b, 6, 7) == [] and b[0][1] == shared  # b now holds it alone: in place
    bm.pin([shared])  # the copy's source, still read this step
    assert bm.reserve(b, 7, 8) == [] and b[0][1] == shared  # a pin is no other holder
    assert bm.reserve(b, 8, 9) == [] and len(b[0]) == 3  # past the last block: one more (the general path)
