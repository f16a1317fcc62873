"""Requests through LoRA adapters equal transformers with the adapter merged into the weights (W + scale * B @ A),
batched with requests through other adapters and without one, across prefill, chunks, decode and preemption."""

from __future__ import annotations

import pytest
import torch
from beam_helpers import hf_beams
from lora_helpers import merged, write_adapter
from sched_helpers import GREEDY, NUM_NEW, assert_all_freed, greedy_reference, make_engine

from paged_kv.errors import PagedKVError
from scheduler import LoRAConfig, LoRARequest, SamplingParams
from scheduler.engine.beam_selection import BeamSearchParams

LORA = LoRAConfig(max_loras=2, max_lora_rank=8)


@pytest.fixture(scope="module")
def adapters(tiny_hf, tmp_path_factory):
    """Two adapters of the tiny model: rank 4 on every projection, rank 8 (rslora) on q/v/down only."""
    root = tmp_path_factory.mktemp("adapters")
    one = write_adapter(root / "one", tiny_hf, seed=1, rank=4)
    two = write_adapter(root / "two", tiny_hf, seed=2, rank=8, targets=("q_proj", "v_proj", "down_proj"),
                        use_rslora=True, alpha=8.0)  # fmt: skip
    return {"one": LoRARequest(name="one", path=one), "two": LoRARequest(name="two", path=two)}


@pytest.fixture(scope="module")
def oracles(tiny_hf, adapters):
    """transformers with each adapter merged, and the base model (None)."""
    return {None: tiny_hf, **{name: merged(tiny_hf, r.path) for name, r in adapters.items()}}


def _mixed(prompts, adapters):
    """Prompts assigned round-robin to adapter one, adapter two and the base model."""
    order = [adapters["one"], adapters["two"], None]
    return [order[i % 3] for i in range(len(prompts))]


def _expected(oracles, prompts, loras, **kw):
    return [greedy_reference(oracles[r.name if r else None], [p], **kw)[0] for p, r in zip(prompts, loras)]


CASES = {
    "prefill_decode": dict(),
    "chunked_prefill": dict(max_num_batched_tokens=8, max_num_seqs=4),
    "preempt_recompute": dict(num_blocks=20, max_num_batched_tokens=32, max_num_seqs=8),
    "preempt_swap": dict(num_blocks=20, num_cpu_blocks=64, preemption_mode="swap", max_num_batched_tokens=32,
                         max_num_seqs=8),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_mixed_batch_matches_merged_transformers(case, tiny_hf, prompts, adapters, oracles):
    """Adapter one, adapter two and the base model in the same steps: each request equals its own oracle."""
    engine = make_engine(tiny_hf, lora=LORA, **CASES[case])
    loras = _mixed(prompts, adapters)
    steps = []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda **kw: steps.append(out := schedule(**kw)) or out
    outs = engine.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == _expected(oracles, prompts, loras)
    assert any(len({s.group.lora for s in out.scheduled}) == 3 for out in steps), "no step mixed all three"
    if case.startswith("preempt"):
        assert sum(engine.scheduler.num_preemptions.values()) >= 1
    assert_all_freed(engine)


def test_adapters_change_the_output(tiny_hf, prompts, oracles):
    """The oracles differ from each other (else the equality above would prove nothing)."""
    refs = {name: greedy_reference(model, prompts[:3]) for name, model in oracles.items()}
    assert refs[None] != refs["one"] and refs[None] != refs["two"] and refs["one"] != refs["two"]


def test_logits_close_to_merged_transformers(tiny_hf, prompts, adapters, oracles):
    """The prompt log-probabilities of a request through adapter two equal the merged model's."""
    engine = make_engine(tiny_hf, lora=LORA)
    prompt = prompts[2]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, ignore_eos=True)
    out = engine.generate([prompt], params, lora_request=adapters["two"], use_tqdm=False)[0]
    logits = oracles["two"](torch.tensor([prompt])).logits[0].log_softmax(-1)
    want = [logits[i, prompt[i + 1]].item() for i in range(len(prompt) - 1)]
    got = [next(iter(d.values())) if len(d) == 1 else d[prompt[i + 1]] for i, d in enumerate(out.prompt_logprobs[1:])]
    assert got == pytest.approx(want, abs=1e-4)


def test_one_adapter_slot_serves_requests_in_turn(tiny_hf, prompts, adapters, oracles):
    """max_loras=1: requests through two adapters never share a step, and each still equals its oracle."""
    engine = make_engine(tiny_hf, lora=LoRAConfig(max_loras=1, max_lora_rank=8))
    loras = _mixed(prompts, adapters)
    steps = []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda **kw: steps.append(out := schedule(**kw)) or out
    outs = engine.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == _expected(oracles, prompts, loras)
    assert all(len({s.group.lora for s in out.scheduled} - {None}) <= 1 for out in steps)


def test_parallel_samples_keep_the_adapter(tiny_hf, prompts, adapters, oracles):
    """n=3 greedy samples forked from a request through an adapter all continue through it."""
    engine = make_engine(tiny_hf, lora=LORA)
    params = SamplingParams(max_tokens=NUM_NEW, ignore_eos=True, n=3)
    out = engine.generate([prompts[1]], params, lora_request=adapters["one"], use_tqdm=False)[0]
    want = greedy_reference(oracles["one"], [prompts[1]])[0]
    assert [c.token_ids for c in out.outputs] == [want] * 3


def test_beam_search_keeps_the_adapter(tiny_hf, prompts, adapters, oracles):
    """A beam search through adapter one returns transformers' beams of the merged model."""
    engine = make_engine(tiny_hf, lora=LORA)
    engine.add_beam_search("b", prompts[0], BeamSearchParams(width=3, max_tokens=6), lora_request=adapters["one"])
    done = []
    while engine.has_unfinished_requests():
        done += engine.step()
    want, _, _ = hf_beams(oracles["one"], prompts[0], width=3, new=6)
    assert [c.token_ids for c in done[0].outputs] == want
    assert want != hf_beams(tiny_hf, prompts[0], width=3, new=6)[0]
    assert_all_freed(engine)


def test_speculative_drafts_run_through_the_adapter(looping_hf, tmp_path):
    """n-gram drafts are verified with the adapter's logits: the greedy tokens are the merged model's."""
    from scheduler import SpeculativeConfig

    path = write_adapter(tmp_path / "loop", looping_hf, seed=4, std=0.05)
    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    engine = make_engine(looping_hf, lora=LORA, speculative=spec)
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    outs = engine.generate([prompt, prompt], SamplingParams(max_tokens=24, ignore_eos=True),
                           lora_request=[LoRARequest(name="loop", path=path), None], use_tqdm=False)  # fmt: skip
    assert outs[0].outputs[0].token_ids == greedy_reference(merged(looping_hf, path), [prompt], 24)[0]
    assert outs[1].outputs[0].token_ids == greedy_reference(looping_hf, [prompt], 24)[0]
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids
    assert engine.spec.stats.num_accepted_tokens > 0


@pytest.fixture
def full_cache(tiny_hf, adapters, tmp_path):
    """An engine keeping two adapters loaded (one, then two: one least recent), a base request "taken" queued,
    and a third adapter not loaded yet."""
    engine = make_engine(tiny_hf, lora=LoRAConfig(max_loras=1, max_lora_rank=8, max_cpu_loras=2))
    engine.load_lora(adapters["one"])
    engine.load_lora(adapters["two"])
    engine.add_request("taken", [1, 2, 3], GREEDY)
    three = LoRARequest(name="three", path=write_adapter(tmp_path / "three", tiny_hf, seed=3))
    return engine, three


def _lru(engine):
    """The loaded adapters, least recently requested first, with their keys (ids and fingerprints)."""
    loras = engine.runner.loras
    return [(name, loras.key(name)) for name in loras.names]


@pytest.mark.parametrize("bad", ["duplicate_id", "bad_prompt", "bad_priority", "beam_duplicate_id"])
@pytest.mark.parametrize("adapter", ["three", "one"])
def test_a_refused_request_leaves_the_loaded_adapters_as_they_were(full_cache, adapters, bad, adapter):
    """A request refused for its id, prompt or priority neither loads its adapter (evicting another) nor moves
    a loaded one in the LRU order; the next adapter still gets the next id."""
    engine, three = full_cache
    lora = three if adapter == "three" else adapters["one"]
    before = _lru(engine)
    call = {
        "duplicate_id": lambda: engine.add_request("taken", [4, 5], GREEDY, lora_request=lora),
        "bad_prompt": lambda: engine.add_request("x", [10**9], GREEDY, lora_request=lora),
        "bad_priority": lambda: engine.add_request("x", [4, 5], GREEDY, priority=1 << 70, lora_request=lora),
        "beam_duplicate_id": lambda: engine.add_beam_search("taken", [4, 5], BeamSearchParams(width=2, max_tokens=2),
                                                            lora_request=lora),
    }[bad]  # fmt: skip
    with pytest.raises(PagedKVError):
        call()
    assert _lru(engine) == before
    assert engine.add_request("ok", [4, 5], GREEDY, lora_request=three).lora.lora_id == 3


def test_generate_refused_for_one_prompt_loads_no_adapter(full_cache, adapters):
    """engine.generate with one bad prompt among several queues nothing and loads none of their adapters."""
    engine, three = full_cache
    before = _lru(engine)
    with pytest.raises(PagedKVError):
        engine.generate([[4, 5], [10**9]], GREEDY, lora_request=[three, adapters["one"]], use_tqdm=False)
    assert _lru(engine) == before and list(engine.scheduler.requests) == ["taken"]


def test_an_adapter_read_ahead_is_placed_without_reading_again(full_cache, monkeypatch):
    """A ReadLoRA (read on another thread) is staged from its weights: the engine thread opens no file."""
    import scheduler.runner.lora_manager as manager

    engine, three = full_cache
    read = engine.runner.loras.read(three)
    assert [name for name, _ in _lru(engine)] == ["one", "two"]  # reading changes nothing
    monkeypatch.setattr(manager, "load_adapter", lambda *a, **k: pytest.fail("read on the engine thread"))
    group = engine.add_request("r", [4, 5], GREEDY, lora_request=read)
    assert group.lora == engine.runner.loras.key("three") and group.lora.fingerprint == read.adapter.fingerprint
    assert [name for name, _ in _lru(engine)] == ["two", "three"]
