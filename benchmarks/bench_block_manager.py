"""Block manager throughput, side by side with vLLM v1's block pool in the same run.

Workload: a pool of 4096 blocks of 16 tokens; 2000 prompts of 512 tokens run
one after another, each through a full request cycle: hash its blocks, look up
the longest cached prefix, allocate, register its full blocks in the prefix
cache, free. Variants: a shared 256-token prefix (the rest random, seeded),
no sharing (every prompt unique) and full reuse (one prompt repeated). Plus a
raw allocate + free of 32 anonymous blocks (no hashing).

The vLLM column runs vLLM's own ``BlockPool`` / ``kv_cache_utils`` code, copied
into third_party/vllm_blockpool/ by benchmarks/setup_vllm_baseline.sh (never
committed), with SHA-256 block hashes as ``--prefix-caching-hash-algo sha256``
selects. It is skipped, with a message, when that folder is missing.

Decode append (ours only): 256 sequences holding 100-1023 tokens each take 64
decode steps of one token each, through a per-sequence loop of ``append`` and
through one ``append_all`` per step, side by side; the time per sequence and
their ratio are printed (``--only decode`` runs just this case).

    .venv/bin/python -m pytest benchmarks/bench_block_manager.py --benchmark-only \
        --benchmark-timer=time.process_time
    .venv/bin/python benchmarks/bench_block_manager.py [--repeat 7] [--clock cpu|wall] [--only cycle|decode]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VLLM_DIR = ROOT / "third_party" / "vllm_blockpool"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pytest  # noqa: E402

from paged_kv import BlockManager, BlockManagerConfig  # noqa: E402
from paged_kv.block_pool import BlockPool  # noqa: E402

NUM_BLOCKS = 4096
BLOCK_SIZE = 16
NUM_PROMPTS = 2000
PROMPT_LEN = 512
PREFIX_LEN = 256
RAW_BLOCKS = 32
RAW_CYCLES = 20_000
VOCAB = 32_000
SEED = 0
BLOCKS_PER_PROMPT = PROMPT_LEN // BLOCK_SIZE
DECODE_BATCH = 256
DECODE_STEPS = 64


# -- workloads ----------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Workload:
    """Prompts run one after another from a cold cache, and the prefix hits they must find."""

    name: str
    prompts: list[list[int]]
    expected_hit_blocks: int


def _random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def shared_prefix_workload() -> Workload:
    """Every prompt starts with the same 256 tokens; the other 256 are random."""
    rng = random.Random(SEED)
    prefix = _random_tokens(rng, PREFIX_LEN)
    prompts = [prefix + _random_tokens(rng, PROMPT_LEN - PREFIX_LEN) for _ in range(NUM_PROMPTS)]
    return Workload(name="shared-prefix", prompts=prompts,
                    expected_hit_blocks=(NUM_PROMPTS - 1) * (PREFIX_LEN // BLOCK_SIZE))


def unique_workload() -> Workload:
    """No sharing: every prompt is random from its first token."""
    rng = random.Random(SEED + 1)
    prompts = [_random_tokens(rng, PROMPT_LEN) for _ in range(NUM_PROMPTS)]
    return Workload(name="no-sharing", prompts=prompts, expected_hit_blocks=0)


def full_reuse_workload() -> Workload:
    """One prompt repeated: every block but the last (never a hit) is reused."""
    prompt = _random_tokens(random.Random(SEED + 2), PROMPT_LEN)
    return Workload(name="full-reuse", prompts=[prompt] * NUM_PROMPTS,
                    expected_hit_blocks=(NUM_PROMPTS - 1) * (BLOCKS_PER_PROMPT - 1))


WORKLOADS: dict[str, Callable[[], Workload]] = {
    "shared-prefix": shared_prefix_workload,
    "no-sharing": unique_workload,
    "full-reuse": full_reuse_workload,
}


# -- our side -------------------------------------------------------------------
def new_manager() -> BlockManager:
    """A manager over the benchmark's pool, prefix caching on, no watermark."""
    return BlockManager(BlockManagerConfig(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, watermark=0.0))


def ours_cycle(bm: BlockManager, prompts: list[list[int]]) -> int:
    """Per prompt: allocate (hash, lookup, allocate, register) then free; return hit blocks."""
    hit_tokens = 0
    for seq_id, tokens in enumerate(prompts):
        hit_tokens += bm.allocate(seq_id, tokens)
        bm.free(seq_id)
    return hit_tokens // BLOCK_SIZE


def ours_raw(bm: BlockManager, cycles: int) -> int:
    """Allocate and free ``cycles`` sequences of RAW_BLOCKS anonymous blocks; return blocks handled."""
    num_tokens = RAW_BLOCKS * BLOCK_SIZE
    for seq_id in range(cycles):
        bm.allocate(seq_id, num_tokens)
        bm.free(seq_id)
    return cycles * RAW_BLOCKS


def ours_pool_raw(pool: BlockPool, cycles: int) -> int:
    """The same on the bare block pool (take + release), below the manager's API."""
    for _ in range(cycles):
        pool.release(reversed(pool.take(RAW_BLOCKS)))
    return cycles * RAW_BLOCKS


def decode_setup() -> tuple[BlockManager, list[list[int]]]:
    """DECODE_BATCH sequences of 100-1023 tokens (seeded) and DECODE_STEPS steps of one sampled id each."""
    rng = random.Random(SEED + 3)
    bm = BlockManager(BlockManagerConfig(
        num_blocks=DECODE_BATCH * (1024 + DECODE_STEPS) // BLOCK_SIZE + DECODE_BATCH, block_size=BLOCK_SIZE,
        watermark=0.0,
    ))  # fmt: skip
    for seq_id in range(DECODE_BATCH):
        bm.allocate(seq_id, _random_tokens(rng, rng.randrange(100, 1024)))
    return bm, [_random_tokens(rng, DECODE_BATCH) for _ in range(DECODE_STEPS)]


def decode_loop(bm: BlockManager, steps: list[list[int]]) -> int:
    """Each step: ``append`` one token to each sequence in turn; return the tokens held in the end."""
    for step in steps:
        for seq_id, token in enumerate(step):
            bm.append(seq_id, [token])
    return sum(map(bm.num_tokens, range(DECODE_BATCH)))


def decode_batched(bm: BlockManager, steps: list[list[int]]) -> int:
    """Each step: one ``append_all`` of a token for every sequence; return the tokens held in the end."""
    for step in steps:
        bm.append_all([(seq_id, [token]) for seq_id, token in enumerate(step)])
    return sum(map(bm.num_tokens, range(DECODE_BATCH)))


def decode_expected() -> int:
    """Tokens held after the decode steps."""
    bm, _ = decode_setup()
    return sum(map(bm.num_tokens, range(DECODE_BATCH))) + DECODE_BATCH * DECODE_STEPS


# -- vLLM side ------------------------------------------------------------------
class _VllmRequest:
    """The attributes of vllm.v1.request.Request that the block hasher and pool read."""

    __slots__ = ("request_id", "all_token_ids", "num_tokens", "block_hashes", "mm_features",
                 "lora_request", "cache_salt", "prompt_embeds", "session_id")

    def __init__(self, request_id: str, token_ids: list[int]) -> None:
        self.request_id = request_id
        self.all_token_ids = token_ids
        self.num_tokens = len(token_ids)
        self.block_hashes: list[bytes] = []
        self.mm_features: list = []
        self.lora_request = self.cache_salt = self.prompt_embeds = self.session_id = None


class VllmBaseline:
    """vLLM v1's BlockPool driven per request the way its scheduler does, one full-attention group."""

    def __init__(self) -> None:
        for path in (VLLM_DIR / "vllm_shims", VLLM_DIR):
            if path.is_dir() and str(path) not in sys.path:
                sys.path.insert(0, str(path))
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core import block_pool, kv_cache_utils

        hash_fn = get_hash_fn_by_name("sha256")  # --prefix-caching-hash-algo sha256 (the default)
        kv_cache_utils.init_none_hash(hash_fn)
        self._utils = kv_cache_utils
        self._pool_cls = block_pool.BlockPool
        self._hasher = kv_cache_utils.get_request_block_hasher(BLOCK_SIZE, hash_fn)
        self.version = (VLLM_DIR / "VERSION").read_text().strip()

    def new_pool(self, num_blocks: int = NUM_BLOCKS):
        """A caching pool with ``num_blocks`` usable blocks (+1: vLLM reserves block 0 as its null block)."""
        return self._pool_cls(num_blocks + 1, enable_caching=True, hash_block_size=BLOCK_SIZE)

    def cycle(self, pool, prompts: list[list[int]]) -> int:
        """Per prompt: hash (at request creation), find the cache hit, allocate, cache, free."""
        hit_blocks = 0
        for i, tokens in enumerate(prompts):
            req = _VllmRequest(str(i), tokens)
            req.block_hashes.extend(self._hasher(req))  # Request.update_block_hashes()
            hits = self._longest_cache_hit(pool, req.block_hashes, req.num_tokens - 1)
            blocks = self._allocate_slots(pool, req, hits)
            pool.free_blocks(reversed(blocks))  # SingleTypeKVCacheManager.free: tail first
            hit_blocks += len(hits)
        return hit_blocks

    def _longest_cache_hit(self, pool, block_hashes: list[bytes], max_length: int) -> list:
        """FullAttentionManager.find_longest_cache_hit, phase 1 (no EAGLE, no DCP)."""
        block_hashes = self._utils.resolve_block_hashes(block_hashes, pool.hash_block_size, BLOCK_SIZE)
        hits, group_ids = [], [0]
        for block_hash in islice(block_hashes, max_length // BLOCK_SIZE):
            cached = pool.get_cached_block(block_hash, group_ids)
            if not cached:
                break
            hits.append(cached[0])
        return hits

    def _allocate_slots(self, pool, req: _VllmRequest, hits: list) -> list:
        """KVCacheManager.allocate_slots for a whole prompt: check, touch hits, take new, cache full."""
        num_new = -(-req.num_tokens // BLOCK_SIZE) - len(hits)
        num_revived = sum(1 for b in hits if b.ref_cnt == 0)
        if num_new + num_revived > pool.get_num_free_blocks():
            raise MemoryError("vLLM pool out of blocks")
        pool.touch(hits)
        blocks = hits + pool.get_new_blocks(num_new)
        pool.cache_full_blocks(req, blocks, len(hits), req.num_tokens // BLOCK_SIZE, BLOCK_SIZE, 0)
        return blocks

    def raw(self, pool, cycles: int) -> int:
        """get_new_blocks + free_blocks of RAW_BLOCKS unhashed blocks, ``cycles`` times."""
        for _ in range(cycles):
            pool.free_blocks(reversed(pool.get_new_blocks(RAW_BLOCKS)))
        return cycles * RAW_BLOCKS


def load_vllm() -> tuple[VllmBaseline | None, str]:
    """The vLLM baseline, or None and why it is unavailable."""
    if not (VLLM_DIR / "vllm" / "v1" / "core" / "block_pool.py").is_file():
        return None, (f"vLLM baseline not set up ({VLLM_DIR} missing): run "
                      "VLLM_SRC=/path/to/vllm bash benchmarks/setup_vllm_baseline.sh")
    try:
        return VllmBaseline(), ""
    except Exception as exc:  # an incompatible vLLM version must not break our column
        return None, f"vLLM baseline failed to load: {type(exc).__name__}: {exc}"


# -- pytest-benchmark -------------------------------------------------------------
@pytest.fixture(scope="module", params=list(WORKLOADS))
def workload(request) -> Workload:
    """Each workload, built once per module."""
    return WORKLOADS[request.param]()


@pytest.fixture(scope="module")
def vllm() -> VllmBaseline:
    """The vLLM baseline; its benchmarks skip, with the reason, when it is not set up."""
    baseline, why = load_vllm()
    if baseline is None:
        pytest.skip(why)
    return baseline


@pytest.mark.benchmark(group="request-cycle")
def test_cycle_ours(benchmark, workload: Workload) -> None:
    """Our request cycle over the workload; it must find exactly the expected prefix hits."""
    benchmark.group = f"request-cycle {workload.name}"
    benchmark.extra_info["sequences"] = len(workload.prompts)
    hits = benchmark.pedantic(ours_cycle, setup=lambda: ((new_manager(), workload.prompts), {}), rounds=3)
    assert hits == workload.expected_hit_blocks


@pytest.mark.benchmark(group="request-cycle")
def test_cycle_vllm(benchmark, workload: Workload, vllm: VllmBaseline) -> None:
    """vLLM's request cycle over the same workload, with the same expected hits."""
    benchmark.group = f"request-cycle {workload.name}"
    benchmark.extra_info["sequences"] = len(workload.prompts)
    hits = benchmark.pedantic(vllm.cycle, setup=lambda: ((vllm.new_pool(), workload.prompts), {}), rounds=3)
    assert hits == workload.expected_hit_blocks


@pytest.mark.benchmark(group="raw alloc+free 32 blocks")
def test_raw_ours_manager(benchmark) -> None:
    """BlockManager.allocate + free of 32 anonymous blocks; every block comes back."""
    bm = new_manager()
    assert benchmark.pedantic(ours_raw, args=(bm, RAW_CYCLES), rounds=3) == RAW_CYCLES * RAW_BLOCKS
    assert bm.gpu.num_free == NUM_BLOCKS and not bm.seq_ids()


@pytest.mark.benchmark(group="raw alloc+free 32 blocks")
def test_raw_ours_pool(benchmark) -> None:
    """BlockPool.take + release of 32 blocks; every block comes back."""
    pool = BlockPool(NUM_BLOCKS)
    assert benchmark.pedantic(ours_pool_raw, args=(pool, RAW_CYCLES), rounds=3) == RAW_CYCLES * RAW_BLOCKS
    assert pool.num_free == NUM_BLOCKS


@pytest.mark.benchmark(group="raw alloc+free 32 blocks")
def test_raw_vllm(benchmark, vllm: VllmBaseline) -> None:
    """vLLM BlockPool.get_new_blocks + free_blocks of 32 blocks; every block comes back."""
    pool = vllm.new_pool()
    assert benchmark.pedantic(vllm.raw, args=(pool, RAW_CYCLES), rounds=3) == RAW_CYCLES * RAW_BLOCKS
    assert pool.get_num_free_blocks() == NUM_BLOCKS


@pytest.mark.benchmark(group=f"decode append, batch {DECODE_BATCH}")
@pytest.mark.parametrize("run", [decode_loop, decode_batched], ids=["loop-of-append", "append_all"])
def test_decode_append(benchmark, run) -> None:
    """DECODE_STEPS decode steps at batch DECODE_BATCH; both ways end with the same tokens held."""
    benchmark.extra_info["appends"] = DECODE_BATCH * DECODE_STEPS
    assert benchmark.pedantic(run, setup=lambda: (decode_setup(), {}), rounds=3) == decode_expected()


# -- script: a side-by-side table ---------------------------------------------------
CLOCKS: dict[str, Callable[[], float]] = {"cpu": time.process_time, "wall": time.perf_counter}
TARGET_CYCLE_RATIO = 2.0
TARGET_RAW_BLOCKS_PER_S = 2e6
TARGET_APPEND_ALL_US = 2.0


@dataclass(kw_only=True)
class Case:
    """One measurement: a run, the fresh arguments of each round, the result it must return."""

    run: Callable[..., int]
    make_args: Callable[[], tuple]
    expected: int
    best: float = float("inf")

    def time_once(self, clock: Callable[[], float]) -> None:
        """Run once on fresh state; keep the fastest time; check the result."""
        args = self.make_args()
        start = clock()
        result = self.run(*args)
        self.best = min(self.best, clock() - start)
        assert result == self.expected, (self.run, result, self.expected)


def race(cases: list[Case], repeat: int, clock: Callable[[], float]) -> None:
    """Time the cases in turn, ``repeat`` rounds, so that load on the machine hits all alike."""
    for _ in range(repeat):
        for case in cases:
            case.time_once(clock)


def machine() -> str:
    """CPU model, core count and Python version of this machine."""
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{model}, {os.cpu_count()} cores, Python {platform.python_version()}"


def _row(name: str, ours: float, theirs: float | None, unit: str) -> str:
    vllm_cell = f"{theirs:>14,.0f}" if theirs else f"{'-':>14}"
    ratio = f"{ours / theirs:6.2f}x" if theirs else f"{'-':>7}"
    return f"{name:<34} {ours:>14,.0f} {vllm_cell} {ratio}   {unit}"


def cycle_rows(vllm: VllmBaseline | None, repeat: int, clock: Callable[[], float]) -> tuple[list[str], list[float]]:
    """Table rows of the request-cycle workloads, and our speed-up over vLLM on each."""
    rows, ratios = [], []
    for make in WORKLOADS.values():
        w = make()
        ours = Case(run=ours_cycle, make_args=lambda w=w: (new_manager(), w.prompts), expected=w.expected_hit_blocks)
        theirs = vllm and Case(run=vllm.cycle, make_args=lambda w=w: (vllm.new_pool(), w.prompts),
                               expected=w.expected_hit_blocks)
        race([c for c in (ours, theirs) if c], repeat, clock)
        n, t_vllm = len(w.prompts), theirs.best if theirs else None
        rows.append(_row(f"{w.name} cycle", n / ours.best, t_vllm and n / t_vllm, "sequences/s"))
        rows.append(_row(f"{w.name} cycle", n * BLOCKS_PER_PROMPT / ours.best,
                         t_vllm and n * BLOCKS_PER_PROMPT / t_vllm, "blocks/s"))
        if t_vllm:
            ratios.append(t_vllm / ours.best)
    return rows, ratios


def raw_rows(vllm: VllmBaseline | None, repeat: int, clock: Callable[[], float]) -> tuple[list[str], float]:
    """Table rows of raw allocate + free of 32 blocks, and the manager's blocks/s."""
    n = RAW_CYCLES * RAW_BLOCKS
    manager = Case(run=ours_raw, make_args=lambda: (new_manager(), RAW_CYCLES), expected=n)
    pool = Case(run=ours_pool_raw, make_args=lambda: (BlockPool(NUM_BLOCKS), RAW_CYCLES), expected=n)
    theirs = vllm and Case(run=vllm.raw, make_args=lambda: (vllm.new_pool(), RAW_CYCLES), expected=n)
    race([c for c in (manager, pool, theirs) if c], repeat, clock)
    t_vllm = theirs.best if theirs else None
    return [_row("raw alloc+free 32 (BlockManager)", n / manager.best, t_vllm and n / t_vllm, "blocks/s"),
            _row("raw alloc+free 32 (BlockPool)", n / pool.best, t_vllm and n / t_vllm, "blocks/s")], n / manager.best


def decode_rows(repeat: int, clock: Callable[[], float]) -> list[str]:
    """Decode append per sequence: a loop of ``append`` against ``append_all``, interleaved; the ratio."""
    expected, n = decode_expected(), DECODE_BATCH * DECODE_STEPS
    loop = Case(run=decode_loop, make_args=decode_setup, expected=expected)
    batched = Case(run=decode_batched, make_args=decode_setup, expected=expected)
    race([loop, batched], repeat, clock)
    per_loop, per_batched = loop.best / n * 1e6, batched.best / n * 1e6
    ok = per_batched <= TARGET_APPEND_ALL_US
    return [f"decode append, batch {DECODE_BATCH}, {DECODE_STEPS} steps: loop of append {per_loop:.2f} us/seq, "
            f"append_all {per_batched:.2f} us/seq, {per_loop / per_batched:.2f}x",
            f"target append_all <= {TARGET_APPEND_ALL_US:.0f} us/seq: {'met' if ok else 'MISSED'}"]


def report(repeat: int, clock_name: str, only: str | None = None) -> list[str]:
    """Run every measurement (best of ``repeat``, interleaved with vLLM) and return the table's lines."""
    clock = CLOCKS[clock_name]
    if only == "decode":
        return [f"machine: {machine()}", f"timing: {clock_name} time, best of {repeat} interleaved rounds",
                *decode_rows(repeat, clock)]
    vllm, why = load_vllm()
    lines = [f"machine: {machine()}", f"vLLM baseline: {vllm.version if vllm else why}",
             f"timing: {clock_name} time, best of {repeat} interleaved rounds",
             f"{'measurement':<34} {'paged-kv':>14} {'vLLM v1':>14} {'ratio':>7}   unit"]
    rows, ratios = cycle_rows(vllm, repeat, clock)
    raw, raw_rate = raw_rows(vllm, repeat, clock)
    lines += rows + raw
    if ratios:
        ok = min(ratios) >= TARGET_CYCLE_RATIO
        lines.append(f"target request cycle >= {TARGET_CYCLE_RATIO:.0f}x vLLM: {'met' if ok else 'MISSED'} "
                     f"(lowest {min(ratios):.2f}x)")
    ok = raw_rate >= TARGET_RAW_BLOCKS_PER_S
    lines.append(f"target raw >= {TARGET_RAW_BLOCKS_PER_S / 1e6:.0f}M blocks/s: {'met' if ok else 'MISSED'}")
    return lines if only == "cycle" else lines + decode_rows(repeat, clock)


def main() -> None:
    """Print the side-by-side table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7, help="timed rounds per measurement; the best is kept")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="cpu",
                        help="cpu: process CPU time (robust on a shared machine; the work is single-threaded)")
    parser.add_argument("--only", choices=["cycle", "decode"], help="run one part (default: all)")
    args = parser.parse_args()
    print("\n".join(report(args.repeat, args.clock, args.only)))


if __name__ == "__main__":
    main()
