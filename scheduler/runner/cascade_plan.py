"""Which sequences of a decode step attend a shared prefix once per group (cascade decode), planned on the host.

Sequences share leading physical blocks when they fork from one prompt (beams, the ``n``
samples of a request) and, with prefix caching, when their prompts start alike (a common
system prompt gives every request the same cached blocks). A group's shared prefix is a run of
leading block ids every member holds, in whole blocks and strictly before every member's last
token (the block being written is never shared). Cascade decode reads that prefix once per
group instead of once per member, saving ``(members - 1) * prefix`` K/V tokens.

Grouping: each sequence's row is cut before the block holding its last token and the rows are
sorted, so that rows sharing leading blocks are neighbours; the common prefixes of neighbours
give the tree of shared prefixes (a node per run of rows sharing more blocks than the rows
around them). A group at a node of depth ``b`` saves ``b`` per member but its first one, so a
row left out of deeper groups is worth the depth of the nearest ancestor that forms a group.
Bottom-up, each node records, for every depth its ancestors may form a group at, the most its
subtree saves: either one group of depth ``b`` holding every row its subtrees leave free (when
rows are worth ``b``), or no group, passing the free rows up. Top-down, the choices of the root
(rows worth 0) pick the groups. This is the best partition into groups (a request's beams keep
their deeper group when that pays; single-sequence requests under a common system prompt join
one cross-request group; tenants whose prompts share only a chat template's first blocks get a
group each). Cost: a sort of the rows, O(S * W) numpy and O(S * depth of the tree) Python steps.

Heuristic: a group needs at least two members and ``min_shared_blocks`` shared blocks (a short
prefix saves little and costs a launch and a merge); the step runs cascade when the K/V tokens
it saves are at least ``min_saved_fraction`` of plain decode's ``sum_i len_i`` tokens and at least
``min_saved_tokens``. That floor pays for a cascade step's fixed cost per layer (more kernels and
a merge; on CUDA, no decode graph replay): the engine derives it from :data:`MIN_SAVED_BYTES` per
layer and its cache's bytes per token (:func:`min_saved_tokens`). The CPU value is an estimate
backed by the CPU chat workload (``bench_cascade.py --engine``): its steps save about 2-3 MiB per
layer and ran 0-14% slower with cascade than without (never faster, three runs). The CUDA value
is an estimate (about two launches' worth of HBM reads, plus the graph) waiting for GPU figures.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

MIN_SHARED_BLOCKS = 4
MIN_SAVED_FRACTION = 0.25
MIN_SAVED_BYTES = {"cpu": 8 << 20, "cuda": 32 << 20}  # K/V bytes per layer a cascade step must save, by device type


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


def may_share(
    host_tables: np.ndarray,
    rows: np.ndarray,
    seq_lens: np.ndarray,
    block_size: int,
    min_shared_blocks: int = MIN_SHARED_BLOCKS,
    min_saved_tokens: int = 0,
) -> bool:
    """Whether a step may pay: two long sequences hold the same block at column ``min_shared_blocks - 1``,
    and the longest sequences could save ``min_saved_tokens``.

    Necessary conditions read from one column of ``host_tables[rows]`` ``[R, W]`` (no copy of the
    rows) and the lengths: if one fails, :func:`plan_cascade` forms no group or its plan does not pay.
    """
    least = max(1, min_shared_blocks)
    limits = (np.asarray(seq_lens) - 1) // block_size  # [R] blocks before each last token
    long = np.flatnonzero(limits >= least)  # [L] rows that can hold a group's prefix
    if len(long) < 2 or (limits[long].sum() - limits[long].min()) * block_size < min_saved_tokens:
        return False  # every group leaves one member reading its prefix: at most all limits but one are saved
    ids = host_tables[np.asarray(rows)[long], least - 1]  # [L]
    return len(np.unique(ids)) < len(ids)


def min_saved_tokens(bytes_per_token: int, device_type: str, min_saved_bytes: int | None = None) -> int:
    """Tokens a cascade step must save to save ``min_saved_bytes`` K/V bytes per layer (None: the device's default)."""
    floor = MIN_SAVED_BYTES.get(device_type, MIN_SAVED_BYTES["cuda"]) if min_saved_bytes is None else min_saved_bytes
    return -(-floor // max(1, bytes_per_token))


def plan_cascade(
    tables: np.ndarray,
    seq_lens: np.ndarray,
    block_size: int,
    *,
    min_shared_blocks: int = MIN_SHARED_BLOCKS,
    min_saved_fraction: float = MIN_SAVED_FRACTION,
    min_saved_tokens: int = 0,
) -> CascadePlan:
    """Group a decode batch's sequences by the leading blocks they share, within and across requests.

    tables ``[S, W]`` host block ids covering each sequence's ``seq_lens`` tokens. Groups are
    numbered in the order of their first member. See the module docstring for the heuristic.
    """
    lens = np.asarray(seq_lens, dtype=np.int64)
    seq_groups, blocks = _tree_groups(tables, (lens - 1) // block_size, max(1, min_shared_blocks))
    members = np.bincount(seq_groups[seq_groups >= 0], minlength=len(blocks))  # [G]
    saved = int(((members - 1) * blocks).sum()) * block_size
    plain = int(lens.sum())
    pays = len(blocks) > 0 and saved >= min_saved_fraction * plain and saved >= min_saved_tokens
    return CascadePlan(seq_groups, blocks * block_size, plain, saved, pays)


def _tree_groups(tables: np.ndarray, limits: np.ndarray, least: int) -> tuple[np.ndarray, np.ndarray]:
    """(seq_groups [S], shared blocks [G]): the best groups on the tree of prefixes of the rows cut at ``limits``."""
    seq_groups = np.full(len(limits), -1, dtype=np.int64)
    cand = np.flatnonzero(limits >= least)  # [C] rows long enough to hold a group's prefix
    if len(cand) < 2:
        return seq_groups, np.zeros(0, dtype=np.int64)
    lim = limits[cand]
    width = int(lim.max())
    cut = tables[cand, :width]  # [C, width] a copy, -1 past each row's limit
    cut[np.arange(width)[None, :] >= lim[:, None]] = -1
    order = np.argsort(np.ascontiguousarray(cut).view(np.dtype((np.void, cut.itemsize * width))).ravel(), kind="stable")
    cut, lim = cut[order], lim[order]  # rows sharing leading blocks are now neighbours
    differs = cut[1:] != cut[:-1]  # [C-1, width]
    first = np.where(differs.any(1), differs.argmax(1), width)
    lcp = np.minimum(first, np.minimum(lim[1:], lim[:-1]))  # [C-1] blocks shared by neighbours
    root = _prefix_tree(lcp.tolist())
    _choose(root, least)
    groups = _live_groups(root)
    for g, (lo, hi, _) in enumerate(groups):  # ancestors first: a deeper group takes its rows back
        seq_groups[cand[order[lo:hi]]] = g
    blocks = np.array([b for *_, b in groups], dtype=np.int64)
    grouped = np.flatnonzero(seq_groups >= 0)
    firsts = np.unique(seq_groups[grouped], return_index=True)[1]  # [G] first member of each group
    rank = np.empty(len(groups), dtype=np.int64)
    rank[np.argsort(grouped[firsts], kind="stable")] = np.arange(len(groups))  # new number of each group
    seq_groups[grouped] = rank[seq_groups[grouped]]
    return seq_groups, blocks[np.argsort(rank)]


@dataclass(slots=True, eq=False)
class _Node:
    """Sorted rows ``[lo, hi)`` sharing ``blocks`` leading blocks, and their best grouping for each worth of a free row.

    A row its subtree leaves ungrouped joins the group of the nearest ancestor that forms one,
    saving that ancestor's depth ``x`` (0 when none forms). ``best[x]`` is the most the subtree
    saves, counting ``x`` per free row, for every ancestor depth ``x`` that may form a group;
    ``forms[x]`` says whether this node then forms its group.
    """

    lo: int
    hi: int
    blocks: int
    subs: list[_Node]  # subtrees
    rows: int  # single rows among the kids (always free)
    best: dict[int, int] = field(default_factory=dict)
    forms: dict[int, bool] = field(default_factory=dict)


def _prefix_tree(lcp: list[int]) -> _Node:
    """The tree of shared prefixes of sorted rows, from the blocks each pair of neighbours shares.

    Bottom-up over a stack of open nodes (blocks, kids): a node closes when the next pair of
    neighbours shares fewer blocks than it.
    """
    stack: list[tuple[int, list[_Node | int]]] = [(-1, []), (0, [])]  # -1: a sentinel below the root
    for i in range(len(lcp) + 1):
        stack[-1][1].append(i)
        shared = lcp[i] if i < len(lcp) else -1
        while shared < stack[-1][0]:
            blocks, kids = stack.pop()
            lo = kids[0] if isinstance(kids[0], int) else kids[0].lo
            hi = kids[-1] + 1 if isinstance(kids[-1], int) else kids[-1].hi
            subs = [k for k in kids if isinstance(k, _Node)]
            stack[-1][1].append(_Node(lo, hi, blocks, subs, len(kids) - len(subs)))
        if shared > stack[-1][0]:  # the last row (or subtree) and the next share more: a deeper node
            stack.append((shared, [stack[-1][1].pop()]))
    return stack[0][1][0]  # the root (depth 0) closed over the sentinel


def _choose(root: _Node, least: int) -> None:
    """Fill every node's ``best`` and ``forms`` for the depths of its ancestors that may form a group (and 0).

    At depth ``blocks``, forming takes every row the kids leave free when a free row is worth
    ``blocks``; a group of fewer than two rows never saves more than passing them up, so it is
    never chosen. Kids are filled before their parent (reverse pre-order).
    """
    order, todo = [], [(root, (0,))]
    while todo:
        node, worth = todo.pop()
        order.append((node, worth))
        inner = (*worth, node.blocks) if node.blocks >= least else worth
        todo.extend((k, inner) for k in node.subs)
    for node, worth in reversed(order):
        b = node.blocks
        group = node.rows * b + sum(k.best[b] for k in node.subs) - b if b >= least else -1
        for x in worth:
            passed = node.rows * x + sum(k.best[x] for k in node.subs)
            node.forms[x], node.best[x] = group > passed, max(group, passed)


def _live_groups(root: _Node) -> list[tuple[int, int, int]]:
    """(lo, hi, blocks) of the groups the best grouping forms (rows worth 0 at the root), ancestors first."""
    groups, todo = [], [(root, 0)]
    while todo:
        node, x = todo.pop()
        if node.forms[x]:
            groups.append((node.lo, node.hi, node.blocks))
            x = node.blocks  # the kids' free rows join this group
        todo.extend((k, x) for k in node.subs)
    return groups
