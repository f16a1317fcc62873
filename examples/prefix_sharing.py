"""Block manager on a simulated chat workload: prefix sharing, copy-on-write, eviction.

Many requests share a long system prompt; each is allocated, decoded a few
tokens (some fork parallel samples), and freed, through a pool too small to
hold them all at once. Prints the pool's figures. Runs in about a second.
"""

from __future__ import annotations

import random
import time

from paged_kv import BlockManager, BlockManagerConfig

BLOCK_SIZE = 16
SYSTEM_PROMPT = list(range(1000, 1000 + 384))  # 24 shared blocks


def make_prompt(rng: random.Random) -> list[int]:
    """A chat prompt: the shared system prompt (most of the time) plus a user turn."""
    user = [rng.randrange(32_000) for _ in range(rng.randrange(20, 200))]
    return (SYSTEM_PROMPT if rng.random() < 0.8 else []) + user


def run(num_requests: int = 2000, seed: int = 0) -> None:
    """Drive the manager through a simulated serving loop and print what it held."""
    rng = random.Random(seed)
    bm = BlockManager(BlockManagerConfig(num_blocks=2048, block_size=BLOCK_SIZE, num_cpu_blocks=512))
    live: list[str] = []
    peak_used = copies = rejected = 0
    start = time.perf_counter()
    for i in range(num_requests):
        prompt, seq = make_prompt(rng), f"req{i}"
        while not bm.can_allocate(prompt) and live:
            bm.free(live.pop(0))  # oldest request finishes
        if not bm.can_allocate(prompt):
            rejected += 1
            continue
        bm.allocate(seq, prompt)
        live.append(seq)
        if rng.random() < 0.3:  # parallel sampling: a second sample shares every block
            bm.fork(seq, seq + "/1")
            live.append(seq + "/1")
        for s in live[-2:]:
            for _ in range(rng.randrange(1, 24)):
                if bm.can_append(s):
                    copies += len(bm.append(s, [rng.randrange(32_000)]))
        peak_used = max(peak_used, bm.gpu.num_used)
    elapsed = time.perf_counter() - start
    bm.check()
    stats = bm.stats()
    print(f"requests            {num_requests} ({rejected} rejected) in {elapsed:.2f} s "
          f"({num_requests / elapsed:,.0f} req/s)")
    print(f"prefix-cache hits   {stats.hit_rate:.1%} of prompt tokens")
    print(f"copy-on-write       {copies} block copies (forked samples diverging)")
    print(f"peak blocks in use  {peak_used} / {stats.num_blocks}; evictions {stats.num_evictions}")
    print(f"now                 {stats.num_used} used, {stats.num_evictable} cached-evictable, "
          f"fragmentation {stats.fragmentation:.1%}")
    for s in live:
        bm.free(s)
    bm.check()
    assert bm.gpu.num_free == bm.gpu.num_blocks, "every block is free or cached once all requests end"


if __name__ == "__main__":
    run()
