"""Logits controls against transformers' logits processors (and vLLM's penalty formula), on random logits, seeded."""

from __future__ import annotations

import math

import pytest
import torch
from no_host_reads import forbid_host_reads

from scheduler import SamplingParams
from scheduler.core.sequence import Sequence
from scheduler.runner.logits_processors import (
    PenaltyCounts,
    apply_min_p,
    plan_controls,
    processed_logits,
    uses_controls,
)
from scheduler.runner.sampler import Sampler, SampleRow, sample

transformers = pytest.importorskip("transformers")
VOCAB, ROWS = 50, 6


def _histories(seed: int, alphabet: int = VOCAB, rows: int = ROWS) -> list[Sequence]:
    """Random sequences (prompt 0..12 tokens, 0..15 outputs) over ids below ``alphabet``, seeded."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(rows):
        n_prompt, n_out = (int(x) for x in torch.randint(0, 13, (2,), generator=g))
        seq = Sequence(i, 0, torch.randint(0, alphabet, (n_prompt,), generator=g).tolist())
        seq.token_ids += torch.randint(0, alphabet, (n_out + 3 * (i % 2),), generator=g).tolist()
        out.append(seq)
    return out


def _logits(seed: int, rows: int = ROWS) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _row_ids(seq: Sequence) -> torch.Tensor:
    return torch.tensor([seq.token_ids], dtype=torch.int64).reshape(1, -1)


@pytest.mark.parametrize("seed", range(3))
def test_repetition_penalty_equals_transformers(seed):
    logits, hist = _logits(seed), _histories(seed)
    penalties = [1.0, 1.3, 0.7, 2.0, 1.1, 0.5]
    params = [SamplingParams(repetition_penalty=r) for r in penalties]
    ours = processed_logits(logits, params, hist)
    for i, (r, h) in enumerate(zip(penalties, hist)):
        ref = transformers.RepetitionPenaltyLogitsProcessor(r)(_row_ids(h), logits[i : i + 1].clone())
        torch.testing.assert_close(ours[i], ref[0], rtol=0, atol=0)


@pytest.mark.parametrize("seed", range(3))
def test_min_tokens_equals_transformers_min_length_processors(seed):
    logits, hist, eos = _logits(seed), _histories(seed), frozenset({3, 7})
    params = [SamplingParams(min_tokens=m, max_tokens=40, stop_token_ids=(11,)) for m in (0, 1, 5, 9, 16, 30)]
    ours = processed_logits(logits, params, hist, eos)
    blocked = 0
    for i, (p, h) in enumerate(zip(params, hist)):
        ids = _row_ids(h)
        new = transformers.MinNewTokensLengthLogitsProcessor(h.prompt_len, p.min_tokens, [3, 7, 11])
        by_length = transformers.MinLengthLogitsProcessor(h.prompt_len + p.min_tokens, [3, 7, 11])
        torch.testing.assert_close(ours[i], new(ids, logits[i : i + 1].clone())[0], rtol=0, atol=0)
        torch.testing.assert_close(ours[i], by_length(ids, logits[i : i + 1].clone())[0], rtol=0, atol=0)
        blocked += int(torch.isinf(ours[i]).sum())
    assert blocked >= 3  # some rows were below their minimum


@pytest.mark.parametrize("seed", range(3))
def test_bad_words_equal_transformers_over_the_output(seed):
    # vLLM matches a bad word's prefix against the output only: with no prompt, that is transformers' input_ids
    logits, hist = _logits(seed), _histories(seed, alphabet=4)
    for h in hist:
        h.prompt_len = 0
    words = [(2,), (0, 1), (1, 1, 3), (3, 2, 0, 1), (7, 9)]
    params = [SamplingParams(bad_words_token_ids=words)] * ROWS
    ours = processed_logits(logits, params, hist)
    ref = transformers.NoBadWordsLogitsProcessor([list(w) for w in words])
    for i, h in enumerate(hist):
        torch.testing.assert_close(ours[i], ref(_row_ids(h), logits[i : i + 1].clone())[0], rtol=0, atol=0)
    assert int(torch.isinf(ours).sum()) > ROWS  # multi-token words matched somewhere


def test_bad_words_do_not_match_across_the_prompt():
    seq = Sequence(0, 0, [5, 6])  # the prompt ends with the word's prefix; no output yet
    out = processed_logits(_logits(0, 1), [SamplingParams(bad_words_token_ids=[(6, 9)])], [seq])
    assert torch.isfinite(out).all()
    seq.token_ids += [6]
    assert processed_logits(_logits(0, 1), [SamplingParams(bad_words_token_ids=[(6, 9)])], [seq])[0, 9] == -math.inf


@pytest.mark.parametrize("seed", range(3))
def test_logit_bias_equals_transformers_sequence_bias(seed):
    logits, hist = _logits(seed), _histories(seed)
    g = torch.Generator().manual_seed(seed)
    pick = lambda: zip(torch.randperm(VOCAB, generator=g)[:5], torch.rand(5, generator=g) * 200 - 100)  # noqa: E731
    biases = [{int(t): float(b) for t, b in pick()} for _ in range(ROWS)]
    biases[2] = {}
    ours = processed_logits(logits, [SamplingParams(logit_bias=b) for b in biases], hist)
    for i, b in enumerate(biases):
        ref = logits[i : i + 1].clone()
        if b:
            ref = transformers.SequenceBiasLogitsProcessor([[[t], v] for t, v in b.items()])(_row_ids(hist[i]), ref)
        torch.testing.assert_close(ours[i], ref[0])


@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.2, 0.7, 1.0])
def test_min_p_equals_transformers_min_p_warper(min_p):
    scaled = _logits(5) / 0.7
    ours = apply_min_p(scaled - scaled.amax(-1, keepdim=True), torch.full((ROWS,), min_p))
    ref = transformers.MinPLogitsWarper(min_p)(None, scaled.clone()) if min_p else scaled
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    torch.testing.assert_close(ours.softmax(-1), ref.softmax(-1))


def _vllm_penalties(logits, prompts, outputs, rep, freq, pres):
    """vLLM's formula: bin counts of padded prompts / outputs, repetition over either, then frequency, presence."""
    r, v = logits.shape

    def bins(lists):
        width = max(1, max(map(len, lists)))
        padded = torch.tensor([x + [v] * (width - len(x)) for x in lists])  # pad id: vocab
        return torch.zeros(r, v + 1, dtype=torch.long).scatter_add_(1, padded, torch.ones_like(padded))[:, :v]

    out_counts, seen = bins(outputs), (bins(prompts) > 0) | (bins(outputs) > 0)
    rep = rep[:, None].expand(-1, v)
    logits = torch.where(seen & (logits > 0), logits / rep, logits)
    logits = torch.where(seen & (logits <= 0), logits * rep, logits)
    return logits - freq[:, None] * out_counts - pres[:, None] * (out_counts > 0)


@pytest.mark.parametrize("seed", range(3))
def test_presence_and_frequency_follow_the_direct_formula_and_vllms(seed):
    logits, hist = _logits(seed), _histories(seed, alphabet=10)
    g = torch.Generator().manual_seed(seed)
    freq, pres = torch.rand(ROWS, generator=g) * 4 - 2, torch.rand(ROWS, generator=g) * 4 - 2
    rep = torch.tensor([1.0, 1.5, 1.0, 0.8, 1.2, 1.0])
    params = [SamplingParams(frequency_penalty=float(f), presence_penalty=float(p), repetition_penalty=float(r))
              for f, p, r in zip(freq, pres, rep)]  # fmt: skip
    ours = processed_logits(logits, params, hist)
    direct = logits.clone()
    for i, h in enumerate(hist):  # token by token: count, then subtract
        outputs = h.token_ids[h.prompt_len :]
        for t in range(VOCAB):
            if t in h.token_ids:
                x = direct[i, t]
                direct[i, t] = x / rep[i] if x > 0 else x * rep[i]
            direct[i, t] -= float(freq[i]) * outputs.count(t) + float(pres[i]) * (t in outputs)
    torch.testing.assert_close(ours, direct)
    prompts = [h.token_ids[: h.prompt_len] for h in hist]
    vllm = _vllm_penalties(logits, prompts, [h.token_ids[h.prompt_len :] for h in hist], rep, freq, pres)
    torch.testing.assert_close(ours, vllm)


def test_every_control_in_one_batch_leaves_neutral_rows_untouched():
    logits, hist = _logits(9, 5), _histories(9, rows=5)
    params = [
        SamplingParams(), SamplingParams(allowed_token_ids=[1, 4, 9], logit_bias={4: 5.0, 20: 1.0}),
        SamplingParams(temperature=1.0),
        SamplingParams(repetition_penalty=1.4, bad_words_token_ids=[(3,)], min_tokens=40, max_tokens=50),
        SamplingParams(presence_penalty=1.0, logit_bias={0: -100.0}),
    ]  # fmt: skip
    ours = processed_logits(logits, params, hist, frozenset({2}))
    assert torch.equal(ours[0], logits[0]) and torch.equal(ours[2], logits[2])
    assert torch.isfinite(ours[1]).sum() == 3 and ours[1, 4] == logits[1, 4] + 5.0
    assert ours[3, 3] == -math.inf and ours[3, 2] == -math.inf
    assert ours[4, 0] <= logits[4, 0] - 99.0
    assert [uses_controls(p) for p in params] == [False, True, False, True, True]


def test_a_step_without_controls_builds_nothing():
    counts = PenaltyCounts(VOCAB, torch.device("cpu"))
    params = [SamplingParams(), SamplingParams(temperature=0.8, top_k=5, min_p=0.1, seed=-3)]
    assert plan_controls(params, _histories(0, rows=2), counts) is None
    assert counts.num_slots == 0


def test_controls_read_nothing_on_the_host():
    logits, hist = _logits(3), _histories(3)
    params = [SamplingParams(repetition_penalty=1.2, frequency_penalty=0.5, allowed_token_ids=[1, 2, 3]),
              SamplingParams(logit_bias={1: 3.0}, bad_words_token_ids=[(1, 2)], min_tokens=30, max_tokens=40)] * 3
    counts = PenaltyCounts(VOCAB, torch.device("cpu"))
    with forbid_host_reads():
        controls = plan_controls(params, hist, counts, frozenset({4}))
        out = controls.apply(logits.clone(), counts)
        tokens = apply_min_p(out - out.amax(-1, keepdim=True), torch.full((ROWS,), 0.1)).argmax(-1)
        counts.record(controls.slots, controls.slots_t, tokens[controls.penalized])
    torch.testing.assert_close(out, processed_logits(logits, params, hist, frozenset({4})))


def test_kept_counts_equal_counts_rebuilt_each_step():
    # the engine's sampler keeps each sequence's counts on the device; a fresh one rebuilds them
    hist = _histories(4)
    params = [SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2,
                             temperature=1.0)] * ROWS  # fmt: skip
    kept = Sampler(VOCAB, torch.device("cpu"))
    for step in range(6):
        logits = _logits(100 + step)
        if step == 3:  # a sequence recomputed or replaced under the same id: out of step, rebuilt
            hist[1].token_ids[hist[1].prompt_len :] = [5, 5]
        gens = [torch.Generator().manual_seed(step * 10 + i) for i in range(ROWS)]
        ref_gens = [torch.Generator().manual_seed(step * 10 + i) for i in range(ROWS)]
        got = kept(logits, [SampleRow(p, g, h) for p, g, h in zip(params, gens, hist)])
        want = sample(logits, params, ref_gens, hist)
        assert got.token_ids == want.token_ids
        for h, t in zip(hist, got.token_ids):
            h.token_ids.append(t)
    assert ROWS <= kept.counts.num_slots < 2 * ROWS  # rows double as they grow
    for h in hist:
        outputs = torch.tensor(h.token_ids[h.prompt_len :], dtype=torch.int64)
        row = kept.counts.counts[kept.counts.slot_of(h.seq_id), :VOCAB]
        assert torch.equal(row, torch.bincount(outputs, minlength=VOCAB).float())


def test_slots_are_reused_least_recently_used_first():
    counts = PenaltyCounts(VOCAB, torch.device("cpu"))
    a, b, c = (Sequence(i, 0, [1, 2]) for i in range(3))
    assert counts.assign([a, b]) == ([0, 1], [0, 1])
    assert counts.assign([a]) == ([0], [])  # in step: kept
    assert counts.assign([c]) == ([1], [0])  # b's slot was used least recently
    assert counts.assign([b, c, a]) == ([0, 1, 2], [0, 2])  # a's slot went to b; a gets a new row
    assert counts.num_slots == 4


def test_counts_planned_but_never_applied_are_rebuilt_next_step():
    counts, seq = PenaltyCounts(VOCAB, torch.device("cpu")), Sequence(0, 0, [1, 2])
    seq.token_ids += [3, 3]
    params, logits = [SamplingParams(frequency_penalty=1.0, repetition_penalty=1.5)], _logits(2, 1)
    assert plan_controls(params, [seq], counts).rebuild is not None  # the step fails before its controls run
    again = plan_controls(params, [seq], counts)
    assert again.rebuild is not None
    torch.testing.assert_close(again.apply(logits.clone(), counts), processed_logits(logits, params, [seq]))
    assert plan_controls(params, [seq], counts).rebuild is None  # applied: kept from now on
