"""A beam search's KV memory figures: measured each step only for the searches that report them."""

from __future__ import annotations

from beam_helpers import NEW, WIDTH
from sched_helpers import after_each_schedule, assert_all_freed, make_engine

from scheduler.engine.beam_search import BeamSearch, BeamSearchParams

BEAMS = BeamSearchParams(width=WIDTH, max_tokens=NEW, ignore_eos=True)


def _count_table_reads(engine) -> list[int]:
    """Count the block manager's ``block_table`` calls (the meter reads every live beam's table each step)."""
    calls, block_table = [0], engine.block_manager.block_table

    def counted(*args, **kwargs):
        calls[0] += 1
        return block_table(*args, **kwargs)

    engine.block_manager.block_table = counted
    return calls


def _expected_memory(engine) -> dict[str, list[tuple[int, int]]]:
    """Per search, per step: (distinct GPU blocks its beams hold, blocks summed over beams), read after scheduling."""
    seen, bm = {}, engine.block_manager

    def record(_):
        for rid, req in engine.beams.live.items():
            tables = [bm.block_table(s.seq_id) for s in req.beams if s.seq_id in bm and not bm.is_swapped(s.seq_id)]
            seen.setdefault(rid, []).append((len({b for t in tables for b in t}), sum(map(len, tables))))

    after_each_schedule(engine, record)
    return seen


def test_a_search_added_to_the_engine_reads_no_block_table(tiny_hf, beam_prompts):
    """Served searches (the engine's add_beam_search) report no memory: no step reads their block tables."""
    engine = make_engine(tiny_hf)
    calls = _count_table_reads(engine)
    reqs = [engine.add_beam_search(f"b{i}", p, BEAMS) for i, p in enumerate(beam_prompts)]
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    assert steps >= NEW and calls[0] == 0
    assert all(r.meter is None for r in reqs)
    assert_all_freed(engine)


def test_generate_reports_every_steps_blocks(tiny_hf, beam_prompts):
    """BeamSearch.generate measures its searches: each figure is the per-step counts' peak and sum."""
    engine = make_engine(tiny_hf, num_blocks=64)
    seen = _expected_memory(engine)
    search = BeamSearch(engine)
    outs = search.generate(beam_prompts, BEAMS)
    for out in outs:
        counts = seen[out.request_id]
        m = out.memory
        assert (m.peak_blocks, m.peak_blocks_unshared) == tuple(max(c[i] for c in counts) for i in (0, 1))
        assert (m.block_steps, m.block_steps_unshared) == tuple(sum(c[i] for c in counts) for i in (0, 1))
        assert 0 < m.peak_blocks < m.peak_blocks_unshared
    # the prompts share no block: the searches' distinct blocks add up
    total = [(sum(c[0] for c in step), sum(c[1] for c in step)) for step in _by_step(seen)]
    m = search.last_memory
    assert (m.peak_blocks, m.peak_blocks_unshared) == tuple(max(t[i] for t in total) for i in (0, 1))
    assert (m.block_steps, m.block_steps_unshared) == tuple(sum(t[i] for t in total) for i in (0, 1))
    assert_all_freed(engine)


def _by_step(seen: dict[str, list[tuple[int, int]]]) -> list[list[tuple[int, int]]]:
    """The searches' counts step by step (every search is live from the first step: index i is step i)."""
    longest = max(map(len, seen.values()))
    return [[c[i] for c in seen.values() if i < len(c)] for i in range(longest)]
