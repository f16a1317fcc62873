"""A state machine over the prefix cache's tiers, with a simulated data plane.

Each device and host block holds a value standing for its K/V: ``(salt, ids up to the block's
end)``, what real K/V depends on. The machine runs the block manager's tier ops as the runner
does (stores, fills, loads, the forward's writes, post-stores) and a dict standing for the
disk (written through from the host, read back by prefetch), and checks after every step that
every live sequence's blocks hold exactly its own content: no tier ever serves a block with
other tokens or another salt, nothing leaks, and each pool's invariants hold.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from paged_kv import BlockManager, BlockManagerConfig
from paged_kv.errors import OutOfBlocksError
from paged_kv.host_tier import BlockRecord

BS = 2
PREFIXES = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 9, 9], [7, 7, 7, 7, 7, 7]]  # shared leading blocks between them
SALTS = [None, "tenant-b"]


def content(salt: str | None, ids: list[int], block: int) -> tuple:
    """What block ``block`` of a sequence of ``ids`` under ``salt`` holds once computed."""
    return (salt, tuple(ids[: (block + 1) * BS]))


class Tiers(RuleBasedStateMachine):
    """Allocate, free, prefetch from a disk, reset; run each step's ops; check every block's content."""

    @initialize(num_blocks=st.integers(6, 14), num_host=st.integers(1, 8), policy=st.sampled_from(["evict", "write"]))
    def start(self, num_blocks: int, num_host: int, policy: str) -> None:
        config = BlockManagerConfig(num_blocks=num_blocks, block_size=BS, watermark=0.0, num_host_blocks=num_host,
                                    host_store=policy, track_cache_events=True)  # fmt: skip
        self.bm = BlockManager(config)
        self.device: dict[int, tuple] = {}
        self.host: dict[int, tuple] = {}
        self.disk: dict[bytes, tuple[BlockRecord, tuple]] = {}
        self.live: dict[int, tuple[str | None, list[int]]] = {}
        self.next_id = 0
        self.cached_total = 0

    @rule(prefix=st.sampled_from(range(len(PREFIXES))), salt=st.sampled_from(SALTS),
          tail=st.lists(st.integers(1, 9), max_size=3), prefetch=st.booleans())  # fmt: skip
    def allocate(self, prefix: int, salt: str | None, tail: list[int], prefetch: bool) -> None:
        ids = PREFIXES[prefix] + tail
        if prefetch:
            self._prefetch(ids, salt)
        seq = self.next_id
        self.next_id += 1
        try:
            cached = self.bm.allocate(seq, ids, cache_salt=salt)
        except OutOfBlocksError:
            self._run_step([])
            return
        self.cached_total += cached
        self.live[seq] = (salt, ids)
        table = self.bm.block_table(seq)
        computed = [(b, content(salt, ids, i)) for i, b in enumerate(table) if i * BS >= cached]
        self._run_step(computed)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data) -> None:
        seq = data.draw(st.sampled_from(sorted(self.live)))
        self.bm.free(seq)
        del self.live[seq]
        self._run_step([])

    @rule()
    def reset(self) -> None:
        self.bm.reset_prefix_cache()
        self._run_step([])

    def _prefetch(self, ids: list[int], salt: str | None) -> None:
        """Bring the blocks the fake disk holds past the device and host hits into the host tier."""
        parent, hashes, contents = self.bm.chain_past_cache(ids, cache_salt=salt)
        found = []
        for h, toks in zip(hashes, contents):
            entry = self.disk.get(h)
            if entry is None or entry[0].parent != parent or entry[0].tokens != toks:
                break
            found.append(entry)
            parent = h
        if found:
            self.bm.fill_host([r for r, _ in found], [c for _, c in found])

    def _run_step(self, computed: list[tuple[int, tuple]]) -> None:
        """Run the step's ops in the runner's order around a forward that writes ``computed``."""
        ops = self.bm.take_tier_ops()
        for d, h, r in ops.stores:
            self._store(d, h, r)
        for fill in ops.fills:
            for h, value in zip(fill.host_blocks, fill.payload):
                self.host[h] = value
        for h, d in ops.loads:
            self.device[d] = self.host[h]
        for b, value in computed:
            if len(value[1]) % BS == 0:  # a partial block holds nothing a hit can read
                self.device[b] = value
        for d, h, r in ops.post_stores:
            self._store(d, h, r)
        self.bm.take_cache_events()

    def _store(self, d: int, h: int, r: BlockRecord) -> None:
        self.host[h] = self.device[d]
        self.disk[r.hash] = (r, self.device[d])  # written through

    @invariant()
    def every_block_holds_its_own_content(self) -> None:
        for seq, (salt, ids) in self.live.items():
            for i, b in enumerate(self.bm.block_table(seq)[: len(ids) // BS]):
                assert self.device.get(b) == content(salt, ids, i), (seq, i, b)

    @invariant()
    def pools_consistent(self) -> None:
        self.bm.check()
        for block, h, parent, tokens in self.bm.host.pool.cached_blocks():  # came from a store or the disk
            record, value = self.disk[h]
            assert (record.parent, record.tokens, value) == (parent, tokens, self.host[block])

    def teardown(self) -> None:
        if hasattr(self, "bm"):
            for seq in list(self.live):
                self.bm.free(seq)
            self._run_step([])
            assert self.bm.stats().num_used == 0


TestTiers = Tiers.TestCase
TestTiers.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_the_machine_exercises_host_and_disk_hits():
    """A fixed run where the device is too small to keep the prefix: the host, then the disk, serves it."""
    m = Tiers()
    m.start(num_blocks=6, num_host=2, policy="evict")
    m.allocate(0, None, [], False)
    m.free(_Draw(0))
    for p in (2, 2):  # evict prefix 0 from the device through the host (2 blocks) to the disk
        m.allocate(p, None, [p], False)
        m.free(_Draw(max(m.live)))
    m.allocate(0, None, [8], True)
    stats = m.bm.stats()
    assert stats.num_host_hit_tokens + stats.num_lower_hit_tokens > 0
    assert m.cached_total >= 4
    m.every_block_holds_its_own_content()
    m.teardown()


class _Draw:
    """A stand-in for hypothesis' ``data`` drawing one fixed value."""

    def __init__(self, value: int) -> None:
        self.value = value

    def draw(self, _strategy) -> int:
        return self.value
