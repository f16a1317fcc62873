"""What rejecting bools costs: token-id validation and a full allocate + free cycle, before vs after.

The baseline is the token check before bools were rejected (a plain ``struct.pack`` of the ids, which
takes ``True`` as 1), run side by side in the same process: ``BlockManager.allocate`` is timed with
each check patched in, on the shared-prefix workload of ``bench_block_manager.py``.

Run: ``PYTHONPATH=. python benchmarks/bench_token_checks.py``
"""

from __future__ import annotations

import struct
import timeit
from array import array

from bench_block_manager import NUM_PROMPTS, PROMPT_LEN, new_manager, ours_cycle, shared_prefix_workload

import paged_kv.block_manager as bm_module
from paged_kv import tokens
from paged_kv.tokens import as_token_array

REPEATS = 9


def _bool_blind(name: str, token_ids):
    """The check before this change: list/tuple ids packed as int64, no look for bools."""
    if type(token_ids) is list or type(token_ids) is tuple:
        try:
            data = struct.pack(f"{len(token_ids)}q", *token_ids)
        except (struct.error, TypeError, OverflowError):
            data = None
        if data is not None and data[tokens._SIGN_BYTE :: 8].isascii():
            ids = array("q")
            ids.frombytes(data)
            return ids
    return as_token_array(name, token_ids)


def _best_alternating(fns: dict[str, object]) -> dict[str, float]:
    """Best of REPEATS runs of each fn, the fns run in turn (a loaded machine drifts alike for both)."""
    best = {name: float("inf") for name in fns}
    for _ in range(REPEATS):
        for name, fn in fns.items():
            best[name] = min(best[name], timeit.timeit(fn, number=1))
    return best


def _cycle_with(check) -> float:
    """One allocate + free cycle over the workload with ``check`` as the manager's token check."""
    bm_module.as_token_array = check
    try:
        return ours_cycle(new_manager(), PROMPTS)
    finally:
        bm_module.as_token_array = as_token_array


PROMPTS = shared_prefix_workload().prompts
CHECKS = {"before": _bool_blind, "after": as_token_array}


def main() -> None:
    check = _best_alternating({k: (lambda f=f: [f("token_ids", p) for p in PROMPTS]) for k, f in CHECKS.items()})
    cycle = _best_alternating({k: (lambda f=f: _cycle_with(f)) for k, f in CHECKS.items()})
    n = NUM_PROMPTS
    print(f"{n} prompts of {PROMPT_LEN} ids, best of {REPEATS}")
    for label, t in (("token check", check), ("allocate+free cycle", cycle)):
        print(f"{label:20s} before {t['before'] / n * 1e6:7.2f} us/prompt   after {t['after'] / n * 1e6:7.2f} us/prompt"
              f"   after/before {t['after'] / t['before']:.3f}")


if __name__ == "__main__":
    main()
