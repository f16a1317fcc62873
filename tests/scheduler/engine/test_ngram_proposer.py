"""The n-gram proposer: the longest suffix n-gram in [min_n, max_n] matched at its earliest earlier occurrence."""

from __future__ import annotations

import random

import pytest

from scheduler.engine.ngram_proposer import NgramProposer


def proposer(k=4, min_n=1, max_n=3) -> NgramProposer:
    return NgramProposer(k=k, min_n=min_n, max_n=max_n)


def reference(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Brute force: for n from max_n down, the earliest earlier occurrence of the last n tokens, and what follows."""
    L = len(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = tokens[L - n :]
        for start in range(0, L - n):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_vllm_docstring_example():
    # vLLM's example: [1,2,3,4,2,3], min 2, max 3, k 4: [4,2,3] has no match, [2,3] does -> [4,2,3]
    assert proposer(k=4, min_n=2, max_n=3).propose([1, 2, 3, 4, 2, 3]) == [4, 2, 3]


def test_no_match_proposes_nothing():
    assert proposer().propose([1, 2, 3, 4, 5]) == []
    assert proposer().propose([7]) == []
    assert proposer().propose([]) == []


def test_min_n_rejects_shorter_matches():
    tokens = [5, 9, 1, 2, 7, 1]  # only the 1-gram [1] recurs
    assert proposer(min_n=1).propose(tokens) == [2, 7, 1]
    assert proposer(min_n=2).propose(tokens) == []


def test_max_n_caps_the_matched_length():
    # the 3-gram [1, 2, 3] occurs earlier at 4 (followed by 8), the 2-gram [2, 3] first at 1 (followed by 9): with
    # max_n 3 the longer match wins, with max_n 2 the earliest [2, 3]
    tokens = [4, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3]
    assert proposer(k=1, max_n=3).propose(tokens) == [8]
    assert proposer(k=1, max_n=2).propose(tokens) == [9]


def test_longest_n_preferred_over_a_later_shorter_match():
    tokens = [1, 2, 3, 50, 6, 3, 60, 1, 2, 3]  # [1,2,3] at 0 (-> 50), [3] also at 5 (-> 60)
    assert proposer(k=1).propose(tokens) == [50]


def test_earliest_occurrence_among_equal_lengths():
    tokens = [1, 2, 10, 1, 2, 20, 1, 2]
    assert proposer(k=1, max_n=2).propose(tokens) == [10]


def test_k_caps_the_drafts_and_the_stream_end_caps_them_too():
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    assert proposer(k=3).propose(tokens) == [3, 4, 5]
    assert proposer(k=10).propose(tokens) == [3, 4, 5, 6, 1, 2]
    assert proposer(k=3).propose(tokens, 2) == [3, 4]  # a smaller per-call cap
    assert proposer(k=3).propose(tokens, 0) == []
    assert proposer(k=2).propose(tokens, 5) == [3, 4]  # never above the proposer's own k


def test_overlapping_match_drafts_the_repetition():
    assert proposer(k=4, max_n=2).propose([7, 7, 7]) == [7]  # [7,7] at 0, followed by the suffix's own 7
    assert proposer(k=4, max_n=1).propose([1, 2, 1, 2, 1]) == [2, 1, 2, 1]


@pytest.mark.parametrize("seed", range(5))
def test_matches_brute_force(seed):
    rng = random.Random(seed)
    for _ in range(300):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(0, 40))]
        min_n = rng.randint(1, 4)
        max_n = rng.randint(min_n, 5)
        k = rng.randint(1, 6)
        assert proposer(k, min_n, max_n).propose(tokens) == reference(tokens, k, min_n, max_n), (tokens, min_n, max_n)
