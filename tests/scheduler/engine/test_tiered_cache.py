"""The engine with the prefix cache's host tier: same outputs as without, more cached tokens, KV events, pins."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import msgspec
import pytest
import torch
import zmq
from sched_helpers import tiny_llama
from vllm_kv_consumer import KVEventBatch, subscribe

from paged_kv.errors import InvalidArgumentError
from scheduler import CacheConfig, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
from scheduler.core.kv_events_config import KVEventsConfig
from scheduler.engine.kv_event_publisher import ZmqEventPublisher
from scheduler.engine.tiered_cache import model_identity
from scheduler.model.llama import ModelConfig

BS = 4


@pytest.fixture(scope="module")
def hf_model():
    return tiny_llama()


def engine(hf_model, *, offload: int = 0, store: str = "evict", blocks: int = 20, preemption: str = "recompute",
           kv_events: KVEventsConfig | None = None, max_seqs: int = 4) -> LLMEngine:  # fmt: skip
    cache = CacheConfig(block_size=BS, num_gpu_blocks=blocks, watermark=0.0, kv_offloading_bytes=offload,
                        host_store=store, num_cpu_blocks=16 if preemption == "swap" else 0)  # fmt: skip
    sched = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=max_seqs, preemption_mode=preemption)
    return LLMEngine.from_hf(hf_model, EngineConfig(cache=cache, scheduler=sched, device="cpu", kv_events=kv_events))


def multi_round_chat(eng: LLMEngine, users: int = 4, rounds: int = 3, together: bool = False) -> list[tuple]:
    """Users x rounds of a chat: each round appends a question and the answer to the user's history.

    ``together``: each round's users run as one batch (so they compete for blocks and preempt).
    """
    rng = random.Random(0)
    history = {u: list(range(10, 30)) for u in range(users)}  # a shared 20-token system prompt
    params = SamplingParams(max_tokens=5, temperature=0.0)
    results = []
    for _ in range(rounds):
        for u in range(users):
            history[u] += [rng.randrange(3, 256) for _ in range(6)]
        batches = [list(range(users))] if together else [[u] for u in range(users)]
        for batch in batches:
            outs = eng.generate([history[u] for u in batch], params, use_tqdm=False)
            for u, out in zip(batch, outs):
                history[u] += out.outputs[0].token_ids
                results.append((tuple(out.outputs[0].token_ids), out.num_cached_tokens))
    eng.block_manager.check()
    return results


@pytest.mark.parametrize("store", ["evict", "write"])
def test_the_host_tier_serves_evicted_prefixes_and_changes_no_output(hf_model, store):
    base = multi_round_chat(engine(hf_model))
    eng = engine(hf_model, offload=1 << 20, store=store)
    tiered = multi_round_chat(eng)
    assert [t for t, _ in tiered] == [t for t, _ in base]  # greedy: token for token
    assert sum(c for _, c in tiered) > sum(c for _, c in base)  # the host tier served what the device evicted
    stats = eng.block_manager.stats()
    assert stats.num_host_hit_tokens > 0 and stats.num_host_stored_blocks > 0
    assert eng.tiers.stats().bytes_loaded == stats.num_host_hit_tokens // BS * eng.tiers.host_cache.spec.bytes_per_block


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_outputs_are_the_same_with_tiers_under_preemption(hf_model, preemption):
    base = multi_round_chat(engine(hf_model, blocks=14, preemption=preemption), together=True)
    eng = engine(hf_model, blocks=14, preemption=preemption, offload=1 << 20)
    tiered = multi_round_chat(eng, together=True)
    assert sum(eng.scheduler.num_preemptions.values()) > 0
    assert [t for t, _ in tiered] == [t for t, _ in base]


def test_a_failed_step_forgets_every_cached_block_of_every_tier(hf_model, monkeypatch):
    eng = engine(hf_model, offload=1 << 20, store="write")
    multi_round_chat(eng, rounds=1)
    assert eng.block_manager.stats().num_host_cached > 0
    eng.add_request("r", list(range(40, 60)), SamplingParams(max_tokens=2))
    monkeypatch.setattr(eng.runner, "execute", lambda step: (_ for _ in ()).throw(RuntimeError("device lost")))
    with pytest.raises(RuntimeError, match="device lost"):
        eng.step()
    stats = eng.block_manager.stats()
    assert (stats.num_cached, stats.num_host_cached, stats.num_used) == (0, 0, 0)


def test_a_pinned_system_prompt_is_never_evicted(hf_model):
    eng = engine(hf_model, blocks=12)
    system = list(range(100, 120))  # 5 full blocks
    pin = eng.pin_prefix(system)
    assert eng.pins.is_waiting(pin)
    assert eng.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)[0].request_id != pin
    while eng.has_unfinished_requests():
        assert all(o.request_id != pin for o in eng.step())  # the warm-up's output is not returned
    assert eng.pins.held == {pin: 20}
    for i in range(4):  # prompts that need every block the pin leaves
        eng.generate([list(range(130 + 30 * i, 150 + 30 * i))], SamplingParams(max_tokens=2), use_tqdm=False)
    out = eng.generate([system + [7]], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert out.num_cached_tokens == 20
    eng.unpin(pin)
    for i in range(2):
        eng.generate([list(range(130 + 30 * i, 168 + 30 * i))], SamplingParams(max_tokens=2), use_tqdm=False)
    assert eng.block_manager.num_cached_tokens(system + [7]) < 20  # evictable again
    eng.block_manager.check()


def test_a_request_too_long_for_the_blocks_pins_leave_is_refused_not_stalled(hf_model):
    eng = engine(hf_model, blocks=12)
    pin = eng.pin_prefix(list(range(100, 132)))  # 8 full blocks held: 4 left
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.block_manager.num_pinned_blocks == 8
    with pytest.raises(InvalidArgumentError, match=r"max_tokens.*8 held by pinned prefixes"):
        eng.add_request("long", list(range(1, 15)), SamplingParams(max_tokens=4))  # 18 tokens: 5 blocks
    assert not eng.has_unfinished_requests()
    eng.generate([list(range(1, 13))], SamplingParams(max_tokens=4), use_tqdm=False)  # 16 tokens: 4 blocks, fits
    (out,) = eng.generate([list(range(100, 132)) + list(range(1, 12))], SamplingParams(max_tokens=4),
                          use_tqdm=False)  # 47 tokens, 12 blocks: the 8 pinned ones are its own  # fmt: skip
    assert out.num_cached_tokens == 32 and out.outputs[0].finish_reason == "length"
    eng.unpin(pin)
    assert eng.block_manager.num_pinned_blocks == 0
    eng.add_request("long", list(range(1, 15)), SamplingParams(max_tokens=4))
    assert len(eng.generate([[1, 2, 3]], SamplingParams(max_tokens=1), use_tqdm=False)) == 1


def test_a_queued_request_a_later_pin_leaves_no_room_for_fails_alone(hf_model):
    """Admitted against the whole pool, then a pin took 5 of its 12 blocks: it can never start. It fails alone
    with the reason (the step raised "scheduler stalled" and aborted every request)."""
    eng = engine(hf_model, blocks=12)
    system = list(range(10, 30))  # 5 full blocks
    eng.generate([system], SamplingParams(max_tokens=1), use_tqdm=False)  # cached: the pin holds at once
    greedy = SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.0)
    eng.add_request("big", list(range(100, 130)), greedy)  # 40 tokens by its end: 10 blocks
    eng.add_request("small", [1, 2, 3], greedy)
    eng.pin_prefix(system)
    outs = {}
    while eng.has_unfinished_requests():
        outs |= {o.request_id: o for o in eng.step()}
    big, small = outs["big"], outs["small"]
    assert big.outputs[0].finish_reason == "error" and "'big' can never be scheduled" in big.error
    assert "less the 5 held by pinned prefixes" in big.error
    assert small.error is None and len(small.outputs[0].token_ids) == 10
    assert eng.block_manager.num_pinned_blocks == 5
    eng.block_manager.check()


def test_kv_events_rebuild_each_tiers_cached_blocks_exactly(hf_model):
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:*", event_encoding="map")
    eng = engine(hf_model, offload=1 << 20, store="write", kv_events=config)
    ctx = zmq.Context()
    try:
        sub = subscribed(ctx, eng)
        multi_round_chat(eng)
        eng.block_manager.reset_prefix_cache()
        multi_round_chat(eng, rounds=1)
        expected = {"GPU": {h for _, h, _, _ in eng.block_manager.gpu.cached_blocks()},
                    "CPU": {h for _, h, _, _ in eng.block_manager.host.pool.cached_blocks()}}  # fmt: skip
        publisher = eng.cache_events.publisher
        eng.shutdown()  # publishes the last batch, then closes
        assert rebuilt(sub, publisher) == expected and expected["GPU"] and expected["CPU"]
    finally:
        ctx.destroy(linger=0)


def subscribed(ctx: zmq.Context, eng: LLMEngine) -> zmq.Socket:
    """A subscriber to the engine's KV events, its subscription landed."""
    sub = subscribe(ctx, eng.cache_events.publisher.endpoint)
    deadline = time.monotonic() + 10
    while not sub.poll(50):  # the slow joiner: probe until the subscription lands
        assert time.monotonic() < deadline, "the subscription never landed"
        eng.cache_events.publisher.publish(msgspec.structs.replace(_probe()))
    return sub


def rebuilt(sub: zmq.Socket, publisher: ZmqEventPublisher) -> dict[str, set[bytes]]:
    """Each medium's cached block hashes as a router rebuilds them from every batch ``publisher`` (shut down: it
    numbers no more) sent, up to its last one (checks none was lost)."""
    last, seqs, decoder = publisher.published - 1, [], msgspec.msgpack.Decoder(KVEventBatch)
    assert publisher.dropped == 0
    cached = {"GPU": set(), "CPU": set()}
    while seqs[-1:] != [last]:
        assert sub.poll(10_000), f"the batches after {seqs[-1:]} up to {last} never came"
        _, seq, payload = sub.recv_multipart()
        seqs.append(int.from_bytes(seq, "big"))
        for event in decoder.decode(payload).events:
            kind = type(event).__name__
            if kind == "BlockStored":
                cached.setdefault(event.medium, set()).update(event.block_hashes)
            elif kind == "BlockRemoved":
                cached[event.medium] -= set(event.block_hashes)
            else:
                cached = {m: set() for m in cached}
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # no batch lost
    return cached


def _probe():
    from scheduler.engine.kv_events import AllBlocksCleared
    from scheduler.engine.kv_events import KVEventBatch as OurBatch

    return OurBatch(ts=time.time(), events=[AllBlocksCleared()])


# -- the disk tier ---------------------------------------------------------------------------------
def disk_engine(hf_model, directory, *, host_blocks: int = 1024, blocks: int = 20,
                kv_events: KVEventsConfig | None = None, store: str = "evict", rescan: float | None = None
                ) -> LLMEngine:  # fmt: skip
    """An engine with a host tier of ``host_blocks`` and a disk tier in ``directory`` (rescanned every ``rescan`` s)."""
    probe = engine(hf_model, blocks=blocks)
    per_block = probe.runner.gpu_cache.spec.bytes_per_block
    cache = CacheConfig(block_size=BS, num_gpu_blocks=blocks, watermark=0.0, host_store=store,
                        kv_offloading_bytes=host_blocks * per_block, kv_disk_dir=str(directory), kv_disk_bytes=1 << 30,
                        kv_disk_blocks_per_file=4, kv_disk_refresh_interval_s=rescan)  # fmt: skip
    sched = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4)
    return LLMEngine.from_hf(hf_model, EngineConfig(cache=cache, scheduler=sched, device="cpu", kv_events=kv_events))


def returning_users(eng: LLMEngine, histories: list[list[int]], salt: str | None = None) -> list[tuple]:
    """Each user's history plus a new question, at once: (answer, cached tokens) per user."""
    prompts = [h + [7, 8, 9, 10, 11] for h in histories]
    outs = eng.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, cache_salt=salt), use_tqdm=False)
    return [(tuple(o.outputs[0].token_ids), o.num_cached_tokens) for o in outs]


HISTORIES = [list(range(10, 30)) + [50 + u] * 17 for u in range(3)]  # 37 tokens each: a shared 20-token start


def test_a_small_host_tier_spills_to_disk_and_reads_it_back_with_the_same_outputs(hf_model, tmp_path):
    base = multi_round_chat(engine(hf_model))
    eng = disk_engine(hf_model, tmp_path, host_blocks=3)
    tiered = multi_round_chat(eng)
    assert [t for t, _ in tiered] == [t for t, _ in base]
    stats = eng.block_manager.stats()
    assert stats.num_lower_hit_tokens > 0  # blocks that left the 3-block host tier came back from disk
    eng.shutdown()


@pytest.mark.parametrize("host_blocks", [8, 4])
def test_a_disk_read_extends_the_host_hits_it_continues_as_far_as_the_host_tier_has_room(hf_model, tmp_path,
                                                                                         host_blocks):
    """A returning prompt whose leading blocks are on the host and the rest only on disk: the fill from disk
    must not evict those host blocks to make room (it did: nothing was hit), and a read longer than the
    host tier's room fills what fits (it wrote the whole read into fewer blocks: the step failed)."""
    eng, greedy = disk_engine(hf_model, tmp_path, host_blocks=host_blocks, blocks=24), SamplingParams(max_tokens=2)
    prompt = lambda first: [first] + list(range(3, 42))  # noqa: E731 (40 tokens: 9 blocks a hit may cover)
    for first in (220, 221, 222, 223):  # each evicts the one before it from the 24-block device pool
        eng.generate([prompt(first)], greedy, use_tqdm=False)
    eng.tiers.disk.flush()
    (out,) = eng.generate([prompt(220)], greedy, use_tqdm=False)
    tiers = eng.tiers.stats()
    assert tiers.host_hit_tokens > 0 and tiers.disk_hit_tokens > 0
    assert out.num_cached_tokens == tiers.host_hit_tokens + tiers.disk_hit_tokens == host_blocks * BS  # all it holds
    assert out.outputs[0].token_ids == engine(hf_model).generate([prompt(220)], greedy, use_tqdm=False)[0].outputs[
        0].token_ids  # fmt: skip
    eng.block_manager.check()
    eng.shutdown()


def test_a_restarted_engine_finds_its_prefixes_on_disk(hf_model, tmp_path):
    cold = returning_users(engine(hf_model), HISTORIES)
    first = disk_engine(hf_model, tmp_path)
    returning_users(first, HISTORIES)
    first.shutdown()  # the device's cached blocks spill to disk
    again = disk_engine(hf_model, tmp_path)
    warm = returning_users(again, HISTORIES)
    assert [t for t, _ in warm] == [t for t, _ in cold]
    assert all(c >= 36 for _, c in warm)  # the whole history but its last partial block... from disk
    assert again.block_manager.stats().num_lower_hit_tokens >= 36  # (the shared start: once from disk, then device)
    again.shutdown()


def next_rescan(eng: LLMEngine) -> Callable[[], None]:
    """A function that waits until a rescan of the engine's disk tier begun after its call has ended."""
    cond, store, done = threading.Condition(), eng.tiers.disk._store, [0]
    scan = store.refresh

    def counted() -> None:
        scan()
        with cond:
            done[0] += 1
            cond.notify_all()

    def wait() -> None:
        with cond:
            target = done[0] + 2  # the scan under way now, if any, may have listed the directory before the call
            assert cond.wait_for(lambda: done[0] >= target, timeout=60), "no rescan came"

    store.refresh = counted
    return wait


def test_a_running_engine_reads_the_prefixes_another_engine_writes_to_a_shared_directory(hf_model, tmp_path):
    cold = returning_users(engine(hf_model), HISTORIES)
    second = disk_engine(hf_model, tmp_path, rescan=0.02)  # started first: its start-up scan finds nothing
    rescanned = next_rescan(second)
    first = disk_engine(hf_model, tmp_path, store="write")  # every full block it computes goes to host and disk
    assert [t for t, _ in returning_users(first, HISTORIES)] == [t for t, _ in cold]
    first.tiers.disk.flush()  # on disk, while both engines run
    rescanned()
    assert second.tiers.disk.stats.num_blocks == first.tiers.disk.stats.num_blocks > 0
    warm = returning_users(second, HISTORIES)
    assert [t for t, _ in warm] == [t for t, _ in cold]
    assert all(c >= 36 for _, c in warm)  # the whole history but its last partial block...
    assert second.block_manager.stats().num_lower_hit_tokens >= 36  # ...read from the other engine's files
    assert second.tiers.stats().disk_bytes_read > 0 and second.tiers.stats().disk_bytes_written == 0
    first.shutdown()
    second.shutdown()


def test_kv_events_announce_the_blocks_a_rescan_finds_at_the_next_step(hf_model, tmp_path):
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:*", event_encoding="map")
    second = disk_engine(hf_model, tmp_path, kv_events=config, rescan=0.02)
    rescanned = next_rescan(second)
    ctx = zmq.Context()
    try:
        sub = subscribed(ctx, second)
        first = disk_engine(hf_model, tmp_path, store="write")
        returning_users(first, HISTORIES)
        first.tiers.disk.flush()
        rescanned()
        second.step()  # nothing to run: publishes what the rescan indexed
        on_disk = {b.hash for b in first.tiers.disk.indexed_blocks()}
        second.cache_events.shutdown()
        assert on_disk and rebuilt(sub, second.cache_events.publisher)["STORAGE"] == on_disk
        first.shutdown()
    finally:
        ctx.destroy(linger=0)
        second.shutdown()


@pytest.mark.parametrize("bad", [-5.0, float("nan"), float("inf"), "5", True])
def test_a_bad_rescan_interval_is_refused_before_any_directory_is_made(tmp_path, bad):
    target = tmp_path / "cache"
    with pytest.raises(InvalidArgumentError, match=r"^kv_disk_refresh_interval_s=.*expected .*seconds"):
        CacheConfig(kv_offloading_bytes=1 << 20, kv_disk_dir=str(target), kv_disk_bytes=1 << 30,
                    kv_disk_refresh_interval_s=bad)  # fmt: skip
    assert not target.exists()


def test_another_salt_never_reads_a_prefix_from_any_tier(hf_model, tmp_path):
    first = disk_engine(hf_model, tmp_path)
    returning_users(first, HISTORIES, salt="tenant-a")
    first.shutdown()
    again = disk_engine(hf_model, tmp_path)
    returning_users(again, HISTORIES, salt="tenant-b")  # (its users share their start among themselves)
    assert again.block_manager.stats().num_lower_hit_tokens == 0
    assert all(c >= 36 for _, c in returning_users(again, HISTORIES, salt="tenant-a"))
    assert again.block_manager.stats().num_lower_hit_tokens > 0
    again.shutdown()


def test_corrupted_or_foreign_files_are_skipped_never_loaded(hf_model, tmp_path):
    cold = returning_users(engine(hf_model), HISTORIES)
    first = disk_engine(hf_model, tmp_path)
    returning_users(first, HISTORIES)
    first.shutdown()
    other = disk_engine(tiny_llama(seed=1), tmp_path)  # same geometry, other weights: a foreign model
    returning_users(other, HISTORIES)
    assert other.block_manager.stats().num_lower_hit_tokens == 0
    other.shutdown()
    for f in tmp_path.glob("*.safetensors"):  # flip one byte near the end of every file: its K/V data
        data = bytearray(f.read_bytes())
        data[-3] ^= 0xFF
        f.write_bytes(bytes(data))
    again = disk_engine(hf_model, tmp_path)
    warm = returning_users(again, HISTORIES)
    assert [t for t, _ in warm] == [t for t, _ in cold]
    assert again.block_manager.stats().num_lower_hit_tokens == 0
    assert again.tiers.disk.stats.files_skipped > 0
    again.shutdown()


def test_a_bad_disk_directory_is_refused_at_construction(hf_model, tmp_path):
    a_file = tmp_path / "not-a-dir"
    a_file.write_text("x")
    with pytest.raises(InvalidArgumentError, match="directory"):
        disk_engine(hf_model, a_file)


def test_running_requests_keep_decoding_while_a_waiting_prompt_is_read_from_disk(hf_model, tmp_path):
    history, greedy = HISTORIES[0], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    cold = engine(hf_model).generate([history], greedy, use_tqdm=False)[0]
    first = disk_engine(hf_model, tmp_path)
    first.generate([history], greedy, use_tqdm=False)
    first.shutdown()
    eng, gate = disk_engine(hf_model, tmp_path), threading.Event()
    read = eng.tiers.disk.read
    eng.tiers.disk.read = lambda *args: gate.wait(10) and read(*args)
    eng.add_request("busy", [200, 201, 202], greedy)
    eng.step()
    eng.add_request("back", history, greedy)
    for _ in range(3):  # the read is held: "busy" decodes on, "back" waits in its place
        eng.step()
        assert [g.request_id for g in eng.scheduler.running] == ["busy"]
        assert [g.request_id for g in eng.scheduler.waiting] == ["back"]
    assert eng.scheduler.running[0].seqs[0].num_outputs == 4 and eng.tiers.stats().disk_reads_in_flight == 1
    gate.set()
    outs = {}
    while eng.has_unfinished_requests():
        outs |= {o.request_id: o for o in eng.step() if o.finished}
    assert outs["back"].outputs[0].token_ids == cold.outputs[0].token_ids
    assert outs["back"].num_cached_tokens == 36 == eng.block_manager.stats().num_lower_hit_tokens  # all from disk
    eng.shutdown()


def test_after_a_reset_kv_events_announce_the_disks_blocks_again(hf_model, tmp_path):
    """A reset's AllBlocksCleared empties every tier for a router; the disk's files outlive it, so their blocks are
    stored again in the same batch (a router kept forgetting them until written anew)."""
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:*", event_encoding="map")
    eng = disk_engine(hf_model, tmp_path, host_blocks=3, kv_events=config)
    ctx = zmq.Context()
    try:
        sub = subscribed(ctx, eng)
        multi_round_chat(eng, rounds=2)
        eng.tiers.disk.flush()
        eng.block_manager.reset_prefix_cache()
        eng.step()  # nothing to run: publishes the reset's batch
        on_disk = {b.hash for b in eng.tiers.disk.indexed_blocks()}
        eng.cache_events.shutdown()
        assert on_disk and rebuilt(sub, eng.cache_events.publisher)["STORAGE"] == on_disk
    finally:
        ctx.destroy(linger=0)
        eng.shutdown()


def test_model_identity_ignores_config_fields_left_at_their_defaults():
    """A config field added with a default that keeps the old math (as qk_norm was) leaves the identity of a model
    that does not set it, so its disk-tier files stay valid; setting the field changes it."""
    @dataclass(frozen=True, kw_only=True)
    class Later(ModelConfig):
        new_switch: bool = False

    torch.manual_seed(0)
    weights = torch.nn.Linear(4, 4)
    cfg = ModelConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                      head_dim=4)  # fmt: skip
    assert model_identity(weights, Later(**asdict(cfg))) == model_identity(weights, cfg)
    assert model_identity(weights, Later(**asdict(cfg), new_switch=True)) != model_identity(weights, cfg)
    for changed in ({"qk_norm": True}, {"rope_theta": 5e5}, {"num_layers": 2}):
        assert model_identity(weights, Later(**(asdict(cfg) | changed))) != model_identity(weights, cfg), changed
