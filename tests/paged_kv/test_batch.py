"""Batch metadata: padded block tables, sequence lengths, query offsets and slot mappings."""

from __future__ import annotations

import pytest
import torch

from paged_kv.batch import block_table_tensor, build_batch_metadata
from paged_kv.errors import InvalidArgumentError


def test_mixed_prefill_and_decode_batch():
    tables = [[7, 2, 9], [4], [1, 5]]
    meta = build_batch_metadata(tables, num_computed=[10, 0, 5], num_new=[1, 3, 2], block_size=4)
    assert meta.block_tables.dtype == torch.int32 and meta.block_tables.shape == (3, 3)
    assert meta.block_tables.tolist() == [[7, 2, 9], [4, 0, 0], [1, 5, 0]]
    assert meta.seq_lens.tolist() == [11, 3, 7]
    assert meta.cu_seqlens_q.tolist() == [0, 1, 4, 6]
    # seq0 pos 10 -> block 9 off 2; seq1 pos 0..2 -> block 4; seq2 pos 5,6 -> block 5 off 1,2
    assert meta.slot_mapping.tolist() == [38, 16, 17, 18, 21, 22]
    assert (meta.max_seq_len, meta.max_query_len) == (11, 3)


def test_slot_mapping_matches_per_token_formula():
    gen = torch.Generator().manual_seed(0)
    bs, tables, computed, new = 8, [], [], []
    for _ in range(20):
        n_blocks = int(torch.randint(1, 6, (1,), generator=gen))
        tables.append(torch.randperm(64, generator=gen)[:n_blocks].tolist())
        total = int(torch.randint(1, n_blocks * bs + 1, (1,), generator=gen))
        c = int(torch.randint(0, total, (1,), generator=gen))
        computed.append(c)
        new.append(total - c)
    meta = build_batch_metadata(tables, computed, new, bs)
    expected = [t[p // bs] * bs + p % bs for t, c, n in zip(tables, computed, new) for p in range(c, c + n)]
    assert meta.slot_mapping.tolist() == expected


def test_empty_tables_pad_to_one_column():
    assert block_table_tensor([[], []]).shape == (2, 1)


def test_errors_name_the_argument():
    with pytest.raises(InvalidArgumentError, match="num_new"):
        build_batch_metadata([[1]], [0], [1, 2], 4)
    with pytest.raises(InvalidArgumentError, match="tables"):
        build_batch_metadata([[1]], [3], [2], 4)  # 5 tokens cannot fit one block of 4
