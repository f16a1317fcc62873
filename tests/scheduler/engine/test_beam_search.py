"""Beam search on the engine: transformers' beams and scores, shared blocks, immediate frees, typed errors."""

from __future__ import annotations

import math

import pytest
import torch
from beam_helpers import NEW, WIDTH, assert_same_beams, hf_beams
from sched_helpers import VOCAB, assert_all_freed, make_engine, tiny_llama
from torch.overrides import TorchFunctionMode

import scheduler.engine.beam_search as beam_search
import scheduler.engine.beam_selection as beam_selection
from paged_kv.errors import InvalidArgumentError, OutOfRangeError, PagedKVError
from scheduler.engine.beam_search import BeamSearch, BeamSearchParams


def test_beams_match_transformers_batched(tiny_hf, beam_prompts):
    """Four prompts of different lengths in one batch: every beam and score equals generate(num_beams=4)."""
    engine = make_engine(tiny_hf)
    outs = BeamSearch(engine).generate(beam_prompts, BeamSearchParams(width=WIDTH, max_tokens=NEW))
    for prompt, out in zip(beam_prompts, outs):
        assert out.prompt_token_ids == prompt
        assert_same_beams(out, *hf_beams(tiny_hf, prompt))
        best = out.hypotheses[0]
        assert len(best.token_ids) == NEW and best.finish_reason == "length"
        assert best.cumulative_logprob == pytest.approx(sum(best.logprobs), abs=1e-4)
        assert best.score == pytest.approx(best.cumulative_logprob / NEW)
    assert_all_freed(engine)


def test_width_one_is_greedy(tiny_hf, prompts, hf_greedy):
    """Width 1 keeps the argmax path: transformers' greedy tokens."""
    outs = BeamSearch(make_engine(tiny_hf)).generate(prompts, BeamSearchParams(width=1, max_tokens=len(hf_greedy[0])))
    assert [o.hypotheses[0].token_ids for o in outs] == hf_greedy


STOPPING = [(False, 1.0), (True, 1.0), ("never", 1.0), ("never", -0.5), (False, 0.0), (False, 2.0)]


@pytest.mark.parametrize("early_stopping, length_penalty", STOPPING)
def test_eos_and_stopping_rules_match_transformers(tiny_hf, beam_prompts, early_stopping, length_penalty):
    """EOS ends hypotheses, length penalty ranks them, the search stops when transformers stops it."""
    # EOS: the 4th token of the best EOS-free beam, so that EOS is actually reached
    eos = [hf_beams(tiny_hf, p)[0][0][3] for p in beam_prompts]
    params = [
        BeamSearchParams(
            width=WIDTH, max_tokens=NEW, stop_token_ids=(e,), early_stopping=early_stopping,
            length_penalty=length_penalty,
        )  # fmt: skip
        for e in eos
    ]
    engine = make_engine(tiny_hf)
    outs = BeamSearch(engine).generate(beam_prompts, params)
    for prompt, out, e in zip(beam_prompts, outs, eos):
        ref = hf_beams(tiny_hf, prompt, eos=e, early_stopping=early_stopping, length_penalty=length_penalty)
        assert_same_beams(out, *ref)
    for out, e in zip(outs, eos):
        assert all(e not in h.token_ids[:-1] for h in out.hypotheses)  # EOS only ever ends a hypothesis
        assert all((h.token_ids[-1] == e) == (h.finish_reason == "stop") for h in out.hypotheses)
    if length_penalty <= 1.0:  # short EOS hypotheses are not ranked out by a strong length bonus
        assert any(h.finish_reason == "stop" for o in outs for h in o.hypotheses)
    assert_all_freed(engine)


@pytest.mark.parametrize("early_stopping, length_penalty", STOPPING)
def test_early_stop_with_many_eos_ids_matches_transformers(tiny_hf, beam_prompts, early_stopping, length_penalty):
    """With a quarter of the vocabulary ending hypotheses, searches fill up early and stop when transformers does."""
    eos = list(range(0, VOCAB - 4, 4))  # 63 ids: K = 64 * width = the whole vocabulary at the first step
    params = BeamSearchParams(
        width=WIDTH, max_tokens=NEW, stop_token_ids=eos, early_stopping=early_stopping, length_penalty=length_penalty
    )
    outs = BeamSearch(make_engine(tiny_hf)).generate(beam_prompts, params)
    for prompt, out in zip(beam_prompts, outs):
        ref = hf_beams(tiny_hf, prompt, eos=eos, early_stopping=early_stopping, length_penalty=length_penalty)
        assert_same_beams(out, *ref)
    # "never" with a length bonus, or a strong bonus, keeps hope that a longer beam wins: those run to the end
    if length_penalty <= 1.0 and not (early_stopping == "never" and length_penalty > 0):
        assert min(o.num_steps for o in outs) < NEW, "no search stopped before max_tokens"


def test_engine_eos_ends_beams_unless_ignored(tiny_hf, beam_prompts):
    """The engine's EOS id ends hypotheses like a stop token; ignore_eos turns it off."""
    prompt = beam_prompts[2]
    eos = hf_beams(tiny_hf, prompt)[0][0][2]
    engine = make_engine(tiny_hf)
    engine.scheduler.eos_token_ids = frozenset([eos])
    search = BeamSearch(engine)
    out = search.generate([prompt], BeamSearchParams(width=WIDTH, max_tokens=NEW))[0]
    assert_same_beams(out, *hf_beams(tiny_hf, prompt, eos=eos))
    ignored = search.generate([prompt], BeamSearchParams(width=WIDTH, max_tokens=NEW, ignore_eos=True))[0]
    assert_same_beams(ignored, *hf_beams(tiny_hf, prompt))


def _trace_steps(engine):
    """Wrap the scheduler: record, per step, (scheduled seqs, CoW copies, used blocks after scheduling)."""
    steps, schedule = [], engine.scheduler.schedule

    def traced():
        out = schedule()
        tables = {s.seq.seq_id: engine.block_manager.block_table(s.seq.seq_id) for s in out.scheduled}
        steps.append(([(s.start, tables[s.seq.seq_id]) for s in out.scheduled], list(out.copies),
                      engine.block_manager.gpu.num_used))  # fmt: skip
        return out

    engine.scheduler.schedule = traced
    return steps


def test_beams_share_blocks_and_copy_only_the_last_partial_block(tiny_hf, beam_prompts):
    """Forks copy nothing; a diverging beam copies only the shared partial block it writes into."""
    engine = make_engine(tiny_hf)
    steps = _trace_steps(engine)
    search = BeamSearch(engine)
    outs = search.generate(beam_prompts, BeamSearchParams(width=WIDTH, max_tokens=NEW, ignore_eos=True))
    bs = engine.block_manager.block_size
    copies = 0
    for scheduled, cow, _ in steps:
        written = {table[start // bs]: start for start, table in scheduled}  # block each seq writes into
        for src, dst in cow:
            assert dst in written and written[dst] % bs != 0, "copied a block that was not a partial last block"
        copies += len(cow)
    assert 0 < copies == engine.block_manager.num_cow_copies
    peak_used = max(used for _, _, used in steps)
    assert search.last_memory.peak_blocks == peak_used  # the meter counts exactly the referenced blocks
    for out in outs:
        m = out.memory
        assert 0 < m.peak_blocks < m.peak_blocks_unshared and 0 < m.saving < 1 and 0 < m.mean_saving < 1
        assert m.peak_bytes == m.peak_blocks * engine.runner.gpu_cache.spec.bytes_per_block
    # at the last step every beam holds ceil((prompt + NEW - 1) / bs) blocks when nothing is shared
    longest = max(len(p) for p in beam_prompts)
    assert outs[-1].memory.peak_blocks_unshared == WIDTH * math.ceil((longest + NEW - 1) / bs)
    assert_all_freed(engine)


def test_pruned_and_finished_beams_free_their_blocks_at_once(tiny_hf, beam_prompts):
    """Every beam that leaves the search has no block right after, and usage drops with it."""
    engine = make_engine(tiny_hf)
    bm, finish = engine.block_manager, engine.scheduler.finish
    drops = []

    def traced_finish(seq, reason, now=None):
        before = bm.gpu.num_used
        finish(seq, reason, now)
        assert seq.seq_id not in bm
        drops.append(before - bm.gpu.num_used)

    engine.scheduler.finish = traced_finish
    BeamSearch(engine).generate(beam_prompts, BeamSearchParams(width=WIDTH, max_tokens=NEW))
    assert len(drops) > WIDTH * len(beam_prompts)  # pruned mid-search, not only at the end
    assert sum(d > 0 for d in drops) >= len(beam_prompts)
    assert_all_freed(engine)


PREEMPTION = {
    # chunked re-prefill after recompute: some beams of a group reach their last token steps before the others
    # (a budget of 28 tokens splits the beams' own suffixes after their group's shared prefix is recomputed)
    "recompute": dict(num_blocks=36, max_num_batched_tokens=28, max_num_seqs=28),
    "swap": dict(
        num_blocks=36, num_cpu_blocks=128, preemption_mode="swap", max_num_batched_tokens=160, max_num_seqs=28
    ),
}


@pytest.mark.parametrize("mode", list(PREEMPTION))
def test_same_beams_under_constant_preemption(tiny_hf, mode, monkeypatch):
    """A pool too small for all searches at once preempts them; the beams do not change."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (1, 5, 17, 9, 12, 3, 14)]
    params = BeamSearchParams(width=WIDTH, max_tokens=NEW, ignore_eos=True)
    reference = BeamSearch(make_engine(tiny_hf)).generate(prompts, params)
    waits = []  # per check: some beams of a group have their logits, others not yet
    all_ready = beam_selection.BeamRequest.all_ready

    def traced(req):
        waits.append(bool(req.ready) and not all_ready(req))
        return all_ready(req)

    monkeypatch.setattr(beam_selection.BeamRequest, "all_ready", traced)
    engine = make_engine(tiny_hf, **PREEMPTION[mode])
    outs = BeamSearch(engine).generate(prompts, params)
    tokens = lambda outputs: [[h.token_ids for h in o.hypotheses] for o in outputs]  # noqa: E731
    assert tokens(outs) == tokens(reference)
    assert engine.scheduler.num_preemptions[mode] >= 2
    if mode == "recompute":
        assert any(waits), "no group waited on some of its beams"
    assert_all_freed(engine)


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_searches_that_exactly_fit_the_pool_finish_under_preemption(tiny_hf, mode, chunked):
    """4 beams of 6 + 7 tokens hold KV for 12 each (a hypothesis's last token is never fed back): 4 x 3 blocks
    of 4 and 12 tokens a step are exactly enough (it was refused, needing 16 blocks and 13 tokens). Two such
    searches contend for the 12 blocks, are preempted, and give the beams of a roomy pool."""
    params, prompts = BeamSearchParams(width=4, max_tokens=7), [[5, 9, 13, 200, 31, 7], [8, 1, 2, 3, 4, 99]]
    tight = make_engine(tiny_hf, num_blocks=12, num_cpu_blocks=32, prefix=False, preemption_mode=mode,
                        max_num_batched_tokens=8 if chunked else 12, enable_chunked_prefill=chunked, max_num_seqs=8)
    tokens = lambda outputs: [[h.token_ids for h in o.hypotheses] for o in outputs]  # noqa: E731
    reference = tokens(BeamSearch(make_engine(tiny_hf, prefix=False)).generate(prompts, params))
    assert tokens(BeamSearch(tight).generate(prompts, params)) == reference
    assert tight.scheduler.num_preemptions[mode] > 0
    assert_all_freed(tight)


def test_a_group_recomputed_after_preemption_computes_its_shared_prefix_once(tiny_hf):
    """Without prefix caching, a preempted beam group is recomputed as a group: the prompt once, then the forks.

    Each group's prompt tokens computed over the run are at most one prompt per admission (the first and
    one per recompute preemption), plus less than a block per beam where its fork point falls in the prompt;
    recomputing each beam on its own would compute the prompt once per beam each time.
    """
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, VOCAB, (40,), generator=g).tolist() for _ in range(6)]
    params = BeamSearchParams(width=WIDTH, max_tokens=NEW, ignore_eos=True)
    reference = BeamSearch(make_engine(tiny_hf, prefix=False)).generate(prompts, params)
    engine = make_engine(tiny_hf, prefix=False, num_blocks=56, max_num_batched_tokens=128, max_num_seqs=24)
    computed, preempted, schedule = {}, {}, engine.scheduler.schedule

    def traced():
        out = schedule()
        for group in out.preempted:
            preempted[group.request_id] = preempted.get(group.request_id, 0) + 1
        for s in out.scheduled:
            computed[s.group.request_id] = computed.get(s.group.request_id, 0) + s.num_prompt_tokens
        return out

    engine.scheduler.schedule = traced
    outs = BeamSearch(engine).generate(prompts, params)
    tokens = [[h.token_ids for h in o.hypotheses] for o in outs]
    assert tokens == [[h.token_ids for h in o.hypotheses] for o in reference]
    assert preempted, "no group was preempted"
    bs = engine.block_manager.block_size
    for rid, times in preempted.items():
        assert computed[rid] <= 40 * (1 + times) + times * WIDTH * (bs - 1), (rid, times, computed[rid])
    assert_all_freed(engine)


def test_params_are_validated():
    """Each bad field raises a typed error naming it."""
    bad = [
        dict(width=0), dict(width=True), dict(max_tokens=0), dict(length_penalty=float("nan")),
        dict(length_penalty="1"), dict(early_stopping="always"), dict(early_stopping=1), dict(ignore_eos=1),
        dict(stop_token_ids=[-1]), dict(stop_token_ids="ab"),
    ]
    for kwargs in bad:
        with pytest.raises(PagedKVError) as err:
            BeamSearchParams(**kwargs)
        assert next(iter(kwargs)) in str(err.value)
    assert BeamSearchParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)


def test_bad_requests_leave_the_engine_unchanged(tiny_hf, beam_prompts):
    """A bad prompt, width or parameter list raises before anything is queued."""
    engine = make_engine(tiny_hf, num_blocks=64)
    search = BeamSearch(engine)
    good = BeamSearchParams(width=2, max_tokens=4)
    cases = [
        ([beam_prompts[0], [VOCAB]], good, OutOfRangeError),
        ([beam_prompts[0], []], good, InvalidArgumentError),
        (beam_prompts, [good], InvalidArgumentError),  # one params per prompt
        (beam_prompts[:1], "width=2", InvalidArgumentError),
        (beam_prompts[3:], BeamSearchParams(width=8, max_tokens=16), InvalidArgumentError),  # 8 x 14 blocks > 64
        (beam_prompts[:1], BeamSearchParams(width=200, max_tokens=1), InvalidArgumentError),  # over max_num_seqs
    ]
    for prompts, params, error in cases:
        with pytest.raises(error):
            search.generate(prompts, params)
        assert not engine.has_unfinished_requests() and engine.block_manager.stats().num_sequences == 0


def test_a_search_past_the_model_context_is_refused(tiny_hf, beam_prompts):
    """Every beam runs to max_tokens: prompt + max_tokens past the 512-token context is refused before anything
    is queued (the engine's sampled requests stop at the context instead; the pool holds 512 tokens here)."""
    engine = make_engine(tiny_hf, num_blocks=200)
    with pytest.raises(InvalidArgumentError, match="model context"):
        BeamSearch(engine).generate(beam_prompts[1:2], BeamSearchParams(width=1, max_tokens=510))
    assert not engine.has_unfinished_requests()


def test_error_mid_search_leaves_engine_clean(tiny_hf, beam_prompts):
    """An error raised during a step aborts every search: no request left, every block freed."""
    engine = make_engine(tiny_hf)
    run_model, calls = engine.runner.run, []

    def failing(out):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return run_model(out)

    engine.runner.run = failing
    with pytest.raises(KeyboardInterrupt):
        BeamSearch(engine).generate(beam_prompts, BeamSearchParams(width=WIDTH, max_tokens=NEW))
    assert_all_freed(engine)
    engine.runner.run = run_model
    out = BeamSearch(engine).generate(beam_prompts[:1], BeamSearchParams(width=WIDTH, max_tokens=NEW))[0]
    assert_same_beams(out, *hf_beams(tiny_hf, beam_prompts[0]))


def test_width_limited_by_vocabulary(tiny_hf):
    """K = 2 * width candidates must exist among the first step's vocab-size continuations."""
    engine = make_engine(tiny_hf, max_num_seqs=256, max_num_batched_tokens=512, num_blocks=1024)
    with pytest.raises(InvalidArgumentError, match="width"):
        BeamSearch(engine).generate([[1, 2]], BeamSearchParams(width=VOCAB // 2 + 1, max_tokens=1))


@pytest.mark.slow
def test_smollm2_best_beam_matches_transformers(smollm2):
    """On the real model, the best beam of a real prompt equals transformers' num_beams=4 output."""
    hf_model, tokenizer = smollm2
    prompt = tokenizer(
        "Painters learn early that every color on the palette can be mixed from a few others. "
        "The three primary colors are"
    )["input_ids"]
    assert len(prompt) > 16  # a full block the beams share
    engine = make_engine(hf_model, block_size=16, num_blocks=64)
    out = BeamSearch(engine).generate([prompt], BeamSearchParams(width=WIDTH, max_tokens=8, ignore_eos=True))[0]
    ref_seqs, ref_scores, _ = hf_beams(hf_model, prompt, new=8)
    assert out.hypotheses[0].token_ids == ref_seqs[0]
    assert out.hypotheses[0].score == pytest.approx(ref_scores[0], abs=1e-4)
    assert out.memory.peak_blocks < out.memory.peak_blocks_unshared
    assert_all_freed(engine)


class _MetaAsDevice(TorchFunctionMode):
    """Meta tensors stand in for a GPU's: a copy of one to the CPU reads zeros and is counted; other host reads fail."""

    HOST_READS = (torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.numpy, torch.Tensor.__bool__,
                  torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__index__)  # fmt: skip

    def __init__(self) -> None:
        super().__init__()
        self.copies = self.uploads = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        t = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if t is not None and not t.is_meta and func is torch.Tensor.to and _target(args[1:], kwargs) == "meta":
            self.uploads += 1  # a host->device copy (synchronous unless non_blocking from pinned memory)
        if t is not None and t.is_meta:
            if func is torch.Tensor.cpu or (func is torch.Tensor.to and _targets_cpu(args[1:], kwargs)):
                self.copies += 1
                return torch.zeros(t.shape, dtype=t.dtype)
            if func in self.HOST_READS:
                raise AssertionError(f"{func.__name__} read a device tensor on the host")
        return func(*args, **kwargs)


def _target(args, kwargs) -> str | None:
    """The device type ``Tensor.to(*args, **kwargs)`` moves to (None: a dtype change alone)."""
    device = kwargs.get("device", next((a for a in args if isinstance(a, (str, torch.device))), None))
    return None if device is None else torch.device(device).type


def _targets_cpu(args, kwargs) -> bool:
    """Whether ``Tensor.to(*args, **kwargs)`` moves to the CPU."""
    return _target(args, kwargs) == "cpu"


def test_top_candidates_scores_on_the_logits_device_with_one_copy_back():
    """GPU logits and CPU beam scores: the scoring stays on the logits' device, the winners come back in one copy."""
    logits = torch.randn(3, VOCAB, device="meta")  # meta stands in for CUDA: mixing it with CPU tensors raises
    with _MetaAsDevice() as device:
        cands = beam_search.top_candidates(logits, torch.tensor([0.0, -1.0, -2.5]), 8)
    assert device.copies == 1
    assert cands.scores.device.type == "cpu" and cands.scores.dtype == torch.float32 and cands.scores.shape == (8,)
    assert len(cands.parents) == len(cands.tokens) == len(cands.logprobs) == 8


def test_top_candidates_batch_uploads_every_requests_scores_in_one_copy():
    """Several searches' CPU beam scores reach the logits' device in one host->device copy (a synchronous copy per
    search would stall the host on the device once per search per step), and their winners come back in one."""
    logits = [torch.randn(b, VOCAB, device="meta") for b in (1, 3, 2)]
    scores = [torch.zeros(1), torch.tensor([0.0, -1.0, -2.5]), torch.tensor([-0.5, -0.7])]
    with _MetaAsDevice() as device:
        found = beam_search.top_candidates_batch([(lg, s, 4) for lg, s in zip(logits, scores)])
    assert (device.uploads, device.copies) == (1, 1)
    assert [len(c.tokens) for c in found] == [4, 4, 4]


def test_top_candidates_are_the_best_continuations():
    """Candidates are the k largest beam score + token log-probability, best first, with each token's own logprob."""
    g = torch.Generator().manual_seed(3)
    logits, scores = torch.randn(3, VOCAB, generator=g), torch.tensor([0.0, -1.0, -2.5])
    cands = beam_search.top_candidates(logits, scores, 8)
    logprobs = torch.log_softmax(logits, -1)
    totals = sorted(((float(scores[b] + logprobs[b, t]), b, t) for b in range(3) for t in range(VOCAB)), reverse=True)
    assert [(b, t) for _, b, t in totals[:8]] == list(zip(cands.parents, cands.tokens))
    assert cands.scores.tolist() == pytest.approx([s for s, _, _ in totals[:8]], abs=1e-6)
    assert cands.logprobs == pytest.approx([float(logprobs[b, t]) for _, b, t in totals[:8]], abs=1e-6)


def test_one_candidate_selection_per_step_for_all_requests(tiny_hf, beam_prompts, monkeypatch):
    """Every step selects the candidates of all its ready requests together (one device->host copy per step)."""
    calls = []
    batch = beam_selection.top_candidates_batch
    counted = lambda reqs, *top: calls.append(len(reqs)) or batch(reqs, *top)  # noqa: E731
    monkeypatch.setattr(beam_selection, "top_candidates_batch", counted)
    outs = BeamSearch(make_engine(tiny_hf)).generate(beam_prompts, BeamSearchParams(width=WIDTH, max_tokens=NEW))
    assert calls[0] == len(beam_prompts)  # the first selection of every request, in one call
    assert len(calls) == max(o.num_steps for o in outs) and sum(calls) == sum(o.num_steps for o in outs)
    for prompt, out in zip(beam_prompts, outs):
        assert_same_beams(out, *hf_beams(tiny_hf, prompt))


TOP = 5


def _hf_top(hf_model, prompt, output, k):
    """``{token: logprob}`` of the ``k`` most likely tokens at each output position of ``prompt + output``
    (log_softmax of transformers' float32 logits)."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1]  # [N, V]
    values, ids = torch.log_softmax(logits.float(), -1).topk(k, dim=-1)  # [N, k]
    return [dict(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]


def _assert_tops_match(hf_model, prompt, token_ids, logprobs, tops, k):
    """Each position's top-k are transformers' for that prefix, and hold the chosen token's own logprob when in it."""
    ref = _hf_top(hf_model, prompt, token_ids, k)
    assert len(tops) == len(token_ids) and all(len(t) == k for t in tops)
    for top, want, token, lp in zip(tops, ref, token_ids, logprobs):
        assert list(top) == list(want)
        assert list(top.values()) == pytest.approx(list(want.values()), abs=1e-5)
        if token in top:
            assert top[token] == pytest.approx(lp, abs=1e-6)


def test_hypotheses_carry_top_logprobs_of_their_own_prefix(tiny_hf, beam_prompts):
    """With logprobs=k every hypothesis token has the k most likely tokens (and their logprobs) of its own prefix
    under the model, through every fork; the beams themselves are unchanged."""
    engine = make_engine(tiny_hf)
    params = BeamSearchParams(width=WIDTH, max_tokens=NEW, logprobs=TOP)
    outs = BeamSearch(engine).generate(beam_prompts, params)
    plain = BeamSearch(make_engine(tiny_hf)).generate(beam_prompts, BeamSearchParams(width=WIDTH, max_tokens=NEW))
    chosen_in_top = 0
    for prompt, out, ref in zip(beam_prompts, outs, plain):
        same = [(h.token_ids, h.logprobs) for h in ref.hypotheses]
        assert [(h.token_ids, h.logprobs) for h in out.hypotheses] == same
        for h in out.hypotheses:
            _assert_tops_match(tiny_hf, prompt, h.token_ids, h.logprobs, h.top_logprobs, TOP)
            chosen_in_top += sum(t in top for t, top in zip(h.token_ids, h.top_logprobs))
        assert all(h.top_logprobs == [] for h in ref.hypotheses)  # k=0: none
    assert chosen_in_top > 0
    assert_all_freed(engine)


def test_engine_outputs_carry_the_hypotheses_top_logprobs(tiny_hf, beam_prompts):
    """The engine's RequestOutput of a beam search has each hypothesis' top log-probabilities per token."""
    engine = make_engine(tiny_hf)
    params = BeamSearchParams(width=2, max_tokens=6, logprobs=3)
    engine.add_beam_search("b", beam_prompts[1], params)
    final = None
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step() if o.finished), final)
    hyps = BeamSearch(make_engine(tiny_hf)).generate([beam_prompts[1]], params)[0].hypotheses
    assert [(c.token_ids, c.top_logprobs) for c in final.outputs] == [(h.token_ids, h.top_logprobs) for h in hyps]
    for c in final.outputs:
        _assert_tops_match(tiny_hf, beam_prompts[1], c.token_ids, c.logprobs, c.top_logprobs, 3)


def test_logprobs_is_validated():
    """logprobs out of [0, MAX_LOGPROBS] or past the vocabulary: a typed error naming it, nothing queued."""
    for bad in (-1, 65, True, 1.5):
        with pytest.raises(PagedKVError, match="logprobs"):
            BeamSearchParams(logprobs=bad)
    engine = make_engine(tiny_llama(vocab_size=32))
    with pytest.raises(InvalidArgumentError, match="logprobs=33"):
        BeamSearch(engine).generate([[1, 2]], BeamSearchParams(width=2, max_tokens=2, logprobs=33))
    assert not engine.has_unfinished_requests()
    assert BeamSearch(engine).generate([[1, 2]], BeamSearchParams(width=2, max_tokens=2, logprobs=32))[0].hypotheses


def test_top_candidates_carry_their_parent_beams_top_logprobs_in_the_same_copy():
    """With num_top > 0 each candidate has the top log-probabilities of its parent beam's row, and the winners and
    those come back in one device->host copy; the copy stays one across requests asking for different k."""
    g = torch.Generator().manual_seed(5)
    logits, scores = torch.randn(3, VOCAB, generator=g), torch.tensor([0.0, -1.0, -2.5])
    cands = beam_search.top_candidates(logits, scores, 8, num_top=4)
    values, ids = torch.log_softmax(logits, -1).topk(4, dim=-1)
    for parent, top in zip(cands.parents, cands.top_logprobs):
        assert list(top) == ids[parent].tolist()
        assert list(top.values()) == pytest.approx(values[parent].tolist(), abs=1e-6)
    assert beam_search.top_candidates(logits, scores, 8).top_logprobs == [None] * 8
    metas = [torch.randn(b, VOCAB, device="meta") for b in (1, 3)]
    with _MetaAsDevice() as device:
        found = beam_search.top_candidates_batch([(lg, torch.zeros(lg.shape[0]), 4) for lg in metas], [0, 3])
    assert (device.uploads, device.copies) == (1, 1)
    assert found[0].top_logprobs == [None] * 4 and all(isinstance(t, dict) for t in found[1].top_logprobs)
