"""The cascade planner: groups per request, longest shared whole-block prefix before every last token, the heuristic."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.cascade_attention import cascade_host_arrays
from paged_kv import BlockManager, BlockManagerConfig
from scheduler.cascade_plan import plan_cascade, shared_prefix_blocks

BS = 4


@st.composite
def forked_batches(draw):
    """(tables [S, W], seq_lens [S], request keys [S]): requests whose members fork at random depths."""
    next_block = iter(range(10_000))
    tables, lens, keys = [], [], []
    for request in range(draw(st.integers(1, 4))):
        trunk = [next(next_block) for _ in range(draw(st.integers(0, 8)))]
        for _ in range(draw(st.integers(1, 4))):
            keep = draw(st.integers(0, len(trunk)))  # a member diverges after `keep` trunk blocks
            own = [next(next_block) for _ in range(draw(st.integers(0 if keep else 1, 4)))]
            row = trunk[:keep] + own
            if not row:
                row = [next(next_block)]
            lens.append(draw(st.integers((len(row) - 1) * BS + 1, len(row) * BS)))
            tables.append(row)
            keys.append(f"r{request}")
    width = max(map(len, tables))
    table = np.array([r + [-1] * (width - len(r)) for r in tables], dtype=np.int64)  # -1 padding, never shared
    return table, np.array(lens, dtype=np.int64), keys


@settings(max_examples=200, deadline=None)
@given(forked_batches(), st.integers(1, 4))
def test_plan_finds_the_longest_shared_prefix_of_each_request(batch, min_blocks):
    tables, lens, keys = batch
    plan = plan_cascade(tables, lens, keys, BS, min_shared_blocks=min_blocks, min_saved_fraction=0.0)
    saved = 0
    for key in set(keys):
        rows = [i for i, k in enumerate(keys) if k == key]
        limit = min((lens[i] - 1) // BS for i in rows)  # blocks strictly before every member's last token
        shared = 0
        while shared < limit and len({tables[i, shared] for i in rows}) == 1:
            shared += 1
        grouped = len(rows) >= 2 and shared >= min_blocks
        groups = {int(plan.seq_groups[i]) for i in rows}
        if not grouped:
            assert groups == {-1}
            continue
        assert len(groups) == 1 and -1 not in groups  # one group per request, every member in it
        assert plan.prefix_lens[groups.pop()] == shared * BS
        saved += (len(rows) - 1) * shared * BS
    assert plan.saved_tokens == saved and plan.plain_tokens == lens.sum()
    assert plan.pays == (plan.num_groups > 0)
    if plan.pays:  # what the planner hands over is a valid cascade batch
        arrays = cascade_host_arrays(tables, lens, plan.seq_groups, plan.prefix_lens, BS)
        assert (arrays.suffix_lens >= 1).all()


def test_heuristic_needs_enough_shared_blocks_and_savings():
    tables = np.array([[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 6], [7, 8, 9, 10, 11, 12]])
    lens = np.array([22, 24, 24])
    two = plan_cascade(tables, lens, ["a", "a", "b"], BS)
    assert two.seq_groups.tolist() == [0, 0, -1] and two.prefix_lens.tolist() == [20]
    assert two.saved_tokens == 20 and two.plain_tokens == 70 and two.pays  # 20 / 70 >= 0.25
    assert not plan_cascade(tables, lens, ["a", "a", "b"], BS, min_saved_fraction=0.5).pays
    assert plan_cascade(tables, lens, ["a", "a", "b"], BS, min_shared_blocks=6).num_groups == 0
    assert plan_cascade(tables, lens, ["a", "b", "c"], BS).num_groups == 0  # other requests are never merged


def test_the_block_being_written_is_never_shared():
    rows = np.array([[3, 4, 5], [3, 4, 5]])
    assert shared_prefix_blocks(rows, np.array([12, 12]), BS) == 2  # token 11 sits in block 2
    assert shared_prefix_blocks(rows, np.array([9, 12]), BS) == 2
    assert shared_prefix_blocks(rows, np.array([8, 12]), BS) == 1
    assert shared_prefix_blocks(rows, np.array([1, 12]), BS) == 0


def test_forked_sequences_of_the_block_manager_share_the_prompt_blocks():
    bm = BlockManager(BlockManagerConfig(num_blocks=64, block_size=BS, watermark=0.0))
    bm.allocate("p", list(range(22)))  # 5 full blocks + 2 tokens
    for child in ("c1", "c2", "c3"):
        bm.fork("p", child)
    for i, seq in enumerate(("p", "c1", "c2", "c3")):
        bm.append(seq, [100 + i])  # copy-on-write of the shared partial block
    ids = ["p", "c1", "c2", "c3"]
    width = max(len(bm.block_table(s)) for s in ids)
    tables = np.array([bm.block_table(s) + [0] * (width - len(bm.block_table(s))) for s in ids])
    lens = np.array([bm.num_tokens(s) for s in ids])
    plan = plan_cascade(tables, lens, ["req"] * 4, BS)
    assert plan.prefix_lens.tolist() == [20] and plan.seq_groups.tolist() == [0, 0, 0, 0] and plan.pays
