"""Helpers shared by the block manager's test modules (which import them from here, never from each other)."""

from __future__ import annotations

import dataclasses
import random

from paged_kv import BlockManager, BlockManagerConfig
from paged_kv.block_hash import BlockHash
from paged_kv.block_manager import RELEASED
from paged_kv.block_pool import BlockPool

BS = 4
VOCAB = 3  # few distinct ids, so prompts share prefixes and hit the cache often
PREFIXES = [[1, 2, 3, 0] * 4, [2, 2, 1, 0] * 4, [3, 1, 0, 2] * 4]


def make(num_blocks: int = 8, block_size: int = 4, num_cpu_blocks: int = 4, track_changes: bool = False,
         **kw) -> BlockManager:  # fmt: skip
    """A small manager; no watermark unless asked."""
    kw.setdefault("watermark", 0.0)
    config = BlockManagerConfig(num_blocks=num_blocks, block_size=block_size, num_cpu_blocks=num_cpu_blocks, **kw)
    return BlockManager(config, track_changes=track_changes)


def pool_state(pool: BlockPool) -> tuple:
    """Every field of a pool, copied."""
    return (
        pool.num_blocks, list(pool.ref_counts), list(pool._free), list(pool._evictable), dict(pool._cached),
        list(pool.hash_of), list(pool._parent), list(pool._tokens), pool.num_evictions,
    )


def snapshot(m: BlockManager) -> tuple:
    """The whole state of a manager: sequences (all fields), both pools, counters, journal and stats."""
    seqs = [(sid, dataclasses.astuple(s)) for sid, s in m._seqs.items()]
    journal = None if m._journal is None else list(m._journal)
    return seqs, pool_state(m.gpu), pool_state(m.cpu), vars(m._hits).copy(), m.num_cow_copies, journal, m.stats()


def cached_hash(m: BlockManager, block: int) -> BlockHash | None:
    """The hash a GPU block is cached under, or None."""
    return m.gpu.hash_of[block]


def replay(journal: list, mirror: dict | None = None) -> dict:
    """Apply journal entries in order to ``mirror`` (seq -> row): set an entry, or drop a released row."""
    mirror = {} if mirror is None else mirror
    for sid, i, block in journal:
        if i == RELEASED:
            assert block == RELEASED
            mirror.pop(sid, None)
            continue
        row = mirror.setdefault(sid, [])
        assert 0 <= i <= len(row), f"entry {i} of {sid!r} past the end of its row ({len(row)})"
        row[i : i + 1] = [block]
    return mirror


def assert_mirror_matches(m: BlockManager, mirror: dict) -> None:
    """Every resident sequence's table is a prefix of its row; no swapped-out or freed sequence has a row."""
    resident = {s for s in m.seq_ids() if not m.is_swapped(s)}
    assert set(mirror) <= resident, f"rows of released sequences: {set(mirror) - resident}"
    for sid in resident:
        table = m.block_table(sid)
        assert mirror.get(sid, [])[: len(table)] == table, f"seq {sid!r}: row {mirror.get(sid)} != table {table}"


def random_op(m: BlockManager, rng: random.Random, live: list[int], ids) -> None:
    """One random operation; OutOfBlocksError may escape (and must leave ``m`` unchanged)."""
    op = rng.choice(["alloc", "alloc", "append", "append", "fork", "free", "free", "truncate", "swap", "write", "drop"])
    if rng.random() < 0.01:
        m.reset_prefix_cache()
    if op == "alloc" or not live:
        tail = [rng.randrange(4) for _ in range(rng.randrange(24))]
        prompt = rng.choice(PREFIXES)[: rng.randrange(17)] + tail if rng.random() < 0.9 else rng.randrange(40)
        sid = next(ids)
        m.allocate(sid, prompt, cache_salt=rng.choice([None, "s"]), num_lookahead_slots=rng.randrange(4))
        live.append(sid)
        return
    sid = rng.choice(live)
    if op == "free":
        live.remove(sid)
        m.free(sid)
    elif op == "swap":
        m.swap_in([sid]) if m.is_swapped(sid) else m.swap_out([sid])
    elif m.is_swapped(sid):
        return
    elif op == "append":
        m.append(sid, [rng.randrange(4) for _ in range(rng.randrange(10))] if rng.random() < 0.9 else 3)
    elif op == "fork":
        child = next(ids)
        m.fork(sid, child)
        live.append(child)
    elif op == "drop":
        m.drop_front(sid, rng.randrange(len(m.block_table(sid)) + 1))
    elif op == "write":
        end = rng.randrange(len(m.block_table(sid)) * BS + 1)
        m.prepare_write(sid, rng.randrange(end + 1), end)
    else:
        m.truncate(sid, rng.randrange(m.num_tokens(sid) + 1))


def blocks_to_append_all(m: BlockManager, requests) -> int:
    """Free blocks ``append`` of each ``(seq_id, n)`` in turn takes (as ``num_blocks_to_write_all`` counts them),
    after checking that ``can_append_all`` agrees with the count."""
    requests = list(requests)
    need = m.num_blocks_to_write_all([(s, m.num_tokens(s), m.num_tokens(s) + n) for s, n in requests])
    assert m.can_append_all(requests) == (need <= m.num_free_blocks)
    return need


def distinct_blocks(m: BlockManager, seq_ids) -> int:
    """Blocks the sequences hold together, each shared block counted once (what swapping them moves)."""
    return len({b for sid in seq_ids for b in m.block_table(sid)})
