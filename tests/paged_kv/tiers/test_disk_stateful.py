"""A Hypothesis state machine over a DiskTier: puts, flushes, reads, spoiled and deleted files, restarts, full budgets.

Invariants: a read returns only leading blocks of the asked chain (hash, parent and tokens), with
exactly the data they were written with; after a flush the files fit the budget and the journal's
stored minus removed blocks are the index; a read after a flush gets every block find counts unless
the test spoiled or deleted a file that the tier has not noticed yet. Seeded random walks drive the
same operations deeper than hypothesis' short examples.
"""

from __future__ import annotations

import random
import shutil
import tempfile
from pathlib import Path

import pytest
from disk_helpers import BS, assert_data_of, batch, chain, fingerprint, flip_byte, indexed, journal_set, our_files
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule

from paged_kv.tiers.disk_format import file_bytes
from paged_kv.tiers.disk_tier import DiskTier

FP = fingerprint(dtype="int8")  # quantized: scales travel too
CAPACITY = 10 * file_bytes(FP, 1)
# one prompt short and long (a prefix of it), the long one under another salt, another prompt
CHAINS = [chain(range(2 * BS)), chain(range(4 * BS)), chain(range(4 * BS), "t"), chain(range(100, 100 + 3 * BS))]
WHICH = st.integers(0, len(CHAINS) - 1)
FRACTION = st.floats(0, 1, exclude_max=True)  # picks a file, or a byte in it


class DiskTierMachine(RuleBasedStateMachine):
    """One directory, one tier at a time (restarts replace it), and what the test did to the files."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="disk-tier-machine-"))
        self.tier = self._open()
        self.live: set[bytes] = set()  # the journal's view of the index
        self.corrupted: set[str] = set()  # file names the test spoiled
        self.deleted: set[str] = set()  # file names the test deleted since the last refresh
        self.fresh = 0  # numbers fill_budget's prompts, never seen before

    def _open(self) -> DiskTier:
        return DiskTier(self.dir, capacity_bytes=CAPACITY, fingerprint=FP, blocks_per_file=2)

    def teardown(self) -> None:
        self.tier.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- the operations (plain methods: the random walks call them too) ----------------------------------
    def do_put(self, which: int, start: int, stop: int) -> None:
        blocks = CHAINS[which][3][start:stop]  # mostly prefixes; a slice that misses its head never hits
        self.tier.put(blocks, *batch(FP, blocks))

    def do_flush_and_check(self) -> None:
        self.tier.flush()
        assert self.tier.stats.bytes_used <= CAPACITY
        assert journal_set(self.tier.take_changes(), self.live) == indexed(self.tier)

    def do_read(self, which: int, limit: int, settle: bool) -> int:
        root, hashes, contents, blocks = CHAINS[which]
        if settle:
            self.tier.flush()
            found = self.tier.find(root, hashes, contents, limit)
            spoiled = any((self.dir / n).exists() for n in self.corrupted) or self.deleted  # maybe not noticed yet
        got, kv, scales = self.tier.read(root, hashes, contents, limit)
        assert got == blocks[: len(got)] and len(got) <= limit  # the asked chain's leading blocks only
        assert_data_of(FP, got, kv, scales)
        if settle:
            assert len(got) <= found
            assert spoiled or len(got) == found
        return len(got)

    def _pick_file(self, pick: float) -> Path | None:
        self.tier.flush()
        files = our_files(self.dir, FP)
        return files[int(pick * len(files))] if files else None

    def do_corrupt(self, pick: float, where: float) -> None:
        path = self._pick_file(pick)
        if path is not None:
            flip_byte(path, int(where * path.stat().st_size))
            self.corrupted.add(path.name)

    def do_delete(self, pick: float) -> None:
        path = self._pick_file(pick)
        if path is not None:
            path.unlink()
            self.deleted.add(path.name)

    def do_refresh(self) -> None:
        self.tier.refresh()
        self.deleted.clear()

    def do_restart(self) -> None:
        self.tier.close()
        self.tier = self._open()
        self.live = set()
        self.deleted.clear()

    def do_fill_budget(self) -> None:
        for _ in range(3):
            self.fresh += 1
            blocks = chain(range(10_000 * self.fresh, 10_000 * self.fresh + 3 * BS))[3]
            self.tier.put(blocks, *batch(FP, blocks))
        self.tier.flush()
        assert self.tier.stats.bytes_used <= CAPACITY

    # -- the rules ---------------------------------------------------------------------------------------
    @initialize(which=WHICH)
    def start_with_a_chain(self, which):
        self.do_put(which, 0, 4)

    @rule(which=WHICH, start=st.sampled_from([0, 0, 0, 1, 2]), stop=st.integers(1, 4))
    def put(self, which, start, stop):
        self.do_put(which, start, stop)

    @rule()
    def flush_and_check(self):
        self.do_flush_and_check()

    @rule(which=WHICH, limit=st.integers(0, 5), settle=st.booleans())
    def read(self, which, limit, settle):
        event("read some blocks" if self.do_read(which, limit, settle) else "read nothing")

    @rule(pick=FRACTION, where=FRACTION)
    def corrupt_a_file(self, pick, where):
        self.do_corrupt(pick, where)

    @rule(pick=FRACTION)
    def delete_a_file(self, pick):
        self.do_delete(pick)

    @rule()
    def refresh(self):
        self.do_refresh()

    @rule()
    def restart(self):
        self.do_restart()

    @rule()
    def fill_budget(self):
        self.do_fill_budget()


TestDiskTierMachine = DiskTierMachine.TestCase
TestDiskTierMachine.settings = settings(
    max_examples=40,
    stateful_step_count=30,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

# operation -> (weight, its arguments from a seeded generator)
WALK = {
    "do_put": (6, lambda r: dict(which=r.randrange(len(CHAINS)), start=r.choice([0, 0, 0, 1, 2]),
                                 stop=r.randint(1, 4))),
    "do_read": (6, lambda r: dict(which=r.randrange(len(CHAINS)), limit=r.randint(0, 5), settle=r.random() < 0.5)),
    "do_flush_and_check": (2, lambda r: {}),
    "do_corrupt": (1, lambda r: dict(pick=r.random(), where=r.random())),
    "do_delete": (1, lambda r: dict(pick=r.random())),
    "do_refresh": (1, lambda r: {}),
    "do_restart": (1, lambda r: {}),
    "do_fill_budget": (1, lambda r: {}),
}


@pytest.mark.parametrize("seed", range(2))
def test_long_random_walks_of_the_machine(seed):
    """Seeded runs of the same operations and checks, longer than hypothesis' examples."""
    rng = random.Random(seed)
    machine = DiskTierMachine()
    names, weights = list(WALK), [w for w, _ in WALK.values()]
    hits = 0
    try:
        for _ in range(400):
            name = rng.choices(names, weights)[0]
            args = WALK[name][1](rng)
            result = getattr(machine, name)(**args)
            hits += name == "do_read" and args["settle"] and bool(result)
        machine.do_flush_and_check()
    finally:
        machine.teardown()
    # the walk reaches the interesting states; only settled reads count, as the others race the writer thread
    assert hits >= 15
