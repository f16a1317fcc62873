"""Which sequences of a decode step attend a shared prefix once per group (cascade decode), planned on the host.

Members of one request group (beams, the ``n`` samples of a request) fork from one prompt,
so their block tables start with the same physical blocks. For each group the shared prefix
is the longest run of leading block ids every member holds, in whole blocks and strictly
before every member's last token (the block being written is never shared). Cascade decode
reads that prefix once per group instead of once per member.

Heuristic: a group joins when it has at least two members and shares at least
``min_shared_blocks`` blocks (a short prefix saves little and costs a launch and a merge);
the step runs cascade when the K/V bytes it saves, ``sum_g (members_g - 1) * prefix_g``
tokens, are at least ``min_saved_fraction`` of plain decode's ``sum_i len_i`` tokens.
Groups are only formed within a request: prompts of different requests that share cached
blocks (a common system prompt) are not merged.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

MIN_SHARED_BLOCKS = 4
MIN_SAVED_FRACTION = 0.25


@dataclass(frozen=True, eq=False)
class CascadePlan:
    """The groups of a decode step and their shared prefixes."""

    seq_groups: np.ndarray  # [S] int64 group of each sequence in [0, G), or -1 (not grouped)
    prefix_lens: np.ndarray  # [G] int64 shared tokens of each group (whole blocks)
    plain_tokens: int  # K/V tokens plain decode reads: sum of the lengths
    saved_tokens: int  # tokens cascade decode does not read again
    pays: bool  # whether the step should run cascade decode

    @property
    def num_groups(self) -> int:
        """Groups G."""
        return len(self.prefix_lens)


def shared_prefix_blocks(rows: np.ndarray, seq_lens: np.ndarray, block_size: int) -> int:
    """Leading blocks every row ``[M, W]`` holds alike, each strictly before every member's last token."""
    limit = int(((seq_lens - 1) // block_size).min())  # blocks before the one holding the last token
    if limit <= 0:
        return 0
    same = (rows[:, :limit] == rows[:1, :limit]).all(0)  # [limit]
    return limit if same.all() else int(np.argmin(same))


def plan_cascade(
    tables: np.ndarray,
    seq_lens: np.ndarray,
    group_keys: Sequence[Hashable],
    block_size: int,
    *,
    min_shared_blocks: int = MIN_SHARED_BLOCKS,
    min_saved_fraction: float = MIN_SAVED_FRACTION,
) -> CascadePlan:
    """Group a decode batch's sequences by key (request id) and find each group's shared prefix.

    tables ``[S, W]`` host block ids covering each sequence's ``seq_lens`` tokens; ``group_keys[s]``
    names the request of sequence s. See the module docstring for the heuristic.
    """
    lens = np.asarray(seq_lens, dtype=np.int64)
    members: dict[Hashable, list[int]] = {}
    for s, key in enumerate(group_keys):
        members.setdefault(key, []).append(s)
    seq_groups = np.full(len(lens), -1, dtype=np.int64)
    prefix_lens, saved = [], 0
    for rows in members.values():
        if len(rows) < 2:
            continue
        shared = shared_prefix_blocks(tables[rows], lens[rows], block_size)
        if shared < max(1, min_shared_blocks):
            continue
        seq_groups[rows] = len(prefix_lens)
        prefix_lens.append(shared * block_size)
        saved += (len(rows) - 1) * shared * block_size
    plain = int(lens.sum())
    pays = bool(prefix_lens) and saved >= min_saved_fraction * plain
    return CascadePlan(seq_groups, np.array(prefix_lens, dtype=np.int64), plain, saved, pays)
