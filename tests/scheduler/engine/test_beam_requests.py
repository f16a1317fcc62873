"""Beam searches as engine requests: in the same steps as sampled requests, each gives what it gives alone;
aborts and failures free every beam; preemption changes nothing."""

from __future__ import annotations

import pytest
import torch
from beam_helpers import NEW, WIDTH
from sched_helpers import VOCAB, assert_all_freed, make_engine

import scheduler.engine.beam_selection as beam_selection
from paged_kv.errors import DuplicateSequenceError, InvalidArgumentError, OutOfRangeError
from scheduler import SamplingParams
from scheduler.engine.beam_search import BeamSearch, BeamSearchParams

BEAMS = BeamSearchParams(width=WIDTH, max_tokens=NEW, ignore_eos=True)
GREEDY = SamplingParams(max_tokens=20, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=20, ignore_eos=True, temperature=1.0, seed=5, n=2)


def _lone_beams(tiny_hf, prompts, params=BEAMS):
    """(tokens, cumulative logprobs) of each prompt's hypotheses, best first, searched alone on a fresh engine."""
    outs = BeamSearch(make_engine(tiny_hf)).generate(prompts, params)
    return [[(h.token_ids, h.cumulative_logprob) for h in o.hypotheses] for o in outs]


def _lone_samples(tiny_hf, prompts, params):
    """Each prompt's sampled token ids per sample, run alone on a fresh engine."""
    outs = make_engine(tiny_hf).generate(prompts, params, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs]


def _run_mixed(engine, beam_prompts, sampled, params=BEAMS):
    """Add the beam searches ("b<i>") and the sampled requests ("s<i>": (prompt, params)) together; step until
    all are done. Returns the outputs by id and, per step, the set of ids it ran."""
    steps, schedule = [], engine.scheduler.schedule

    def traced():
        out = schedule()
        steps.append({s.group.request_id[0] for s in out.scheduled})
        return out

    engine.scheduler.schedule = traced
    for i, prompt in enumerate(beam_prompts):
        engine.add_beam_search(f"b{i}", prompt, params)
    for i, (prompt, p) in enumerate(sampled):
        engine.add_request(f"s{i}", prompt, p)
    done = {}
    while engine.has_unfinished_requests():
        done |= {o.request_id: o for o in engine.step()}
    return done, steps


def _hypotheses(out):
    return [(c.token_ids, c.cumulative_logprob) for c in out.outputs]


def _assert_same_hypotheses(got, ref):
    assert [ids for ids, _ in got] == [ids for ids, _ in ref]
    assert [lp for _, lp in got] == pytest.approx([lp for _, lp in ref], abs=1e-4)


def test_beam_searches_and_sampled_requests_in_the_same_steps_each_give_their_lone_result(tiny_hf, beam_prompts,
                                                                                         prompts):  # fmt: skip
    """Greedy and seeded n=2 requests share every step with four beam searches: each gives what it gives alone."""
    sampled = [(prompts[0], GREEDY), (prompts[1], SEEDED), (prompts[2], GREEDY)]
    engine = make_engine(tiny_hf)
    done, steps = _run_mixed(engine, beam_prompts, sampled)
    assert sum({"b", "s"} <= ids for ids in steps) >= NEW // 2, "the beams and the samples did not share steps"
    for i, ref in enumerate(_lone_beams(tiny_hf, beam_prompts)):
        out = done[f"b{i}"]
        assert out.finished and out.error is None and [c.index for c in out.outputs] == list(range(WIDTH))
        assert {c.finish_reason for c in out.outputs} == {"length"}
        _assert_same_hypotheses(_hypotheses(out), ref)
    lone = [_lone_samples(tiny_hf, [p], params)[0] for p, params in sampled]
    assert [[c.token_ids for c in done[f"s{i}"].outputs] for i in range(len(sampled))] == lone
    assert_all_freed(engine)


def test_beam_search_generate_runs_beside_a_live_request(tiny_hf, beam_prompts, prompts):
    """BeamSearch.generate no longer needs an idle engine: a request already running shares its steps and then
    finishes with its lone tokens."""
    engine = make_engine(tiny_hf)
    engine.add_request("other", prompts[3], SamplingParams(max_tokens=40, ignore_eos=True))
    engine.step()  # "other" is running
    outs = BeamSearch(engine).generate(beam_prompts[1:3], BEAMS)
    for out, ref in zip(outs, _lone_beams(tiny_hf, beam_prompts[1:3])):
        _assert_same_hypotheses([(h.token_ids, h.cumulative_logprob) for h in out.hypotheses], ref)
    assert engine.has_unfinished_requests()  # "other" outlives the searches
    rest = [o for _ in range(40) if engine.has_unfinished_requests() for o in engine.step()]
    assert [o.outputs[0].token_ids for o in rest] == _lone_samples(tiny_hf, [prompts[3]], SamplingParams(
        max_tokens=40, ignore_eos=True))[0]  # fmt: skip
    assert_all_freed(engine)


def test_generate_and_beam_search_pick_ids_no_live_request_holds(tiny_hf, beam_prompts, prompts):
    """The ids BeamSearch.generate and LLMEngine.generate make up skip those a caller's live requests chose."""
    engine = make_engine(tiny_hf)
    for rid in ("beam-search-0", "beam-search-1", "generate-2"):
        engine.add_request(rid, prompts[3], SamplingParams(max_tokens=60, ignore_eos=True))
    outs = BeamSearch(engine).generate(beam_prompts[1:3], BEAMS)
    assert {o.request_id for o in outs}.isdisjoint({"beam-search-0", "beam-search-1"})
    for out, ref in zip(outs, _lone_beams(tiny_hf, beam_prompts[1:3])):
        _assert_same_hypotheses([(h.token_ids, h.cumulative_logprob) for h in out.hypotheses], ref)
    greedy = SamplingParams(max_tokens=5, ignore_eos=True)
    ran = engine.generate([prompts[0]], greedy, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in ran] == _lone_samples(tiny_hf, [prompts[0]], greedy)
    assert not engine.has_unfinished_requests()  # the callers' requests ran to their end meanwhile
    assert_all_freed(engine)


def test_abort_mid_search_frees_every_beam_and_returns_what_it_had(tiny_hf, beam_prompts, prompts):
    """An aborted search frees all its live beams at once (the pool's free count is back where it was); its output
    holds its live beams, finished "abort"; the sampled request beside it is untouched."""
    engine = make_engine(tiny_hf)
    bm = engine.block_manager
    engine.add_request("other", prompts[0], GREEDY)
    engine.step()
    free_before = bm.gpu.num_free
    req = engine.add_beam_search("b", beam_prompts[3], BEAMS)
    while len(req.beams) < WIDTH or req.num_steps < 3:
        assert not engine.step()
    assert bm.gpu.num_free < free_before and len({s.seq_id for s in req.beams}) == WIDTH
    out = engine.abort("b")
    other = engine.scheduler.requests["other"].seqs[0].seq_id
    assert bm.gpu.num_used == len(bm.block_table(other))  # the search holds no block any more
    assert all(s.seq_id not in bm for s in req.beams) and req.done and "b" not in engine.scheduler.requests
    assert out.finished and len(out.outputs) == WIDTH
    assert [c.finish_reason for c in out.outputs] == ["abort"] * WIDTH
    assert all(len(c.token_ids) == req.num_steps for c in out.outputs)
    done = {}
    while engine.has_unfinished_requests():
        done |= {o.request_id: o for o in engine.step()}
    assert done["other"].outputs[0].token_ids == _lone_samples(tiny_hf, [prompts[0]], GREEDY)[0][0]
    assert_all_freed(engine)
    assert bm.gpu.num_free == bm.config.num_blocks  # nothing leaked


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_mixed_steps_under_preemption_give_the_lone_results(tiny_hf, beam_prompts, prompts, mode):
    """A pool too small for the searches and the sampled requests together preempts them: nothing changes."""
    config = dict(num_blocks=40, max_num_batched_tokens=32, max_num_seqs=28, preemption_mode=mode)
    if mode == "swap":
        config |= dict(num_cpu_blocks=128, max_num_batched_tokens=160)
    sampled = [(prompts[2], GREEDY), (prompts[0], SEEDED)]
    engine = make_engine(tiny_hf, **config)
    done, _ = _run_mixed(engine, beam_prompts[:3], sampled)
    assert engine.scheduler.num_preemptions[mode] > 0
    for i, ref in enumerate(_lone_beams(tiny_hf, beam_prompts[:3])):
        _assert_same_hypotheses(_hypotheses(done[f"b{i}"]), ref)
    lone = [_lone_samples(tiny_hf, [p], params)[0] for p, params in sampled]
    assert [[c.token_ids for c in done[f"s{i}"].outputs] for i in range(len(sampled))] == lone
    assert_all_freed(engine)


@pytest.mark.parametrize("where", ["logits", "advance"])
def test_a_failing_selection_fails_that_search_alone(tiny_hf, beam_prompts, prompts, monkeypatch, where):
    """A search whose candidates (batched with the others') or whose advance raises fails alone ("error", beams
    freed); the other search and the sampled request give their lone results."""
    method = getattr(beam_selection.BeamRequest, where)

    def failing(self, *args):
        if self.group.request_id == "b0" and self.num_steps == 2:
            raise RuntimeError("selection broke")
        return method(self, *args)

    monkeypatch.setattr(beam_selection.BeamRequest, where, failing)
    engine = make_engine(tiny_hf)
    done, _ = _run_mixed(engine, beam_prompts[1:3], [(prompts[0], GREEDY)])
    assert "selection broke" in done["b0"].error and done["b0"].finished
    assert {c.finish_reason for c in done["b0"].outputs} == {"error"}
    _assert_same_hypotheses(_hypotheses(done["b1"]), _lone_beams(tiny_hf, beam_prompts[2:3])[0])
    assert done["s0"].outputs[0].token_ids == _lone_samples(tiny_hf, [prompts[0]], GREEDY)[0][0]
    assert_all_freed(engine)


def test_beam_requests_are_checked_like_requests_and_refuse_sample_hooks(tiny_hf, beam_prompts):
    """Bad searches raise before anything is queued; a selection hook or stop_samples cannot touch a search."""
    engine = make_engine(tiny_hf, num_blocks=64)
    for prompt, params, error in [([VOCAB], BEAMS, OutOfRangeError), (beam_prompts[0], "x", InvalidArgumentError),
                                  (beam_prompts[3], BeamSearchParams(width=8, max_tokens=16), InvalidArgumentError),
                                  ([1], BeamSearchParams(width=VOCAB // 2 + 1, max_tokens=1), InvalidArgumentError),
                                  ([1], BeamSearchParams(width=1, max_tokens=512), InvalidArgumentError)]:  # fmt: skip
        with pytest.raises(error):
            engine.add_beam_search("b", prompt, params)
        assert not engine.has_unfinished_requests() and not engine.beams
    engine.add_beam_search("b", beam_prompts[1], BEAMS)
    with pytest.raises(InvalidArgumentError, match="select"):
        engine.step(lambda out, logits: [])
    with pytest.raises(InvalidArgumentError, match="request_id"):
        engine.stop_samples("b", [0])
    snapshot = engine.request_output("b")
    assert not snapshot.finished and [c.token_ids for c in snapshot.outputs] == [[]]
    engine.abort("b")
    assert_all_freed(engine)


def test_a_huge_length_penalty_ranks_without_overflow(tiny_hf, beam_prompts):
    """length ** length_penalty past the largest float is infinite: the search ends normally, never raises."""
    g = torch.Generator().manual_seed(0)
    eos = torch.randint(0, VOCAB, (8,), generator=g).tolist()
    params = BeamSearchParams(width=2, max_tokens=6, length_penalty=1e6, stop_token_ids=eos)
    (out,) = BeamSearch(make_engine(tiny_hf)).generate(beam_prompts[1:2], params)
    assert out.error is None and len(out.hypotheses) == 2


def test_a_failed_step_forgets_every_search_and_their_ids_are_free_again(tiny_hf, beam_prompts, prompts):
    """A model step that raises aborts the live search with the sampled request: the engine's searches are those
    the scheduler holds (none), every block is free, and the same id then runs a search to its lone result. An id
    in use is refused across kinds (DuplicateSequenceError), nothing changed."""
    engine = make_engine(tiny_hf)
    req = engine.add_beam_search("b", beam_prompts[2], BEAMS)
    engine.add_request("s", prompts[0], GREEDY)
    for _ in range(3):
        engine.step()
    run_model = engine.runner.run
    engine.runner.run = lambda out: (_ for _ in ()).throw(RuntimeError("device lost"))
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()
    engine.runner.run = run_model
    assert not engine.beams and req.done and "device lost" in req.error
    assert_all_freed(engine)
    engine.add_beam_search("b", beam_prompts[2], BEAMS)
    engine.add_request("s", prompts[0], GREEDY)
    for add in (lambda: engine.add_request("b", prompts[0], GREEDY), lambda: engine.add_beam_search("s", [1], BEAMS)):
        with pytest.raises(DuplicateSequenceError):
            add()
    assert set(engine.beams.live) == {"b"} and set(engine.scheduler.requests) == {"b", "s"}
    done = {}
    while engine.has_unfinished_requests():
        done |= {o.request_id: o for o in engine.step()}
    _assert_same_hypotheses(_hypotheses(done["b"]), _lone_beams(tiny_hf, beam_prompts[2:3])[0])
    assert_all_freed(engine)


def test_searches_of_one_prompt_share_its_cached_blocks_unless_salted(tiny_hf, beam_prompts):
    """A prompt an earlier sampled request cached serves two searches of it at once (and their beams); a salted
    third computes it apart. Each gives its lone hypotheses."""
    engine = make_engine(tiny_hf)
    engine.generate([beam_prompts[3]], GREEDY, use_tqdm=False)
    salted = BeamSearchParams(width=WIDTH, max_tokens=NEW, ignore_eos=True, cache_salt="tenant")
    for rid, params in (("b0", BEAMS), ("b1", BEAMS), ("b2", salted)):
        engine.add_beam_search(rid, beam_prompts[3], params)
    done = {}
    while engine.has_unfinished_requests():
        done |= {o.request_id: o for o in engine.step()}
    ref = _lone_beams(tiny_hf, beam_prompts[3:])[0]
    for rid in ("b0", "b1", "b2"):
        _assert_same_hypotheses(_hypotheses(done[rid]), ref)
    assert done["b0"].num_cached_tokens > 0 and done["b1"].num_cached_tokens > 0 and done["b2"].num_cached_tokens == 0
    assert_all_freed(engine)


@pytest.mark.parametrize("num_found", [1, 2])
def test_an_aborted_search_ends_every_output_with_abort(tiny_hf, num_found):
    """Aborted once it holds ``num_found`` hypotheses (2: all ``width`` of them, while it still runs), a search's
    outputs are what it had, hypotheses first, and every one ends with "abort", as every sample of an aborted
    request still running does: no hypothesis is final before the search ends (a later one may displace it)."""
    prompt = torch.randint(0, VOCAB, (6,), generator=torch.Generator().manual_seed(7)).tolist()
    (ref,) = BeamSearch(make_engine(tiny_hf)).generate([prompt], BeamSearchParams(width=2, ignore_eos=True))
    stops = tuple(dict.fromkeys(ref.hypotheses[0].token_ids[1:6]))  # tokens on the best path end hypotheses early
    params = BeamSearchParams(width=2, ignore_eos=True, stop_token_ids=stops, early_stopping="never")
    engine = make_engine(tiny_hf)
    req = engine.add_beam_search("b", prompt, params)
    while len(req.finished) < num_found:
        assert not engine.step()
    assert not req.done and len(req.beams) == 2  # the case: it runs on
    found = [h.token_ids for h in req.finished]
    live = [s.output_token_ids for s in req.beams]
    out = engine.abort("b")
    assert out.finished and [c.token_ids for c in out.outputs] == (found + live)[:2]
    assert [c.finish_reason for c in out.outputs] == ["abort", "abort"]
    assert_all_freed(engine)
