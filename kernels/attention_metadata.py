"""Prepared attention metadata: one step's kernel inputs, validated on the host where they are made.

The checked wrappers (:func:`~kernels.decode_attention.paged_decode_attention`, ...) bound the
block ids and lengths of device tensors by reading them back: one device->host sync per call,
which also rules out CUDA-graph capture. A serving loop already holds every block id and length
as Python ints before it builds its tensors. It validates them there, once per step, and hands the
``*_prepared`` wrappers an :class:`AttentionMetadata`: device tensors plus the host ints the
launches need (split counts, longest lengths), so the launches read no device value.

Invariant of every :class:`AttentionMetadata`: each block id a sequence uses (those covering its
positions ``[0, seq_len)``) lies in ``[0, num_blocks)``, every ``seq_len`` fits its table row,
``0 <= query_len <= seq_len``, and non-negative slots are distinct. Table entries past a
sequence's blocks are padding, never read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from paged_kv.tensor_checks import check_device
from paged_kv.errors import InvalidArgumentError, OutOfRangeError, check_int, describe

if TYPE_CHECKING:
    from kernels.cascade_attention import CascadeMetadata

MAX_DECODE_SPLITS = 128  # kernels.decode_attention.MAX_SPLITS


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
            check_int("decode_num_splits", self.decode_num_splits, low=1, high=MAX_DECODE_SPLITS)

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
        check_int(f"tables[{s}][{i}]", block, low=-(1 << 62))
    if not used:
        return
    lo, hi = min(row[:used]), max(row[:used])
    if lo < 0 or hi >= num_blocks:
        raise OutOfRangeError(describe(f"tables[{s}]", lo if lo < 0 else hi, f"block ids in [0, {num_blocks})"))


def check_metadata(meta: object, *, num_blocks: int, block_size: int, device: torch.device) -> AttentionMetadata:
    """Check a prepared step against the cache it is used with, from host values only."""
    if not isinstance(meta, AttentionMetadata):
        raise InvalidArgumentError(describe("meta", type(meta).__name__, "an AttentionMetadata"))
    if meta.block_size != block_size:
        raise InvalidArgumentError(describe("meta.block_size", meta.block_size, f"the cache's block_size {block_size}"))
    if meta.num_blocks > num_blocks:
        raise OutOfRangeError(describe("meta.num_blocks", meta.num_blocks, f"<= the cache's {num_blocks} blocks"))
    if meta.device != device:
        raise InvalidArgumentError(describe("meta.device", meta.device, f"{device}"))
    return meta
