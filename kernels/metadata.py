"""Prepared metadata: one step's kernel inputs, validated on the host where they are made.

The checked wrappers (:func:`~kernels.decode_attention.paged_decode_attention`, ...) bound the
block ids and lengths of device tensors by reading them back: one device->host sync per call,
which also rules out CUDA-graph capture. A serving loop already holds every block id and length
as Python ints before it builds its tensors. It validates them there, once per step, with the
``prepare_*`` builders here, and hands the ``*_prepared`` wrappers a record: device tensors plus
the host ints the launches need (split counts, longest lengths), so the launches read no device
value. :func:`check_metadata` checks a record against the cache it is used with (host values).

Records: :class:`AttentionMetadata` (a step's paged attention and K/V writes),
:class:`PrefixMetadata` (query groups over shared paged prefixes), :class:`CascadeMetadata` (a
decode step's shared-prefix groups, from host :class:`CascadeArrays`) and :class:`ChunkMetadata`
(offsets of each sequence's new tokens, attended over their own K/V).

Invariant of every :class:`AttentionMetadata`: each block id a sequence uses (those covering its
positions ``[0, seq_len)``) lies in ``[0, num_blocks)``, every ``seq_len`` fits its table row,
``0 <= query_len <= seq_len``, and non-negative slots are distinct. Table entries past a
sequence's blocks are padding, never read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from kernels.splits import MAX_SPLITS
from paged_kv.errors import InvalidArgumentError, OutOfRangeError, check_int, describe
from paged_kv.tensor_checks import check_device, check_host_ints

Record = TypeVar("Record")


@dataclass(frozen=True, kw_only=True, eq=False)
class AttentionMetadata:
    """One step's block tables, lengths and slots on the device, with their host-side sizes."""

    block_tables: torch.Tensor  # [S, W] int32
    seq_lens: torch.Tensor  # [S] int32, tokens in the cache after this step's writes
    cu_seqlens_q: torch.Tensor  # [S + 1] int32, offsets of each sequence's new tokens
    slot_mapping: torch.Tensor  # [T] int64, slot of every new token (< 0: not written)
    host_seq_lens: np.ndarray  # [S] int64, seq_lens on the host
    host_query_lens: np.ndarray  # [S] int64, new tokens per sequence on the host
    block_size: int
    num_blocks: int  # every block id in use lies in [0, num_blocks)
    max_seq_len: int  # bound on seq_lens the kernels size their work by (>= the real maximum)
    max_query_len: int
    cascade: CascadeMetadata | None = None  # a decode step's shared-prefix groups (None: plain decode)
    decode_num_splits: int | None = None  # fixed decode split count (CUDA-graph capture); None: from host lengths

    def __post_init__(self) -> None:
        if self.decode_num_splits is not None:
            check_int("decode_num_splits", self.decode_num_splits, low=1, high=MAX_SPLITS)

    @property
    def num_seqs(self) -> int:
        """Sequences in the step."""
        return self.block_tables.shape[0]

    @property
    def num_tokens(self) -> int:
        """New tokens in the step (rows of q)."""
        return self.slot_mapping.shape[0]

    @property
    def min_seq_len(self) -> int:
        """Shortest sequence (0 for an empty step)."""
        return int(self.host_seq_lens.min()) if len(self.host_seq_lens) else 0

    @property
    def max_context_len(self) -> int:
        """Longest cached prefix (tokens before a sequence's new ones)."""
        return int((self.host_seq_lens - self.host_query_lens).max()) if len(self.host_seq_lens) else 0

    @property
    def device(self) -> torch.device:
        """The device the tensors live on."""
        return self.block_tables.device

    @property
    def is_decode(self) -> bool:
        """Whether every sequence adds exactly one token (the decode kernel's contract)."""
        return self.num_tokens == self.num_seqs and self.max_query_len <= 1


def prepare_attention_metadata(
    tables: Sequence[Sequence[int]],
    num_computed: Sequence[int],
    num_new: Sequence[int],
    *,
    block_size: int,
    num_blocks: int,
    device: str | torch.device = "cpu",
) -> AttentionMetadata:
    """Validate a step given as host lists and build its metadata (one host->device copy, no read back).

    Sequence s holds ``num_computed[s]`` tokens and adds ``num_new[s]``; ``tables[s]`` must cover
    all of them with block ids in ``[0, num_blocks)``. Raises (nothing built) on bad input.
    """
    check_int("block_size", block_size, low=1)
    check_int("num_blocks", num_blocks, low=1)
    device = check_device("device", device)
    computed, new = _host_lengths(tables, num_computed, num_new)
    seq_lens = computed + new
    width = max((len(t) for t in tables), default=0)
    table = np.zeros((len(tables), max(width, 1)), dtype=np.int32)
    for s, row in enumerate(tables):
        _check_row(s, row, int(seq_lens[s]), block_size, num_blocks)
        table[s, : len(row)] = row
    cu = offsets(new)
    seq_of_token, positions = host_positions(computed, new, cu)
    slots = host_slot_mapping(table, np.arange(len(tables)), seq_of_token, positions, block_size)
    if len(np.unique(slots)) != len(slots):
        raise InvalidArgumentError(describe("tables", "a slot written twice", "no block shared by two writers"))
    return AttentionMetadata(
        block_tables=torch.from_numpy(table).to(device, non_blocking=True),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(device, non_blocking=True),
        cu_seqlens_q=torch.from_numpy(cu.astype(np.int32)).to(device, non_blocking=True),
        slot_mapping=torch.from_numpy(slots).to(device, non_blocking=True),
        host_seq_lens=seq_lens, host_query_lens=new, block_size=block_size, num_blocks=num_blocks,
        max_seq_len=int(seq_lens.max(initial=0)), max_query_len=int(new.max(initial=0)),
    )  # fmt: skip


def offsets(counts: np.ndarray) -> np.ndarray:
    """Exclusive prefix sums ``[S + 1]`` int64 of ``counts``: where each sequence's rows start, then the total."""
    out = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=out[1:])
    return out


def host_positions(computed: np.ndarray, new: np.ndarray, cu: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sequence, position) ``[T]`` of every new token: sequence s adds ``[computed[s], computed[s] + new[s])``.

    ``cu`` is ``offsets(new)``.
    """
    seq_of_token = np.repeat(np.arange(len(new)), new)  # [T]
    return seq_of_token, np.arange(int(cu[-1])) - cu[:-1][seq_of_token] + computed[seq_of_token]


def host_slot_mapping(table, rows, seq_of_token, positions, block_size: int) -> np.ndarray:
    """Slots ``[T]`` int64 of tokens at ``positions`` of sequences ``seq_of_token`` (:func:`host_positions`).

    ``table`` is a host ``[R, W]`` block table and ``rows[s]`` the row of sequence s.
    """
    blocks = table[rows[seq_of_token], positions // block_size].astype(np.int64)
    return blocks * block_size + positions % block_size


def _host_lengths(tables, num_computed, num_new) -> tuple[np.ndarray, np.ndarray]:
    """(computed, new) as int64 arrays after checking counts, types and signs."""
    for name, seq in (("tables", tables), ("num_computed", num_computed), ("num_new", num_new)):
        if isinstance(seq, (str, bytes, torch.Tensor)) or not isinstance(seq, Sequence):
            raise InvalidArgumentError(describe(name, type(seq).__name__, "a list (host values)"))
    if not len(tables) == len(num_computed) == len(num_new):
        got = (len(tables), len(num_computed), len(num_new))
        raise InvalidArgumentError(describe("len(tables), len(num_computed), len(num_new)", got, "equal lengths"))
    computed = [check_int(f"num_computed[{s}]", c) for s, c in enumerate(num_computed)]
    new = [check_int(f"num_new[{s}]", n) for s, n in enumerate(num_new)]
    for s, (c, n) in enumerate(zip(computed, new)):
        if c + n < 1:
            raise InvalidArgumentError(describe(f"num_computed[{s}] + num_new[{s}]", c + n, "at least 1 token"))
    return np.array(computed, dtype=np.int64), np.array(new, dtype=np.int64)


def _check_row(s: int, row: Sequence[int], seq_len: int, block_size: int, num_blocks: int) -> None:
    """Check table row ``s`` covers ``seq_len`` tokens with ids in ``[0, num_blocks)`` where used."""
    if isinstance(row, (str, bytes, torch.Tensor)) or not isinstance(row, Sequence):
        raise InvalidArgumentError(describe(f"tables[{s}]", type(row).__name__, "a list of block ids"))
    used = -(-seq_len // block_size)
    if len(row) < used:
        raise InvalidArgumentError(describe(f"len(tables[{s}])", len(row), f">= {used} blocks for {seq_len} tokens"))
    for i, block in enumerate(row):
        check_int(f"tables[{s}][{i}]", block, low=-(1 << 31), high=(1 << 31) - 1)  # the table is int32
    if not used:
        return
    lo, hi = min(row[:used]), max(row[:used])
    if lo < 0 or hi >= num_blocks:
        raise OutOfRangeError(describe(f"tables[{s}]", lo if lo < 0 else hi, f"block ids in [0, {num_blocks})"))


def check_metadata(
    meta: object, kind: type[Record], *, device: torch.device | None = None, num_blocks: int | None = None,
    block_size: int | None = None, name: str = "meta",
) -> Record:  # fmt: skip
    """Check a prepared record of type ``kind`` against the device and cache it is used with (those given).

    Host values only: the record's block ids and lengths were validated when it was prepared.
    """
    if not isinstance(meta, kind):
        raise InvalidArgumentError(describe(name, type(meta).__name__, f"an instance of {kind.__name__}"))
    if block_size is not None and meta.block_size != block_size:
        raise InvalidArgumentError(describe(f"{name}.block_size", meta.block_size, f"the cache's {block_size}"))
    if num_blocks is not None and meta.num_blocks > num_blocks:
        raise OutOfRangeError(describe(f"{name}.num_blocks", meta.num_blocks, f"<= the cache's {num_blocks} blocks"))
    if device is not None and meta.device != device:
        raise InvalidArgumentError(describe(f"{name}.device", meta.device, f"{device}"))
    return meta


# ----------------------------------------------------------------------------- shared prefixes


@dataclass(frozen=True, kw_only=True, eq=False)
class PrefixMetadata:
    """Groups of packed query rows and their shared paged prefixes, on the device with host sizes.

    Invariant: every block id covering ``[0, prefix_len)`` of a group lies in ``[0, num_blocks)``,
    and ``cu_seqlens_q`` is non-decreasing from 0 to the number of query rows.
    """

    block_tables: torch.Tensor  # [G, Wp] int32 each group's prefix blocks
    prefix_lens: torch.Tensor  # [G] int32 tokens of the shared prefix
    cu_seqlens_q: torch.Tensor  # [G + 1] int32 offsets of each group's query rows
    host_prefix_lens: np.ndarray  # [G] int64
    host_query_counts: np.ndarray  # [G] int64 query rows per group
    block_size: int
    num_blocks: int

    @property
    def num_groups(self) -> int:
        """Groups G."""
        return len(self.host_prefix_lens)

    @property
    def num_rows(self) -> int:
        """Packed query rows T."""
        return int(self.host_query_counts.sum())

    @property
    def device(self) -> torch.device:
        """The device the tensors live on."""
        return self.block_tables.device


def prepare_prefix_metadata(
    tables: np.ndarray,
    prefix_lens: np.ndarray,
    query_counts: np.ndarray,
    *,
    block_size: int,
    num_blocks: int,
    device: str | torch.device,
) -> PrefixMetadata:
    """Validate host prefix groups (tables ``[G, W]``, lengths, query rows per group) and upload them."""
    check_int("block_size", block_size, low=1)
    check_int("num_blocks", num_blocks, low=1)
    device = check_device("device", device)
    tables = check_host_ints("tables", tables, 2)
    plens, counts = check_host_ints("prefix_lens", prefix_lens, 1), check_host_ints("query_counts", query_counts, 1)
    if plens.shape != (len(tables),) or counts.shape != plens.shape:
        got = (tables.shape, plens.shape, counts.shape)
        raise InvalidArgumentError(describe("tables, prefix_lens, query_counts shapes", got, "[G, W], [G], [G]"))
    if (plens < 0).any() or (plens > tables.shape[1] * block_size).any():
        raise OutOfRangeError(describe("prefix_lens", plens.tolist(), f"in [0, {tables.shape[1] * block_size}]"))
    if (counts < 0).any():
        raise OutOfRangeError(describe("query_counts", counts.tolist(), "row counts >= 0"))
    used = np.arange(tables.shape[1])[None, :] < -(-plens[:, None] // block_size)  # [G, W]
    if ((tables < 0) | (tables >= num_blocks))[used].any():
        raise OutOfRangeError(describe("tables", tables[used].tolist(), f"block ids in [0, {num_blocks}) where used"))
    flat = torch.from_numpy(np.concatenate([tables.ravel(), plens, offsets(counts)]).astype(np.int32)).to(device)
    bt, pl, cu = flat.split([tables.size, len(plens), len(plens) + 1])
    return PrefixMetadata(
        block_tables=bt.view(tables.shape), prefix_lens=pl, cu_seqlens_q=cu, host_prefix_lens=plens,
        host_query_counts=counts, block_size=block_size, num_blocks=num_blocks,
    )  # fmt: skip


# ----------------------------------------------------------------------------- cascade decode


@dataclass(frozen=True, eq=False)
class CascadeArrays:
    """A cascade decode batch on the host: what :func:`build_cascade_metadata` turns into device metadata."""

    q_rows: np.ndarray  # [Tg] int64 decode rows of the grouped sequences, group after group
    cu_seqlens_q: np.ndarray  # [G + 1] int64 offsets of each group's rows in q_rows
    leaders: np.ndarray  # [G] int64 a member of each group (its table holds the prefix)
    prefix_lens: np.ndarray  # [G] int64 shared tokens, whole blocks
    first_suffix_block: np.ndarray  # [S] int64 table column where each sequence's suffix starts
    suffix_lens: np.ndarray  # [S] int64 tokens after the shared prefix (>= 1)
    block_size: int

    def parts(self) -> list[np.ndarray]:
        """The arrays to upload, in the order :func:`build_cascade_metadata` takes them."""
        return [self.q_rows, self.cu_seqlens_q, self.leaders, self.prefix_lens, self.first_suffix_block,
                self.suffix_lens]  # fmt: skip

    @property
    def rows_in_order(self) -> bool:
        """Whether every sequence is grouped and the groups list them in batch order (no gather needed)."""
        return len(self.q_rows) == len(self.suffix_lens) and bool((self.q_rows == np.arange(len(self.q_rows))).all())


@dataclass(frozen=True, kw_only=True, eq=False)
class CascadeMetadata:
    """One cascade decode step on the device: the groups' prefix part, every sequence's suffix part.

    Group g shares ``prefix_lens[g]`` tokens, whole blocks, strictly fewer than each member's length
    (the block holding the token being written is never shared), and every member's table holds the
    same block ids there. Its suffix table starts at its first unshared block.
    """

    prefix: PrefixMetadata  # groups over the packed rows q[q_rows]
    suffix: AttentionMetadata  # decode metadata of the suffixes (tables from the first unshared block)
    q_rows: torch.Tensor  # [Tg] int64 decode rows of the grouped sequences, group after group
    rows_in_order: bool  # q_rows is arange(S): no gather, no scatter
    host: CascadeArrays

    @property
    def num_seqs(self) -> int:
        """Sequences S of the decode batch."""
        return self.suffix.num_seqs

    @property
    def device(self) -> torch.device:
        """The device the tensors live on."""
        return self.suffix.device


def cascade_host_arrays(
    tables: np.ndarray, seq_lens: np.ndarray, seq_groups: np.ndarray, prefix_lens: np.ndarray, block_size: int
) -> CascadeArrays:
    """Validate a grouping of a decode batch on the host and lay it out as :class:`CascadeArrays`.

    tables ``[S, W]`` (host block ids), seq_lens ``[S]``, seq_groups ``[S]`` (the group of each
    sequence in ``[0, G)``, or -1), prefix_lens ``[G]``: multiples of block_size, shorter than each
    member, whose blocks every member's row holds. Raises (nothing built) otherwise.
    """
    tables, lens = check_host_ints("tables", tables, 2), check_host_ints("seq_lens", seq_lens, 1)
    groups, plens = check_host_ints("seq_groups", seq_groups, 1), check_host_ints("prefix_lens", prefix_lens, 1)
    num_seqs, num_groups = len(lens), len(plens)
    if tables.ndim != 2 or tables.shape[0] != num_seqs or groups.shape != (num_seqs,) or plens.ndim != 1:
        got = (tables.shape, lens.shape, groups.shape, plens.shape)
        names = "tables, seq_lens, seq_groups, prefix_lens shapes"
        raise InvalidArgumentError(describe(names, got, "[S, W], [S], [S], [G]"))
    if ((groups < -1) | (groups >= num_groups)).any():
        raise OutOfRangeError(describe("seq_groups", groups.tolist(), f"group ids in [-1, {num_groups})"))
    sizes = np.bincount(groups[groups >= 0], minlength=num_groups)
    if num_groups and sizes.min() < 1:
        expected = f"at least one member in each of {num_groups} groups"
        raise InvalidArgumentError(describe("seq_groups", groups.tolist(), expected))
    if ((plens < block_size) | (plens % block_size != 0)).any():
        raise OutOfRangeError(describe("prefix_lens", plens.tolist(), f"positive multiples of block_size {block_size}"))
    member_plen = np.where(groups >= 0, plens[np.maximum(groups, 0)] if num_groups else 0, 0)  # [S]
    if (member_plen >= lens).any():
        bad = int(np.flatnonzero(member_plen >= lens)[0])
        expected = f"< seq_lens[{bad}]={lens[bad]}"
        raise OutOfRangeError(describe(f"prefix_lens[{groups[bad]}]", int(member_plen[bad]), expected))
    q_rows = np.flatnonzero(groups >= 0)
    q_rows = q_rows[np.argsort(groups[q_rows], kind="stable")]  # [Tg] members, group after group
    cu = offsets(sizes)
    leaders = q_rows[cu[:-1]]
    _check_shared_blocks(tables, groups, plens // block_size, leaders)
    return CascadeArrays(
        q_rows=q_rows, cu_seqlens_q=cu, leaders=leaders, prefix_lens=plens,
        first_suffix_block=member_plen // block_size, suffix_lens=lens - member_plen, block_size=block_size,
    )  # fmt: skip


def _check_shared_blocks(tables: np.ndarray, groups: np.ndarray, prefix_blocks: np.ndarray, leaders: np.ndarray):
    """Every member's row holds its leader's block ids over the group's prefix blocks."""
    if (prefix_blocks > tables.shape[1]).any():
        raise OutOfRangeError(describe("prefix_lens", prefix_blocks.tolist(), f"<= {tables.shape[1]} table columns"))
    members = np.flatnonzero(groups >= 0)
    cols = np.arange(tables.shape[1])[None, :]
    inside = cols < prefix_blocks[groups[members]][:, None]  # [M, W]
    differs = (tables[members] != tables[leaders[groups[members]]]) & inside
    if differs.any():
        seq = int(members[np.flatnonzero(differs.any(1))[0]])
        raise InvalidArgumentError(describe(f"tables[{seq}]", "other prefix block ids", "its group's shared blocks"))


def build_cascade_metadata(
    arrays: CascadeArrays, uploaded: list[torch.Tensor], meta: AttentionMetadata
) -> CascadeMetadata:
    """Device metadata of a cascade step from its arrays, uploaded (in ``arrays.parts()`` order) next to ``meta``.

    The prefix and suffix tables are gathered on the device from the decode step's tables, so
    nothing is read back and only the small index arrays travel.
    """
    q_rows, cu, leaders, plens, first, slens = uploaded
    tables = meta.block_tables  # [S, W]
    prefix_width = max(1, int(arrays.prefix_lens.max(initial=0)) // arrays.block_size)
    used = -(-(arrays.first_suffix_block * arrays.block_size + arrays.suffix_lens) // arrays.block_size)
    suffix_width = max(1, int((used - arrays.first_suffix_block).max(initial=0)))
    cols = first[:, None] + torch.arange(suffix_width, device=tables.device)[None, :]  # [S, Ws]
    suffix_tables = tables.gather(1, cols.clamp_(max=tables.shape[1] - 1))  # columns past a suffix are padding
    prefix = PrefixMetadata(
        block_tables=tables.index_select(0, leaders)[:, :prefix_width], prefix_lens=plens.to(torch.int32),
        cu_seqlens_q=cu.to(torch.int32), host_prefix_lens=arrays.prefix_lens,
        host_query_counts=np.diff(arrays.cu_seqlens_q), block_size=meta.block_size, num_blocks=meta.num_blocks,
    )  # fmt: skip
    suffix = AttentionMetadata(
        block_tables=suffix_tables, seq_lens=slens.to(torch.int32), cu_seqlens_q=meta.cu_seqlens_q,
        slot_mapping=meta.slot_mapping, host_seq_lens=arrays.suffix_lens, host_query_lens=meta.host_query_lens,
        block_size=meta.block_size, num_blocks=meta.num_blocks, max_seq_len=int(arrays.suffix_lens.max(initial=0)),
        max_query_len=meta.max_query_len,
    )  # fmt: skip
    return CascadeMetadata(prefix=prefix, suffix=suffix, q_rows=q_rows, rows_in_order=arrays.rows_in_order, host=arrays)


def prepare_cascade_metadata(
    tables: np.ndarray,
    seq_lens: np.ndarray,
    seq_groups: np.ndarray,
    prefix_lens: np.ndarray,
    *,
    block_size: int,
    num_blocks: int,
    device: str | torch.device = "cpu",
) -> CascadeMetadata:
    """Validate a grouped decode batch given as host arrays and build its :class:`CascadeMetadata` (no read back).

    tables ``[S, W]`` block ids covering each sequence's seq_lens tokens; see :func:`cascade_host_arrays`.
    """
    check_int("block_size", block_size, low=1)
    check_int("num_blocks", num_blocks, low=1)
    tables, lens = check_host_ints("tables", tables, 2), check_host_ints("seq_lens", seq_lens, 1)
    if lens.shape != (tables.shape[0],):
        raise InvalidArgumentError(describe("tables, seq_lens shapes", (tables.shape, lens.shape), "[S, W], [S]"))
    capacity = tables.shape[1] * block_size
    if len(lens) and not 1 <= lens.min() <= lens.max() <= capacity:
        bad = lens.min() if lens.min() < 1 else lens.max()
        raise OutOfRangeError(describe("seq_lens", int(bad), f"lengths in [1, {capacity}] (columns * block_size)"))
    meta = prepare_attention_metadata(
        tables.tolist(), (lens - 1).tolist(), [1] * len(lens), block_size=block_size, num_blocks=num_blocks,
        device=device,
    )  # fmt: skip
    arrays = cascade_host_arrays(tables, lens, seq_groups, prefix_lens, block_size)
    parts = arrays.parts()
    flat = torch.from_numpy(np.concatenate(parts)).to(meta.device)
    return build_cascade_metadata(arrays, list(flat.split([len(p) for p in parts])), meta)


# ----------------------------------------------------------------------------- dense chunks


@dataclass(frozen=True, kw_only=True, eq=False)
class ChunkMetadata:
    """Offsets of each sequence's packed new tokens, on the device and on the host.

    Invariant: ``host_cu_seqlens`` starts at 0, never decreases, and ``cu_seqlens`` holds the
    same values; ``max_len`` >= every sequence's token count.
    """

    cu_seqlens: torch.Tensor  # [S + 1] int32 on the queries' device
    host_cu_seqlens: np.ndarray  # [S + 1] int64
    max_len: int

    @property
    def num_tokens(self) -> int:
        """Packed rows T."""
        return int(self.host_cu_seqlens[-1])

    @property
    def device(self) -> torch.device:
        """The device the offsets live on."""
        return self.cu_seqlens.device


def prepare_chunk_metadata(query_lens: object, device: torch.device | str) -> ChunkMetadata:
    """Validate host chunk lengths ``[S]`` (ints >= 0) and upload their offsets."""
    lens = check_host_ints("query_lens", query_lens, 1)
    device = check_device("device", device)
    if (lens < 0).any():
        raise OutOfRangeError(describe("query_lens", lens.tolist(), "token counts >= 0"))
    cu = offsets(lens)
    dev = torch.from_numpy(cu.astype(np.int32)).to(device)
    return ChunkMetadata(cu_seqlens=dev, host_cu_seqlens=cu, max_len=int(lens.max(initial=0)))
