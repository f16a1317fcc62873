"""Model runner pieces: packing a step into tensors, and block copies applied in a safe order."""

from __future__ import annotations

import random

import torch

from paged_kv import BlockManager, BlockManagerConfig
from scheduler import SamplingParams
from scheduler.core.scheduler_output import ScheduledSeq, SchedulerOutput
from scheduler.core.sequence import Sequence, SequenceGroup
from scheduler.runner.model_runner import order_free_batches
from scheduler.runner.step_input import StepInputBuilder


def test_order_free_batches_equal_copying_in_list_order():
    rng = random.Random(0)
    for _ in range(300):
        pairs = [(rng.randrange(8), rng.randrange(8)) for _ in range(rng.randrange(1, 10))]
        pairs = [(s, d) for s, d in pairs if s != d]
        sequential, batched = list(range(8)), list(range(8))
        for s, d in pairs:
            sequential[d] = sequential[s]
        for batch in order_free_batches(pairs):
            dsts = [d for _, d in batch]
            assert len(set(dsts)) == len(dsts) and not set(dsts) & {s for s, _ in batch}
            snapshot = list(batched)
            for s, d in batch:
                batched[d] = snapshot[s]
        assert batched == sequential


def test_step_input_builds_positions_slots_and_sampled_rows():
    bm = BlockManager(BlockManagerConfig(num_blocks=16, block_size=4, watermark=0.0), track_changes=True)
    a, b = Sequence(0, 0, list(range(10, 20))), Sequence(1, 0, [7, 8, 9])
    bm.allocate(0, a.token_ids[:6])  # a: prefill chunk 0..6 of 10
    bm.allocate(1, b.token_ids)
    b.num_computed = 3
    b.append_token(42, 0.0)  # b decodes its sampled token at position 3
    bm.append(1, [42])
    group = SequenceGroup("g", [a], SamplingParams())
    scheduled = [ScheduledSeq(a, group, 0, 6), ScheduledSeq(b, group, 3, 1)]
    out = SchedulerOutput(scheduled, [], [], [], [], bm.take_table_changes())
    step = StepInputBuilder(4, 16, torch.device("cpu"), max_blocks_per_seq=8).build(out)
    assert step.input_ids.tolist() == list(range(10, 16)) + [42]
    assert step.positions.tolist() == [0, 1, 2, 3, 4, 5, 3]
    assert step.logits_indices.tolist() == [6]  # a's chunk stops short of its last token: not sampled
    table_a, table_b = bm.block_table(0), bm.block_table(1)
    expected = [table_a[p // 4] * 4 + p % 4 for p in range(6)] + [table_b[0] * 4 + 3]
    assert step.meta.slot_mapping.tolist() == expected
    assert step.meta.seq_lens.tolist() == [6, 4] and step.meta.cu_seqlens_q.tolist() == [0, 6, 7]
    assert step.meta.block_tables[:, :2].tolist() == [table_a[:2], table_b + [0]]
    assert step.meta.max_seq_len == 6 and step.meta.max_query_len == 6 and not step.meta.is_decode
