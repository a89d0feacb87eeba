"""N-gram (prompt-lookup) proposer: overlapping copies of periodic text, match preference, edge cases."""

from __future__ import annotations

import pytest

from lmserve.spec.ngram import NgramProposer, ngram_lookup
from lmserve.sequence import SamplingParams, Sequence


@pytest.mark.parametrize("p", [1, 2, 3, 5])
@pytest.mark.parametrize("k", [1, 4, 7, 12])
def test_periodic_sequence_drafts_k_tokens_of_the_period(p, k):  # type: ignore[no-untyped-def]
    """A period-p text drafts k tokens (not at most p): the copy runs on into what it has drafted."""
    period = [10 + i for i in range(p)]
    tokens = period * 3 + period[:1]  # ends one token into the fourth repetition
    want = [period[(len(tokens) + j) % p] for j in range(k)]
    assert ngram_lookup(tokens, k, min_n=1, max_n=3) == want
    # only one earlier period to copy from: the overlap is all that makes k > p possible
    assert ngram_lookup(period * 2, k, min_n=1, max_n=3) == [period[j % p] for j in range(k)]


def test_overlapping_copy_of_a_non_periodic_match():
    """draft[j] = ext[start + n + j] with ext = tokens + drafts so far (LZ77-style copy)."""
    tokens = [1, 2, 3, 9, 4, 1, 2, 3]  # tail (1, 2, 3) matched at 0; what followed is 9, 4, 1, 2, 3
    assert ngram_lookup(tokens, 3, min_n=1, max_n=3) == [9, 4, 1]
    assert ngram_lookup(tokens, 8, min_n=1, max_n=3) == [9, 4, 1, 2, 3, 9, 4, 1]


def test_largest_n_first_then_latest_match():
    # the last token 7 last occurred before 8, but the last two (6, 7) only before 9: n = 2 wins
    tokens = [6, 7, 9, 5, 7, 8, 6, 7]
    assert ngram_lookup(tokens, 1, min_n=1, max_n=3) == [9]
    assert ngram_lookup(tokens, 1, min_n=1, max_n=1) == [8]  # n = 1 alone: the latest match of 7
    # among matches of the same n, the latest one
    assert ngram_lookup([4, 1, 4, 2, 4], 1, min_n=1, max_n=2) == [2]


def test_no_match_or_no_budget_gives_nothing():
    assert ngram_lookup([1, 2, 3, 4], 3, min_n=1, max_n=3) == []
    assert ngram_lookup([1, 2, 3, 1, 2], 3, min_n=3, max_n=3) == []  # (3, 1, 2) never occurred before
    assert ngram_lookup([], 3, min_n=1, max_n=3) == []
    assert ngram_lookup([5], 3, min_n=1, max_n=3) == []
    assert ngram_lookup([1, 2, 1, 2], 0, min_n=1, max_n=3) == []


def test_proposer_uses_each_sequences_tokens_and_budget():
    params = SamplingParams(max_tokens=8)
    a = Sequence("a", [3, 4, 3, 4], params)
    b = Sequence("b", [1, 2, 3], params)
    props = NgramProposer(1, 2).propose([a, a, b], [5, 0, 4])
    assert [p.tokens for p in props] == [[3, 4, 3, 4, 3], [], []]
    with pytest.raises(ValueError):
        NgramProposer(2, 1)
