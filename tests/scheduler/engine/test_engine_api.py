"""The engine's public API: errors leave it unchanged, stop conditions, parallel samples, seeds, metrics."""

from __future__ import annotations

import math

import pytest
from sched_helpers import NUM_NEW, assert_all_freed, make_engine

from paged_kv.errors import (
    DuplicateSequenceError,
    InvalidArgumentError,
    OutOfRangeError,
    PagedKVError,
    UnknownSequenceError,
)
from scheduler import CacheConfig, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig


def _state(engine) -> tuple:
    """Everything a rejected call must leave as it was."""
    s = engine.scheduler
    queues = tuple(tuple(g.request_id for g in q) for q in (s.waiting, s.running, s.swapped))
    seqs = tuple((q.seq_id, q.num_computed, tuple(q.token_ids)) for g in s.groups() for q in g.seqs)
    return queues, seqs, tuple(engine.scheduler.requests), engine.block_manager.stats()


@pytest.fixture
def busy(tiny_hf, prompts):
    """An engine mid-run: two requests running, one waiting."""
    engine = make_engine(tiny_hf, num_blocks=40, max_num_batched_tokens=16, max_num_seqs=4)
    for i, p in enumerate(prompts[:3]):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=8))
    engine.step()
    engine.step()
    return engine


BAD_REQUESTS = {
    "duplicate id": (lambda e: e.add_request("r0", [1, 2], None), DuplicateSequenceError),
    "id not a str": (lambda e: e.add_request(7, [1, 2], None), InvalidArgumentError),
    "empty prompt": (lambda e: e.add_request("x", [], None), InvalidArgumentError),
    "prompt is a count": (lambda e: e.add_request("x", 5, None), InvalidArgumentError),
    "token past vocab": (lambda e: e.add_request("x", [1, 256], None), OutOfRangeError),
    "negative token": (lambda e: e.add_request("x", [1, -2], None), InvalidArgumentError),
    "params not SamplingParams": (lambda e: e.add_request("x", [1], {"max_tokens": 3}), InvalidArgumentError),
    "longer than the pool": (lambda e: e.add_request("x", [1] * 150, None), InvalidArgumentError),
    "n samples past the pool": (lambda e: e.add_request("x", [1] * 40, SamplingParams(n=4)), InvalidArgumentError),
    "n past max_num_seqs": (lambda e: e.add_request("x", [1], SamplingParams(n=5)), InvalidArgumentError),
    "prompt longer than the model": (lambda e: e.add_request("x", [1] * 513, None), InvalidArgumentError),
    "abort unknown": (lambda e: e.abort("nope"), UnknownSequenceError),
    "abort non-str": (lambda e: e.abort(["r0"]), UnknownSequenceError),
    "generate with one bad prompt": (lambda e: e.generate([[1, 2], [300]], use_tqdm=False), OutOfRangeError),
    "generate from an iterator": (lambda e: e.generate(iter([[1]]), use_tqdm=False), InvalidArgumentError),
    "generate params count": (
        lambda e: e.generate([[1], [2]], [SamplingParams()], use_tqdm=False), InvalidArgumentError
    ),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_requests_raise_typed_errors_and_change_nothing(busy, case):
    call, error = BAD_REQUESTS[case]
    before = _state(busy)
    with pytest.raises(error) as info:
        call(busy)
    assert isinstance(info.value, PagedKVError)
    assert _state(busy) == before


BAD_PARAMS = [
    dict(max_tokens=0), dict(max_tokens=2.5), dict(temperature=-0.1), dict(temperature=math.nan),
    dict(temperature=math.inf), dict(temperature=1e-40), dict(top_k=-2), dict(top_k=10**20), dict(top_p=0.0),
    dict(top_p=1.5), dict(seed=1 << 63), dict(seed=-(1 << 63) - 1), dict(n=0), dict(n=10_000),
    dict(stop_token_ids="12"), dict(stop_token_ids=[1, -1]), dict(ignore_eos="yes"), dict(logprobs=-1),
    dict(logprobs=1000), dict(temperature=True), dict(min_tokens=17), dict(min_tokens=-1), dict(min_p=1.5),
    dict(presence_penalty=2.5), dict(frequency_penalty=-3.0), dict(repetition_penalty=0.0),
    dict(logit_bias={1: 200.0}), dict(logit_bias={"x": 1.0}), dict(allowed_token_ids=[]), dict(bad_words=[""]),
    dict(bad_words_token_ids=[[]]), dict(prompt_logprobs=-1), dict(prompt_logprobs=1000),
]  # fmt: skip


@pytest.mark.parametrize("kwargs", BAD_PARAMS, ids=str)
def test_sampling_params_validate_on_construction(kwargs):
    with pytest.raises(PagedKVError) as info:
        SamplingParams(**kwargs)
    assert next(iter(kwargs)) in str(info.value)


def test_config_errors_are_typed():
    bad = [
        lambda: SchedulerConfig(max_num_seqs=0), lambda: SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4),
        lambda: SchedulerConfig(preemption_mode="drop"), lambda: CacheConfig(block_size=0),
        lambda: CacheConfig(watermark=1.0), lambda: EngineConfig(scheduler=SchedulerConfig(preemption_mode="swap")),
        lambda: EngineConfig(device="not-a-device"), lambda: CacheConfig(dtype="float16"),
    ]  # fmt: skip
    for make in bad:
        with pytest.raises(PagedKVError):
            make()


def test_abort_twice_and_after_finish_raise(busy):
    busy.abort("r2")
    with pytest.raises(UnknownSequenceError):
        busy.abort("r2")
    while busy.has_unfinished_requests():
        busy.step()
    with pytest.raises(UnknownSequenceError):
        busy.abort("r0")


def _samples(out) -> list[tuple]:
    return [(c.index, c.finish_reason, c.token_ids) for c in out.outputs]


@pytest.mark.parametrize("when", ["queued", "mid-prefill"])
def test_a_request_ended_before_its_samples_fork_reports_every_sample(tiny_hf, prompts, when):
    """n = 3 before the first sample (queued, or part of its prompt computed): a snapshot, an abort and a failure
    each give three outputs, indices 0..2, no tokens (an abort or a failure used to give sample 0 alone)."""
    engine = make_engine(tiny_hf, max_num_batched_tokens=16, max_num_seqs=8)
    params = SamplingParams(n=3, max_tokens=4, temperature=1.0, seed=0)
    engine.add_request("a", prompts[6], params)  # 64 tokens: four steps of 16 before it samples
    engine.add_request("b", prompts[3], params)
    if when == "mid-prefill":
        engine.step()
        assert engine.scheduler.requests["a"].seqs[0].num_computed == 16
    assert _samples(engine.request_output("a")) == [(i, None, []) for i in range(3)]
    assert _samples(engine.abort("a")) == [(i, "abort", []) for i in range(3)]
    failed = engine.fail("b", "its text layer failed")
    assert _samples(failed) == [(i, "error", []) for i in range(3)] and failed.finished
    assert_all_freed(engine)


@pytest.mark.parametrize("bad", [[1], [0, 1], [-1], {0, 7}])
def test_stop_samples_refuses_an_index_the_request_does_not_have(busy, bad):
    """Each request of ``busy`` has one sample: any other index is out of range (it used to be ignored)."""
    before = _state(busy)
    with pytest.raises(OutOfRangeError, match="indices"):
        busy.stop_samples("r0", bad)
    assert _state(busy) == before


@pytest.mark.parametrize("when", ["queued", "mid-prefill"])
@pytest.mark.parametrize("stopped", [[2], [0], [1, 0], [0, 1, 2]])
def test_a_sample_stopped_before_it_is_forked_ends_with_no_token_and_is_never_forked(tiny_hf, prompts, when,
                                                                                       stopped):  # fmt: skip
    """n = 3 stopped by index before the first sample: each stopped sample ends with no token, the others run
    to the end with the tokens they have alone (sample 0, computing the prompt, hands it on to one of them);
    stopped samples used to be forked and run on, and stopping sample 0 ended the whole request."""
    params = SamplingParams(n=3, max_tokens=5, temperature=1.0, seed=3, ignore_eos=True)
    (free,) = make_engine(tiny_hf).generate([prompts[2]], params, use_tqdm=False)
    engine = make_engine(tiny_hf, max_num_batched_tokens=16, max_num_seqs=8)
    engine.add_request("r", prompts[2], params)  # 33 tokens: three steps before it samples
    if when == "mid-prefill":
        engine.step()
    engine.stop_samples("r", stopped)
    assert [c.finish_reason for c in engine.request_output("r").outputs] == [
        "stop" if i in stopped else None for i in range(3)]  # fmt: skip
    done = {}
    while engine.has_unfinished_requests():
        done |= {o.request_id: o for o in engine.step()}
    assert _samples(done["r"]) == [(i, "stop", []) if i in stopped else (i, "length", free.outputs[i].token_ids)
                                   for i in range(3)]  # fmt: skip
    assert_all_freed(engine)


def _trace_position_ends(engine) -> list[int]:
    """Records, for every sequence each step runs, the end of the positions it computes."""
    ends, schedule = [], engine.scheduler.schedule

    def traced():
        out = schedule()
        ends.extend(s.start + s.num_tokens for s in out.scheduled)
        return out

    engine.scheduler.schedule = traced
    return ends


def test_a_request_past_the_model_context_stops_there_with_length(tiny_hf):
    """As vLLM's offline engine: prompt + max_tokens past the context (512) is served and stops once the sample
    holds 512 tokens ("length"; a prompt of exactly 512 gets one token), no position reaches 512, and the pool
    need is counted at that length (130 blocks of 4 hold 512 tokens, not 500 + 100); it used to be refused."""
    engine = make_engine(tiny_hf, num_blocks=130)
    ends = _trace_position_ends(engine)
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    for prompt_len, expected in ((500, 12), (512, 1)):
        (out,) = engine.generate([[7] * prompt_len], params, use_tqdm=False)
        assert (len(out.outputs[0].token_ids), out.outputs[0].finish_reason) == (expected, "length")
    assert max(ends) == 512  # positions 0..511: the 512-token prompt's, never one past
    with pytest.raises(InvalidArgumentError, match="model context"):
        engine.add_request("long", [7] * 513, params)
    assert_all_freed(engine)


def test_a_prompt_of_exactly_the_context_fits_the_blocks_it_fills(tiny_hf):
    """A sample's last token is never computed (its KV never written): a 512-token prompt (512 = context, a
    multiple of the block size) gets its one token in the 128 blocks it fills; it was refused, needing 129."""
    engine = make_engine(tiny_hf, num_blocks=128)
    (out,) = engine.generate([[7] * 512], SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert (len(out.outputs[0].token_ids), out.outputs[0].finish_reason) == (1, "length")
    assert_all_freed(engine)


@pytest.mark.parametrize(("chunked", "mode"), [(False, "recompute"), (True, "recompute"), (False, "swap"),
                                               (True, "swap")])  # fmt: skip
def test_a_request_that_exactly_fits_the_pool_and_step_budget_completes_under_preemption(tiny_hf, chunked, mode):
    """n=2 samples of 10 + 7 tokens hold KV for 16 each (the 7th output is never fed back): 2 x 4 blocks of 4
    and 16 tokens a step are exactly enough (they were refused as needing 10 blocks, 17 tokens). Two such
    requests contend for the 8 blocks, so one is preempted, and both still finish as in a roomy pool."""
    budget = 8 if chunked else 16
    tight = make_engine(tiny_hf, num_blocks=8, num_cpu_blocks=16, prefix=False, max_num_batched_tokens=budget,
                        enable_chunked_prefill=chunked, preemption_mode=mode, max_num_seqs=4)  # fmt: skip
    roomy = make_engine(tiny_hf, num_blocks=64, prefix=False, max_num_batched_tokens=budget,
                        enable_chunked_prefill=chunked, max_num_seqs=4)  # fmt: skip
    prompts = [list(range(1, 11)), list(range(50, 60))]
    params = SamplingParams(n=2, max_tokens=7, temperature=1.0, seed=3, ignore_eos=True)
    runs = [{o.request_id: [c.token_ids for c in o.outputs] for o in e.generate(prompts, params, use_tqdm=False)}
            for e in (tight, roomy)]  # fmt: skip
    assert tight.scheduler.num_preemptions[mode] > 0
    assert runs[0] == runs[1] and all(len(t) == 7 for samples in runs[0].values() for t in samples)
    assert_all_freed(tight)
    one_more = "needs 10 blocks, 8 usable" if chunked else "max_num_batched_tokens \\+ 1 = 17"
    with pytest.raises(InvalidArgumentError, match=one_more):  # one token more than fits is still refused
        tight.add_request("long", prompts[0], SamplingParams(n=2, max_tokens=8))


def test_stop_tokens_and_eos_end_a_sample_and_are_kept(tiny_hf, prompts, hf_greedy):
    ref = hf_greedy[2]
    eos = ref[4]
    cut = ref.index(eos) + 1
    engine = LLMEngine.from_hf(tiny_hf, EngineConfig(device="cpu"))
    engine.scheduler.eos_token_ids = frozenset([eos])
    out = engine.generate([prompts[2]], SamplingParams(max_tokens=NUM_NEW), use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.finish_reason) == (ref[:cut], "stop")
    out = engine.generate([prompts[2]], SamplingParams(max_tokens=NUM_NEW, ignore_eos=True), use_tqdm=False)[0]
    assert (out.outputs[0].token_ids, out.outputs[0].finish_reason) == (ref, "length")
    stop = ref[2]
    params = SamplingParams(max_tokens=NUM_NEW, ignore_eos=True, stop_token_ids=[stop])
    out = engine.generate([prompts[2]], params, use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.finish_reason) == (ref[: ref.index(stop) + 1], "stop")


def test_parallel_samples_share_the_prompt_blocks(tiny_hf):
    engine = make_engine(tiny_hf, num_blocks=64, max_num_batched_tokens=64, max_num_seqs=8)
    prompt = list(range(1, 42))  # 10 full blocks + 1 token in a partial block
    engine.add_request("p", prompt, SamplingParams(n=4, max_tokens=6, temperature=1.0, seed=7, ignore_eos=True))
    peak = 0
    while engine.has_unfinished_requests():
        (out,) = engine.step() or [None]
        peak = max(peak, engine.block_manager.stats().num_used)
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 6 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert engine.block_manager.num_cow_copies == 3  # the partial block, once per sample but the last
    assert peak <= 10 + 4 * 2  # shared prompt blocks + each sample's own tail; unshared would be 4 * 12


def test_seeded_sampling_reproducible_across_batches(tiny_hf, prompts):
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.95, seed=123)
    alone = make_engine(tiny_hf).generate([prompts[3]], params, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(max_tokens=10, temperature=1.0) for _ in prompts]
    mixed = make_engine(tiny_hf, max_num_batched_tokens=16, max_num_seqs=4)
    batch = mixed.generate(prompts, others[:3] + [params] + others[4:], use_tqdm=False)
    assert batch[3].outputs[0].token_ids == alone
    other_seed = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.95, seed=124)
    assert make_engine(tiny_hf).generate([prompts[3]], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_logprobs_and_metrics(tiny_hf, prompts):
    engine = make_engine(tiny_hf, max_num_batched_tokens=32, max_num_seqs=4)
    outs = engine.generate(prompts, SamplingParams(max_tokens=5, logprobs=3, ignore_eos=True), use_tqdm=False)
    for out in outs:
        c = out.outputs[0]
        assert len(c.logprobs) == len(c.top_logprobs) == 5
        for token, lp, top in zip(c.token_ids, c.logprobs, c.top_logprobs):
            assert len(top) == 3 and max(top, key=top.get) == token and top[token] == pytest.approx(lp)
        assert c.cumulative_logprob == pytest.approx(sum(c.logprobs))
        assert out.first_token_time >= out.arrival_time and out.finish_time >= out.first_token_time
    m = engine.metrics_summary()
    assert m.generated_tokens == 5 * len(prompts) and m.prompt_tokens == sum(map(len, prompts))
    assert m.computed_prompt_tokens < m.prompt_tokens and m.prefix_hit_rate > 0  # the shared prefix was reused
    assert 0 < m.kv_usage_peak <= 1 and len(m.kv_usage_curve) > 0
    assert 0 < m.ttft_p50 <= m.ttft_p99 and 0 < m.tpot_p50 <= m.tpot_p99
    assert "tok/s" in m.format()
