"""Model-based tests of the block manager: random operation sequences over a small pool.

The model keeps, per sequence, the content of its slots; a simulated device
keeps, per physical block, what was written into each slot. Copies and swap
mappings returned by the manager are applied to the device exactly as a real
engine would, and after every step every sequence, read through its block
table, must give back exactly its content: copy-on-write, prefix hits and
swapping never serve wrong data. After ``drop_front`` a sequence's new tokens
are written as ``("w", id)``: KV computed without the dropped tokens differs
from the same ids' KV in a full prefix, so a block of it that reached the
prefix cache would read back wrong.
"""

from __future__ import annotations

import itertools
import random
from array import array

import pytest
from bm_helpers import BS, VOCAB, assert_mirror_matches, random_op, replay, snapshot
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from paged_kv import BlockManager, BlockManagerConfig, OutOfBlocksError

token_lists = st.lists(st.integers(0, VOCAB - 1), max_size=3 * BS + 2)
token_specs = st.one_of(token_lists, token_lists, st.integers(0, 2 * BS))  # ids, or an anonymous count
picks = st.integers(0, 1 << 10)  # an index into the candidates, taken modulo their number


class Device:
    """Block contents of one pool: block -> slots, written as a device would."""

    def __init__(self) -> None:
        self.slots: dict[int, list[object]] = {}

    def write(self, table: list[int], start: int, values: list[object]) -> None:
        """Write values at logical positions ``start...`` of a sequence with this block table."""
        for pos, value in enumerate(values, start):
            self.slots.setdefault(table[pos // BS], [None] * BS)[pos % BS] = value

    def read(self, table: list[int], n: int) -> list[object]:
        """The first ``n`` logical positions of a sequence with this block table."""
        return [self.slots.get(table[p // BS], [None] * BS)[p % BS] for p in range(n)]


def copy_blocks(src: Device, dst: Device, pairs: list[tuple[int, int]]) -> None:
    """Run (src, dst) block copies from one device pool to another (or the same)."""
    data = {d: list(src.slots.get(s, [None] * BS)) for s, d in pairs}  # read all, then write
    dst.slots.update(data)


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / append / fork / free / truncate / drop_front / swap (one, a set, a forked family) /
    reset / prepare_write."""

    def __init__(self) -> None:
        super().__init__()
        cfg = BlockManagerConfig(num_blocks=12, block_size=BS, num_cpu_blocks=6, watermark=0.0)
        self.m = BlockManager(cfg, track_changes=True)
        self.mirror: dict[int, list[int]] = {}  # the table journal replayed from the start
        self.content: dict[int, list[object]] = {}
        self.swapped: dict[int, bool] = {}
        self.gpu, self.cpu = Device(), Device()
        self.ids = itertools.count()
        self.last = -1  # the sequence a rule used last
        self.markers = itertools.count(-1, -1)  # content of anonymous or overwritten slots
        self.told: dict[int, list[int]] = {}  # token ids each sequence was given, up to its first anonymous one
        self.prompts: list[list[int]] = []  # recent id lists worth asking for again (they may be cached)
        self.windowed: set[int] = set()  # sequences that dropped leading blocks (and their forks)

    # -- helpers --------------------------------------------------------------
    def pick(self, i: int, *, swapped: bool | None = None) -> int:
        """Mostly the sequence used last (long chains of steps on one sequence), else any."""
        ids = sorted(s for s in self.content if swapped is None or self.swapped[s] == swapped)
        self.last = self.last if i % 4 and self.last in ids else ids[i // 4 % len(ids)]
        return self.last

    def values(self, spec: list[int] | int, sid: int | None = None) -> list[object]:
        """What a token spec writes: its ids (tagged in a windowed sequence), or fresh markers for anonymous tokens."""
        if not isinstance(spec, list):
            return [next(self.markers) for _ in range(spec)]
        return [("w", t) for t in spec] if sid in self.windowed else list(spec)

    def refused(self, call, can: bool) -> bool:
        """Run ``call``; True if it raised OutOfBlocksError, which ``can`` must have predicted."""
        before = None if can else snapshot(self.m)
        try:
            self.result = call()
        except OutOfBlocksError:
            assert not can, "can_* said yes but the action ran out of blocks"
            assert snapshot(self.m) == before, "a refused call changed the manager"
            return True
        assert can, "can_* said no but the action succeeded"
        return False

    def has(self, swapped: bool) -> bool:
        """Whether some sequence is swapped out (True) or resident (False)."""
        return any(v == swapped for v in self.swapped.values())

    def remember(self, ids: list[int]) -> None:
        """Keep ``ids`` as a prompt to ask for again (the 30 most recent)."""
        if len(ids) > BS:
            self.prompts = [*self.prompts[-29:], list(ids)]

    # -- rules ------------------------------------------------------------------
    @precondition(lambda self: self.prompts)
    @rule(i=picks, cut=picks, tail=token_lists, salt=st.sampled_from([None, None, "t"]))
    def allocate_known_prefix(self, i, cut, tail, salt):
        """A prompt that starts like an earlier one, so that it should hit the prefix cache."""
        ids = self.prompts[i % len(self.prompts)]
        self.allocate(ids[: BS + cut % (len(ids) - BS + 1)] + tail, salt, 0)

    @rule(spec=token_specs, salt=st.sampled_from([None, None, "t"]), lookahead=st.integers(0, 5))
    def allocate(self, spec, salt, lookahead):
        sid = next(self.ids)
        can = self.m.can_allocate(spec, cache_salt=salt, num_lookahead_slots=lookahead)
        cached = self.m.num_cached_tokens(spec, cache_salt=salt)
        call = lambda: self.m.allocate(sid, spec, cache_salt=salt, num_lookahead_slots=lookahead)  # noqa: E731
        if self.refused(call, can):
            return
        values = self.values(spec)
        hit = self.result
        assert hit == cached and hit % BS == 0 and (hit < len(values) or hit == 0)
        assert isinstance(spec, list) or hit == 0
        self.gpu.write(self.m.block_table(sid), hit, values[hit:])
        self.content[sid], self.swapped[sid], self.last = values, False, sid
        self.told[sid] = list(spec) if isinstance(spec, list) else []
        self.remember(self.told[sid])

    @precondition(lambda self: self.has(False))
    @rule(i=picks, spec=token_specs, lookahead=st.integers(0, 5))
    def append(self, i, spec, lookahead):
        sid = self.pick(i, swapped=False)
        n = spec if isinstance(spec, int) else len(spec)
        can = self.m.can_append(sid, n, num_lookahead_slots=lookahead)
        if self.refused(lambda: self.m.append(sid, spec, num_lookahead_slots=lookahead), can):
            return
        copy_blocks(self.gpu, self.gpu, self.result)
        values = self.values(spec, sid)
        self.gpu.write(self.m.block_table(sid), len(self.content[sid]), values)
        if len(self.told[sid]) == len(self.content[sid]):
            self.told[sid] += list(spec) if isinstance(spec, list) else []
            self.remember(self.told[sid])
        self.content[sid] += values

    @precondition(lambda self: self.has(False))
    @rule(i=picks)
    def fork(self, i):
        parent, child = self.pick(i, swapped=False), next(self.ids)
        self.m.fork(parent, child)
        self.content[child], self.swapped[child] = list(self.content[parent]), False
        self.told[child] = list(self.told[parent])
        if parent in self.windowed:
            self.windowed.add(child)

    @precondition(lambda self: self.content)
    @rule(i=picks)
    def free(self, i):
        sid = self.pick(i)
        self.m.free(sid)
        del self.content[sid], self.swapped[sid], self.told[sid]
        self.windowed.discard(sid)

    @precondition(lambda self: self.has(False))
    @rule(i=picks, cut=st.integers(0, 1 << 10))
    def truncate(self, i, cut):
        sid = self.pick(i, swapped=False)
        n = cut % (len(self.content[sid]) + 1)
        self.m.truncate(sid, n)
        del self.content[sid][n:], self.told[sid][n:]

    @precondition(lambda self: self.has(False))
    @rule(i=picks, cut=st.integers(0, 1 << 10))
    def drop_front(self, i, cut):
        """A sliding window: the data loses its first ``num_blocks * BS`` tokens."""
        sid = self.pick(i, swapped=False)
        k = cut % (len(self.m.block_table(sid)) + 1)
        self.m.drop_front(sid, k)
        del self.content[sid][: k * BS], self.told[sid][: k * BS]
        if k:
            self.windowed.add(sid)

    @precondition(lambda self: self.has(False))
    @rule(i=picks)
    def swap_out(self, i):
        sid = self.pick(i, swapped=False)
        if not self.refused(lambda: self.m.swap_out([sid]), self.m.can_swap_out([sid])):
            copy_blocks(self.gpu, self.cpu, self.result)
            self.swapped[sid] = True

    @precondition(lambda self: self.has(True))
    @rule(i=picks)
    def swap_in(self, i):
        sid = self.pick(i, swapped=True)
        if not self.refused(lambda: self.m.swap_in([sid]), self.m.can_swap_in([sid])):
            copy_blocks(self.cpu, self.gpu, self.result)
            self.swapped[sid] = False

    def subset(self, mask: int, *, swapped: bool) -> list[int]:
        """The swapped (or resident) sequences picked by the bits of ``mask``, in a mask-dependent order."""
        ids = sorted(s for s in self.content if self.swapped[s] == swapped)
        chosen = [s for k, s in enumerate(ids) if mask >> (k % 16) & 1] or ids[mask % len(ids) :][:1]
        return chosen[::-1] if mask & (1 << 16) else chosen

    def distinct(self, group: list[int]) -> set[int]:
        """The physical blocks a group of sequences holds."""
        return {b for s in group for b in self.m.block_table(s)}

    @precondition(lambda self: self.has(False))
    @rule(mask=st.integers(0, (1 << 17) - 1))
    def swap_out_group(self, mask):
        group = self.subset(mask, swapped=False)
        if not self.refused(lambda: self.m.swap_out(group), self.m.can_swap_out(group)):
            assert len(self.result) == len(self.distinct(group))  # each block moved once
            copy_blocks(self.gpu, self.cpu, self.result)
            self.swapped.update(dict.fromkeys(group, True))

    @precondition(lambda self: self.has(True))
    @rule(mask=st.integers(0, (1 << 17) - 1))
    def swap_in_group(self, mask):
        group = self.subset(mask, swapped=True)
        if not self.refused(lambda: self.m.swap_in(group), self.m.can_swap_in(group)):
            assert len(self.result) == len(self.distinct(group))
            copy_blocks(self.cpu, self.gpu, self.result)
            self.swapped.update(dict.fromkeys(group, False))

    @precondition(lambda self: self.has(False))
    @rule(i=picks, k=st.integers(0, 3))
    def swap_forked_group_out_and_in(self, i, k):
        """Fork ``k`` children, swap the family out and back in: as many distinct blocks, shared as before.

        The children are freed at the end, so that forks do not pile up (forking takes no block)."""
        group = [self.pick(i, swapped=False)]
        for _ in range(k):
            self.fork(1)  # an odd pick keeps the sequence used last: the parent
            group.append(max(self.content))  # the child, the newest id
        self.swap_family(group)
        for child in group[1:]:
            self.m.free(child)
            del self.content[child], self.swapped[child], self.told[child]
            self.windowed.discard(child)

    def swap_family(self, group: list[int]) -> None:
        """Swap resident ``group`` out and back in (as far as the pools allow); check its blocks and sharing."""
        tables = {s: self.m.block_table(s) for s in group}
        if self.refused(lambda: self.m.swap_out(group), self.m.can_swap_out(group)):
            return
        copy_blocks(self.gpu, self.cpu, self.result)
        self.swapped.update(dict.fromkeys(group, True))
        self.every_sequence_reads_back_its_content()
        if self.refused(lambda: self.m.swap_in(group), self.m.can_swap_in(group)):
            return
        copy_blocks(self.cpu, self.gpu, self.result)
        self.swapped.update(dict.fromkeys(group, False))
        old_to_new = {}  # one new block per old one, consistently across the family's tables
        for s in group:
            for old, new in zip(tables[s], self.m.block_table(s), strict=True):
                assert old_to_new.setdefault(old, new) == new, "a shared block came back as two"
        assert len(set(old_to_new.values())) == len(old_to_new) == len(self.distinct(group))

    @rule(now=st.sampled_from([False] * 7 + [True]))  # rarely: a reset empties the cache
    def reset_prefix_cache(self, now):
        if now:
            self.m.reset_prefix_cache()
            assert self.m.stats().num_cached == 0

    @precondition(lambda self: self.has(False))
    @rule(i=picks, a=st.integers(0, 1 << 10), b=st.integers(0, 1 << 10))
    def prepare_write(self, i, a, b):
        sid = self.pick(i, swapped=False)
        capacity = len(self.m.block_table(sid)) * BS
        start, end = sorted((a % (capacity + 1), b % (capacity + 1)))
        can = self.m.can_prepare_write(sid, start, end)
        if self.refused(lambda: self.m.prepare_write(sid, start, end), can):
            return
        copy_blocks(self.gpu, self.gpu, self.result)
        values = [next(self.markers) for _ in range(end - start)]
        self.gpu.write(self.m.block_table(sid), start, values)  # may reach into lookahead slots
        content = self.content[sid]
        content[start : min(end, len(content))] = values[: max(0, len(content) - start)]

    @precondition(lambda self: self.has(False))
    @rule(i=picks, a=st.integers(0, 1 << 10))
    def prepare_write_empty(self, i, a):
        # an empty range writes nothing: no copy, and no cached block (even one shared mid-block) leaves the cache
        sid = self.pick(i, swapped=False)
        pos = a % (len(self.m.block_table(sid)) * BS + 1)
        before = snapshot(self.m)
        assert self.m.prepare_write(sid, pos, pos) == []
        assert snapshot(self.m) == before, "an empty prepare_write changed the manager"

    @precondition(lambda self: self.m.stats().num_blocks < 16)
    @rule(n=st.integers(0, 2))
    def add_blocks(self, n):
        self.m.add_blocks(n)

    # -- invariants ---------------------------------------------------------------
    @invariant()
    def manager_is_consistent(self):
        self.m.check()
        assert sorted(self.m.seq_ids()) == sorted(self.content)

    @invariant()
    def every_sequence_reads_back_its_content(self):
        for sid, content in self.content.items():
            assert self.m.num_tokens(sid) == len(content)
            assert self.m.is_swapped(sid) == self.swapped[sid]
            device = self.cpu if self.swapped[sid] else self.gpu
            assert device.read(self.m.block_table(sid), len(content)) == content, f"seq {sid} reads wrong data"

    @invariant()
    def cached_blocks_hold_the_ids_they_are_cached_under(self):
        # reads the pool's private hash map: this catches a wrong registration when it
        # happens, long before some later prompt would hit it
        pool = self.m.gpu
        for block in pool._cached.values():
            key = pool._tokens[block]  # the ids a hit compares: a tuple, or their int64 bytes
            ids = array("q", key).tolist() if isinstance(key, bytes) else list(key)
            assert self.gpu.read([block], BS) == ids, f"block {block} is cached under ids it does not hold"

    @invariant()
    def the_journal_replays_to_every_resident_table(self):
        # taken after every step and replayed onto the rows so far: the same as replaying it all from the start
        replay(self.m.take_table_changes(), self.mirror)
        assert_mirror_matches(self.m, self.mirror)

    @invariant()
    def stats_count_distinct_blocks(self):
        tables = {s: self.m.block_table(s) for s in self.content}
        gpu = {b for s, t in tables.items() if not self.swapped[s] for b in t}
        cpu = {b for s, t in tables.items() if self.swapped[s] for b in t}
        stats = self.m.stats()
        assert (stats.num_used, stats.num_cpu_used, stats.num_sequences) == (len(gpu), len(cpu), len(tables))


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def rand_ids(r: random.Random) -> list[int]:
    """Random token ids, as ``token_lists`` draws them."""
    return [r.randrange(VOCAB) for _ in range(r.randrange(3 * BS + 3))]


def rand_spec(r: random.Random) -> list[int] | int:
    """A random token spec, as ``token_specs`` draws them."""
    return rand_ids(r) if r.random() < 2 / 3 else r.randrange(2 * BS + 1)


def rand_pick(r: random.Random) -> int:
    """A random index, as ``picks`` draws them."""
    return r.randrange(1 << 10)


SALTS = [None, None, "t"]
RANDOM_RULES = {  # rule -> (precondition, random arguments), mirroring the rules' strategies
    "allocate": (lambda s: True, lambda r: dict(spec=rand_spec(r), salt=r.choice(SALTS), lookahead=r.randrange(6))),
    "allocate_known_prefix": (
        lambda s: s.prompts,
        lambda r: dict(i=rand_pick(r), cut=rand_pick(r), tail=rand_ids(r), salt=r.choice(SALTS)),
    ),
    "append": (lambda s: s.has(False), lambda r: dict(i=rand_pick(r), spec=rand_spec(r), lookahead=r.randrange(6))),
    "fork": (lambda s: s.has(False), lambda r: dict(i=rand_pick(r))),
    "free": (lambda s: s.content, lambda r: dict(i=rand_pick(r))),
    "truncate": (lambda s: s.has(False), lambda r: dict(i=rand_pick(r), cut=rand_pick(r))),
    "drop_front": (lambda s: s.has(False), lambda r: dict(i=rand_pick(r), cut=rand_pick(r))),
    "swap_out": (lambda s: s.has(False), lambda r: dict(i=rand_pick(r))),
    "swap_in": (lambda s: s.has(True), lambda r: dict(i=rand_pick(r))),
    "swap_out_group": (lambda s: s.has(False), lambda r: dict(mask=r.randrange(1 << 17))),
    "swap_in_group": (lambda s: s.has(True), lambda r: dict(mask=r.randrange(1 << 17))),
    "swap_forked_group_out_and_in": (lambda s: s.has(False), lambda r: dict(i=rand_pick(r), k=r.randrange(4))),
    "reset_prefix_cache": (lambda s: True, lambda r: dict(now=r.random() < 1 / 8)),
    "prepare_write": (lambda s: s.has(False), lambda r: dict(i=rand_pick(r), a=rand_pick(r), b=rand_pick(r))),
    "prepare_write_empty": (lambda s: s.has(False), lambda r: dict(i=rand_pick(r), a=rand_pick(r))),
    "add_blocks": (lambda s: s.m.stats().num_blocks < 16, lambda r: dict(n=r.randrange(3))),
}


@pytest.mark.parametrize("seed", range(4))
def test_long_random_walks_of_the_machine(seed):
    """Long seeded runs of the same rules and invariants: deeper than hypothesis' short examples."""
    rng = random.Random(seed)
    machine = BlockManagerMachine()
    for _ in range(1500):
        name = rng.choice([n for n, (enabled, _) in RANDOM_RULES.items() if enabled(machine)])
        getattr(machine, name)(**RANDOM_RULES[name][1](rng))
        machine.manager_is_consistent()
        machine.every_sequence_reads_back_its_content()
        machine.stats_count_distinct_blocks()
        machine.cached_blocks_hold_the_ids_they_are_cached_under()
        machine.the_journal_replays_to_every_resident_table()


def test_no_block_leaks_after_a_long_random_workload():
    """Thousands of random operations, then every sequence freed: every block is back."""
    rng = random.Random(2024)
    m = BlockManager(BlockManagerConfig(num_blocks=64, block_size=BS, num_cpu_blocks=16, watermark=0.0))
    live: list[int] = []
    ids = itertools.count()
    for step in range(10_000):
        try:
            random_op(m, rng, live, ids)
        except OutOfBlocksError:
            pass
        if step % 500 == 0:
            m.check()
    for sid in live:
        m.free(sid)
    m.check()
    assert m.seq_ids() == [] and m.gpu.ref_counts == [0] * 64
    assert len(m.gpu._free) + m.gpu.num_evictable == 64 and m.stats().num_used == 0
    assert m.cpu.num_free == 16 and m.stats().num_cpu_used == 0
    assert m.stats().num_cached == m.stats().num_evictable > 0
    assert m.stats().hit_rate > 0.1  # the workload did exercise the prefix cache
