"""The n-gram (prompt-lookup) proposer of speculative decoding: drafts copied from a sequence's own earlier tokens.

The sequence's last ``n`` tokens, for the longest ``n`` in ``[min_n, max_n]`` that occurs earlier in its
prompt + output, are matched at their earliest earlier occurrence, and the (up to ``k``) tokens that followed
that occurrence are the drafts (vLLM's ``NgramProposer`` picks the same match: longest ``n``, then earliest).

Cost per call: one ``O(L)`` copy of the ``L`` tokens into numpy, then ``max_n`` vectorized passes over the
candidate match ends, which only shrink (``O(L * max_n)`` element work at worst, no Python loop over tokens).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class NgramProposer:
    """Proposes up to ``k`` draft tokens for a token stream by matching its last n-gram earlier in it."""

    def __init__(self, *, k: int, min_n: int, max_n: int) -> None:
        self.k, self.min_n, self.max_n = k, min_n, max_n

    def propose(self, token_ids: Sequence[int], k: int | None = None) -> list[int]:
        """The drafts that follow the best earlier match of ``token_ids``' last n-gram (at most ``k``, default the
        proposer's); ``[]`` when no n-gram of ``[min_n, max_n]`` tokens occurs earlier."""
        k = self.k if k is None else min(k, self.k)
        if k <= 0 or len(token_ids) <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        end = _earliest_longest_match(tokens, self.min_n, self.max_n)
        return [] if end is None else tokens[end + 1 : end + 1 + k].tolist()


def _earliest_longest_match(tokens: np.ndarray, min_n: int, max_n: int) -> int | None:
    """The end index ``e`` (``e <= L - 2``) of the earliest earlier occurrence of the longest suffix n-gram with
    ``min_n <= n <= max_n``, or None.

    ``ends`` holds, after pass ``j``, every ``e`` with ``tokens[e - j : e + 1] == tokens[L - 1 - j :]``: the
    matches of the last ``j + 1`` tokens, shrinking pass by pass.
    """
    last = len(tokens) - 1
    ends = np.flatnonzero(tokens[:last] == tokens[last])  # sorted: the earliest first
    best = None
    for j in range(min(max_n, last)):
        if j:
            ends = ends[ends >= j]
            ends = ends[tokens[ends - j] == tokens[last - j]]
        if ends.size == 0:
            break
        if j + 1 >= min_n:
            best = int(ends[0])  # the longest so far wins; among equals, the earliest
    return best
