"""The cascade planner: groups within and across requests, longest shared whole-block prefix before every last token."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.metadata import cascade_host_arrays
from paged_kv import BlockManager, BlockManagerConfig
from scheduler.runner.cascade_plan import may_share, min_saved_tokens, plan_cascade

BS = 4


@st.composite
def shared_batches(draw):
    """(tables [S, W], seq_lens [S], request keys [S]): requests open with a cut of one of a few system
    prompts, add their own blocks, and their members fork from that prompt at random depths."""
    next_block = iter(range(10_000))
    systems = [[next(next_block) for _ in range(draw(st.integers(0, 8)))] for _ in range(draw(st.integers(1, 3)))]
    tables, lens, keys = [], [], []
    for request in range(draw(st.integers(1, 5))):
        system = draw(st.sampled_from(systems))
        trunk = system[: draw(st.integers(0, len(system)))] + [next(next_block) for _ in range(draw(st.integers(0, 5)))]
        for _ in range(draw(st.integers(1, 4))):
            keep = draw(st.integers(0, len(trunk)))  # a member diverges after `keep` trunk blocks
            row = trunk[:keep] + [next(next_block) for _ in range(draw(st.integers(0 if keep else 1, 4)))]
            lens.append(draw(st.integers((len(row) - 1) * BS + 1, len(row) * BS)))
            tables.append(row)
            keys.append(f"r{request}")
    width = max(map(len, tables))
    table = np.array([r + [-1] * (width - len(r)) for r in tables], dtype=np.int64)  # -1 padding, never shared
    return table, np.array(lens, dtype=np.int64), keys


def common_blocks(tables, lens, rows) -> int:
    """Leading blocks all ``rows`` hold alike before each one's last token (one column at a time)."""
    limit, shared = min((lens[i] - 1) // BS for i in rows), 0
    while shared < limit and len({tables[i, shared] for i in rows}) == 1:
        shared += 1
    return shared


def group_saving(tables, lens, rows, least: int) -> int:
    """Blocks one group of ``rows`` saves: (members - 1) * shared, or 0 when it cannot form."""
    shared = common_blocks(tables, lens, rows) if len(rows) > 1 else 0
    return (len(rows) - 1) * shared if shared >= least else 0


def simple_choice(tables, lens, keys, least: int) -> int:
    """Blocks saved by clustering on the first block and taking, per cluster, one cross-request group
    or one group per request, whichever saves more (the simple heuristic the planner must match)."""
    long = [i for i in range(len(lens)) if (lens[i] - 1) // BS >= least]
    total = 0
    for first in {tables[i, 0] for i in long}:
        cluster = [i for i in long if tables[i, 0] == first]
        per_request = sum(group_saving(tables, lens, [i for i in cluster if keys[i] == k], least)
                          for k in {keys[i] for i in cluster})  # fmt: skip
        total += max(group_saving(tables, lens, cluster, least), per_request)
    return total


@settings(max_examples=300, deadline=None)
@given(shared_batches(), st.integers(1, 4), st.floats(0.0, 0.6), st.integers(0, 80))
def test_every_group_shares_its_prefix_before_each_members_last_token(batch, min_blocks, fraction, floor):
    tables, lens, keys = batch
    plan = plan_cascade(tables, lens, BS, min_shared_blocks=min_blocks, min_saved_fraction=fraction,
                        min_saved_tokens=floor)  # fmt: skip
    saved = 0
    for g, prefix in enumerate(plan.prefix_lens.tolist()):
        rows = np.flatnonzero(plan.seq_groups == g).tolist()
        assert len(rows) >= 2 and prefix % BS == 0 and prefix // BS >= min_blocks
        assert common_blocks(tables, lens, rows) >= prefix // BS  # shared by all, strictly before each last token
        saved += (len(rows) - 1) * prefix
    assert plan.saved_tokens == saved and plan.plain_tokens == lens.sum()
    assert plan.pays == (plan.num_groups > 0 and saved >= fraction * lens.sum() and saved >= floor)
    if not may_share(tables, np.arange(len(lens)), lens, BS, min_blocks, floor):  # the step builder's screen
        assert not plan.pays
    if plan.num_groups:  # what the planner hands over is a valid cascade batch
        arrays = cascade_host_arrays(tables, lens, plan.seq_groups, plan.prefix_lens, BS)
        assert (arrays.suffix_lens >= 1).all()


@settings(max_examples=300, deadline=None)
@given(shared_batches(), st.integers(1, 4))
def test_plan_saves_at_least_the_per_request_and_the_simple_cross_request_choices(batch, min_blocks):
    tables, lens, keys = batch
    plan = plan_cascade(tables, lens, BS, min_shared_blocks=min_blocks, min_saved_fraction=0.0)
    per_request = sum(group_saving(tables, lens, [i for i, k in enumerate(keys) if k == key], min_blocks)
                      for key in set(keys))  # fmt: skip
    assert plan.saved_tokens >= per_request * BS
    assert plan.saved_tokens >= simple_choice(tables, lens, keys, min_blocks) * BS


def partitions(items: list[int]):
    """Every partition of ``items`` into non-empty groups."""
    if not items:
        yield []
        return
    for rest in partitions(items[1:]):
        for i in range(len(rest)):
            yield rest[:i] + [[items[0], *rest[i]]] + rest[i + 1 :]
        yield [[items[0]], *rest]


@settings(max_examples=150, deadline=None)
@given(shared_batches(), st.integers(1, 3))
def test_plan_saves_as_much_as_the_best_partition_into_groups(batch, min_blocks):
    tables, lens, _ = batch
    rows = [i for i in range(len(lens)) if (lens[i] - 1) // BS >= min_blocks][:7]  # 877 partitions at most
    tables, lens = tables[rows], lens[rows]
    best = max(sum(group_saving(tables, lens, g, min_blocks) for g in p) for p in partitions(list(range(len(rows)))))
    plan = plan_cascade(tables, lens, BS, min_shared_blocks=min_blocks, min_saved_fraction=0.0)
    assert plan.saved_tokens == best * BS


def test_single_sequence_requests_under_one_system_prompt_form_one_group():
    system = [0, 1, 2, 3, 4, 5]
    tables = np.array([system + [10 + i, 20 + i] for i in range(4)] + [[30, 31, 32, 33, 34, 35, 36, 37]])
    lens = np.array([30, 29, 32, 26, 32])
    plan = plan_cascade(tables, lens, BS)
    assert plan.seq_groups.tolist() == [0, 0, 0, 0, -1] and plan.prefix_lens.tolist() == [24]
    assert plan.saved_tokens == 3 * 24 and plan.pays


def test_beams_keep_their_deeper_group_when_it_saves_more_and_join_the_others_when_not():
    system = [0, 1, 2, 3, 4]  # 5 shared blocks
    beams = [system + [5, 6, 7, 8, 9, 100 + b] for b in range(4)]  # request "a": 10 blocks shared by 4 beams
    alone = [system + [200 + i] + [-1] * 5 for i in range(2)]  # requests "b", "c": the system prompt only
    tables = np.array(beams + alone)
    lens = np.array([43] * 4 + [22, 23])
    plan = plan_cascade(tables, lens, BS)
    # one group of 6 saves 5 * 5 blocks, per request 3 * 10; the beams' group and the others' save 3 * 10 + 5
    assert plan.seq_groups.tolist() == [0, 0, 0, 0, 1, 1] and plan.prefix_lens.tolist() == [40, 20]
    assert plan.saved_tokens == (30 + 5) * BS
    two_beams = [system + [5, 100 + b] for b in range(2)]  # 6 blocks shared by 2 beams: 6 blocks saved alone
    others = [system + [200 + i, -1] for i in range(6)]
    plan = plan_cascade(np.array(two_beams + others), np.array([28, 27] + [24] * 6), BS)
    assert plan.seq_groups.tolist() == [0] * 8 and plan.prefix_lens.tolist() == [20]  # 7 * 5 > 6 + 5 * 5
    assert plan.saved_tokens == 35 * BS


def test_tenants_sharing_only_a_template_block_get_a_group_each():
    template = [0]  # a chat template's opening block, held by every request
    tenant = {t: template + [10 * t + i for i in range(1, 6)] for t in (1, 2)}  # 6-block system prompts
    rows = [tenant[t] + [100 + 10 * t + r, -1] for t in (1, 2) for r in range(3)]
    tables, lens = np.array(rows), np.array([26] * 6)
    plan = plan_cascade(tables, lens, BS)
    assert plan.seq_groups.tolist() == [0, 0, 0, 1, 1, 1] and plan.prefix_lens.tolist() == [24, 24]
    assert may_share(tables, np.arange(6), lens, BS)


def test_heuristic_needs_enough_shared_blocks_and_savings():
    tables = np.array([[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 6], [7, 8, 9, 10, 11, 12]])
    lens = np.array([22, 24, 24])
    two = plan_cascade(tables, lens, BS)
    assert two.seq_groups.tolist() == [0, 0, -1] and two.prefix_lens.tolist() == [20]
    assert two.saved_tokens == 20 and two.plain_tokens == 70 and two.pays  # 20 / 70 >= 0.25
    assert not plan_cascade(tables, lens, BS, min_saved_fraction=0.5).pays
    assert plan_cascade(tables, lens, BS, min_shared_blocks=6).num_groups == 0
    assert plan_cascade(tables, lens, BS, min_saved_tokens=20).pays  # the floor: at least 20 tokens saved
    assert not plan_cascade(tables, lens, BS, min_saved_tokens=21).pays


def test_min_saved_tokens_turns_bytes_per_layer_into_tokens():
    assert min_saved_tokens(1536, "cpu") == -(-(8 << 20) // 1536)  # SmolLM2-135M float32: 3 KV heads x 64 x 2 x 4
    assert min_saved_tokens(4096, "cuda") == (32 << 20) // 4096
    assert min_saved_tokens(4096, "cpu", 4097) == 2 and min_saved_tokens(4096, "cuda", 0) == 0


def test_may_share_reads_one_column_of_the_long_rows():
    host = np.array([[0, 1, 2, 3, 4], [0, 1, 2, 3, 5], [0, 1, 2, 9, 6], [7, 7, 7, 7, 7]])
    lens = np.array([20, 20, 20, 20])  # 4 blocks before each last token
    assert may_share(host, np.array([0, 1]), lens[:2], BS)  # column 3 holds block 3 twice
    assert not may_share(host, np.array([0, 2, 3]), lens[:3], BS)  # 3, 9, 7: no group can form
    assert not may_share(host, np.array([0, 1]), np.array([20, 16]), BS)  # row 1 is too short for 4 blocks
    assert may_share(host, np.array([0, 2]), lens[:2], BS, min_shared_blocks=3)
    assert not may_share(host, np.array([0]), lens[:1], BS)
    assert may_share(host, np.array([0, 1]), lens[:2], BS, min_saved_tokens=16)  # one row's 4 blocks could be saved
    assert not may_share(host, np.array([0, 1]), lens[:2], BS, min_saved_tokens=17)


@pytest.mark.parametrize("lens,shared", [((12, 12), 2), ((9, 12), 2), ((8, 12), 1), ((1, 12), 0)])
def test_the_block_being_written_is_never_shared(lens, shared):
    rows = np.array([[3, 4, 5], [3, 4, 5]])  # token 11 sits in block 2; token 7 in block 1; token 0 in block 0
    plan = plan_cascade(rows, np.array(lens), BS, min_shared_blocks=1, min_saved_fraction=0.0)
    assert plan.prefix_lens.tolist() == ([shared * BS] if shared else [])


def block_tables(bm: BlockManager, ids: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(tables [S, W] zero-padded, lens [S]) of sequences in the block manager."""
    width = max(len(bm.block_table(s)) for s in ids)
    tables = np.array([bm.block_table(s) + [0] * (width - len(bm.block_table(s))) for s in ids])
    return tables, np.array([bm.num_tokens(s) for s in ids])


def test_forked_sequences_of_the_block_manager_share_the_prompt_blocks():
    bm = BlockManager(BlockManagerConfig(num_blocks=64, block_size=BS, watermark=0.0))
    bm.allocate("p", list(range(22)))  # 5 full blocks + 2 tokens
    for child in ("c1", "c2", "c3"):
        bm.fork("p", child)
    for i, seq in enumerate(("p", "c1", "c2", "c3")):
        bm.append(seq, [100 + i])  # copy-on-write of the shared partial block
    tables, lens = block_tables(bm, ["p", "c1", "c2", "c3"])
    plan = plan_cascade(tables, lens, BS)
    assert plan.prefix_lens.tolist() == [20] and plan.seq_groups.tolist() == [0, 0, 0, 0] and plan.pays


def test_requests_with_a_cached_system_prompt_share_its_blocks_across_requests():
    bm = BlockManager(BlockManagerConfig(num_blocks=64, block_size=BS, watermark=0.0))
    system = list(range(1000, 1026))  # 6 full blocks + 2 tokens
    ids = [f"r{i}" for i in range(4)]
    for i, seq in enumerate(ids):
        bm.allocate(seq, system + [i, i + 1, i + 2])  # prefix caching hands every request the cached blocks
        bm.append(seq, [7])
    tables, lens = block_tables(bm, ids)
    assert may_share(tables, np.arange(4), lens, BS)
    plan = plan_cascade(tables, lens, BS)
    assert plan.seq_groups.tolist() == [0, 0, 0, 0] and plan.prefix_lens.tolist() == [24] and plan.pays
