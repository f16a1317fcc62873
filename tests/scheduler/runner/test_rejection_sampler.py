"""Draft verification: greedy acceptance is the argmax chain; the rejection rule emits the target distribution."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from scheduler import SamplingParams
from scheduler.runner.logits_processors import PenaltyCounts, processed_logits
from scheduler.runner.rejection_sampler import DraftRows, reject, verify
from scheduler.runner.sampler import processed_probs

GREEDY = SamplingParams(max_tokens=8)


def test_greedy_accepts_while_the_argmax_agrees_then_emits_the_argmax():
    # rows: argmax 3, 1, 2, then bonus argmax 0
    logits = torch.full((4, 5), -1.0)
    for row, best in enumerate((3, 1, 2, 0)):
        logits[row, best] = 5.0
    all_kept, first_wrong, second_wrong = verify(logits.repeat(3, 1), [
        DraftRows(GREEDY, None, (3, 1, 2)), DraftRows(GREEDY, None, (4, 1, 2)), DraftRows(GREEDY, None, (3, 0, 2)),
    ])  # fmt: skip
    assert (all_kept.num_accepted, all_kept.token_ids) == (3, [3, 1, 2, 0])  # the bonus token last
    assert (first_wrong.num_accepted, first_wrong.token_ids) == (0, [3])
    assert (second_wrong.num_accepted, second_wrong.token_ids) == (1, [3, 1])
    assert all_kept.top_logprobs == [None] * 4 and all_kept.ranks == [1, 1, 1, 1]
    lp = torch.log_softmax(logits, dim=-1)
    assert all_kept.logprobs == pytest.approx([lp[r, t].item() for r, t in enumerate((3, 1, 2, 0))], abs=1e-6)


def test_logprobs_are_the_raw_ones_of_each_emitted_token():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.5]])
    (v,) = verify(logits, [DraftRows(SamplingParams(logprobs=2), None, (1,))])
    lp = torch.log_softmax(logits, dim=-1)
    assert v.token_ids == [1, 0]
    assert v.top_logprobs[0] == pytest.approx({1: lp[0, 1].item(), 2: lp[0, 2].item()})
    assert v.top_logprobs[1] == pytest.approx({0: lp[1, 0].item(), 2: lp[1, 2].item()})


def _emitted_first_token(logits: torch.Tensor, params: SamplingParams, draft: int, draws: int) -> torch.Tensor:
    """The first token emitted after one draft, over ``draws`` verifications (one batch: row i is draw i)."""
    rows = logits[None, :].expand(draws, -1)
    top_k = torch.full((draws,), params.top_k, dtype=torch.int64)
    tokens, _ = reject(rows, [params] * draws, top_k, torch.full((draws,), draft), [None] * draws)
    return tokens


def _total_variation(logits: torch.Tensor, params: SamplingParams, draft: int, draws: int = 40_000) -> float:
    """Total variation distance between the emitted tokens' frequencies and the target distribution."""
    target = processed_probs(logits[None], [params], torch.tensor([params.top_k]))[0].double()  # [V]
    counts = torch.bincount(_emitted_first_token(logits, params, draft, draws), minlength=len(logits)).double()
    return 0.5 * (counts / draws - target).abs().sum().item()


LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0])
BOUND = 0.015  # 40k draws over 8 tokens: the sampling noise of the distance is about 0.005


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4), SamplingParams(temperature=1.3,
    top_p=0.8), SamplingParams(temperature=1.0, min_p=0.1),
], ids=["plain", "top_k", "top_p", "min_p"])  # fmt: skip
@pytest.mark.parametrize("draft", [0, 2, 5])  # the most likely token, a middling one, one outside top-k
def test_emitted_tokens_follow_the_target_distribution(params, draft):
    torch.manual_seed(1234)
    assert _total_variation(LOGITS, params, draft) < BOUND


@pytest.mark.parametrize("u", [0.0, 1.0], ids=["always_accepts", "never_accepts"])
def test_a_wrong_acceptance_rule_fails_the_bound(monkeypatch, u):
    """The bound catches a sampler that keeps every draft, or one that always resamples without the draft."""
    import scheduler.runner.rejection_sampler as rs

    monkeypatch.setattr(rs, "uniform_noise", lambda like, gens: torch.full(like.shape, u))
    torch.manual_seed(1234)
    assert _total_variation(LOGITS, SamplingParams(temperature=1.0), 1) > 10 * BOUND


def test_seeded_generators_make_verification_reproducible():
    logits = torch.randn(3, 16, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0, seed=7)

    def run():
        gen = torch.Generator().manual_seed(7)
        return [verify(logits, [DraftRows(params, gen, (1, 2))])[0].token_ids for _ in range(20)]

    assert run() == run()
    assert len({tuple(t) for t in run()}) > 1  # the draws differ from one verification to the next


def test_a_certain_draft_is_always_accepted_and_an_impossible_one_never():
    logits = torch.tensor([[50.0, 0.0, 0.0], [0.0, 0.0, 50.0], [0.0, 50.0, 0.0]])
    params = SamplingParams(temperature=1.0)
    kept = verify(logits, [DraftRows(params, None, (0, 2))])[0]
    assert (kept.num_accepted, kept.token_ids) == (2, [0, 2, 1])
    top = SamplingParams(temperature=1.0, top_k=1)
    refused = verify(logits, [DraftRows(top, None, (1, 2))])[0]  # token 1 is outside row 0's top-1
    assert (refused.num_accepted, refused.token_ids) == (0, [0])


# -- logits controls: row j is processed as the one-token path processes that position ---------------------------

PROMPT, OUTPUTS = [1, 2, 5], [4]


def _history(seq_id: int, outputs: list[int]) -> SimpleNamespace:
    """A sequence's tokens: the prompt, then ``outputs``."""
    return SimpleNamespace(seq_id=seq_id, token_ids=PROMPT + outputs, prompt_len=len(PROMPT))


def _one_token_chain(logits: torch.Tensor, params: SamplingParams, drafts: tuple[int, ...]) -> list[int]:
    """The greedy tokens one token per step would emit: row j processed with the drafts before it as outputs."""
    emitted = []
    for j, row in enumerate(logits):
        processed = processed_logits(row[None], [params], [_history(0, OUTPUTS + list(drafts[:j]))])
        emitted.append(int(processed.argmax()))
        if j == len(drafts) or emitted[-1] != drafts[j]:
            return emitted
    return emitted


def _chain_logits() -> torch.Tensor:
    """Rows whose raw argmax is the drafts 3, 3, 7 then 5, each with a close runner-up (token 6)."""
    logits = torch.zeros(4, 12)
    for row, best in enumerate((3, 3, 7, 5)):
        logits[row, best], logits[row, 6] = 5.0, 4.5
    return logits


@pytest.mark.parametrize("params", [
    SamplingParams(presence_penalty=1.0), SamplingParams(frequency_penalty=1.0),
    SamplingParams(repetition_penalty=1.5), SamplingParams(bad_words_token_ids=((3, 3),)),
    SamplingParams(bad_words_token_ids=((4, 3, 3),)), SamplingParams(min_tokens=3, stop_token_ids=(7,)),
    SamplingParams(max_tokens=8, min_tokens=3, stop_token_ids=(7,), logit_bias={6: 0.2}, allowed_token_ids=[3, 6, 7]),
], ids=["presence", "frequency", "repetition", "bad_words", "bad_words_3", "min_tokens", "mixed"])  # fmt: skip
def test_greedy_rows_are_processed_with_the_drafts_before_them(params):
    logits, drafts = _chain_logits(), (3, 3, 7)
    (v,) = verify(logits, [DraftRows(params, None, drafts, _history(0, OUTPUTS))], PenaltyCounts(12, logits.device))
    assert v.token_ids == _one_token_chain(logits, params, drafts)
    # the drafts before a row change its tokens here: a verification that ignored them would differ
    ignoring = [int(processed_logits(r[None], [params], [_history(0, OUTPUTS)]).argmax()) for r in logits]
    assert v.token_ids != ignoring[: len(v.token_ids)]


def test_penalty_counts_count_the_emitted_tokens_and_the_next_step_reuses_them():
    """After a verification the sequence's slot counts its accepted drafts and the token after them (not the
    rejected rows'): the next step's rows are the one-token path's without a rebuild."""
    params, logits, drafts = SamplingParams(frequency_penalty=1.0), _chain_logits(), (3, 3, 7)
    counts = PenaltyCounts(12, logits.device)
    history = _history(5, list(OUTPUTS))
    (v,) = verify(logits, [DraftRows(params, None, drafts, history)], counts)
    assert v.num_accepted == 1 and v.token_ids == [3, 6]  # row 1: 3 has 5.0 - 1.0 (counted once), 6 has 4.5
    slot = counts.slot_of(5)
    assert counts.counts[slot, :12].tolist() == torch.bincount(torch.tensor(OUTPUTS + v.token_ids),
                                                               minlength=12).float().tolist()  # fmt: skip
    history.token_ids += v.token_ids
    assert counts.assign([history]) == ([slot], [])  # in step: no rebuild


def _emitted_after_one_accepted(params: SamplingParams, row: torch.Tensor, draft: int, draws: int) -> torch.Tensor:
    """The token emitted at the second position over ``draws`` sequences (one batch) whose first draft 0 is always
    accepted: row 0 makes it certain, row 1 is ``row``."""
    first = torch.full_like(row, -50.0)
    first[0] = 50.0
    logits = torch.stack([first, row, row]).repeat(draws, 1)  # per sequence: draft rows 0, 1, then the bonus row
    history = _history(0, OUTPUTS)  # one sequence verified ``draws`` times at once: its rows share its slot
    seqs = [DraftRows(params, None, (0, draft), history)] * draws
    verdicts = verify(logits, seqs, PenaltyCounts(len(row), logits.device))
    assert all(v.num_accepted >= 1 for v in verdicts)
    return torch.tensor([v.token_ids[1] for v in verdicts])


@pytest.mark.parametrize("draft", [0, 2])  # the penalized token (the raw most likely one), another
def test_a_penalized_draft_row_after_an_accepted_draft_follows_the_one_token_distribution(draft):
    params = SamplingParams(temperature=1.0, repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.3)
    target = processed_probs(processed_logits(LOGITS[None], [params], [_history(0, OUTPUTS + [0])]), [params],
                             torch.tensor([0]))[0].double()  # fmt: skip
    unpenalized = processed_probs(processed_logits(LOGITS[None], [params], [_history(0, OUTPUTS)]), [params],
                                  torch.tensor([0]))[0].double()  # fmt: skip
    assert 0.5 * (target - unpenalized).abs().sum().item() > 10 * BOUND  # the accepted draft changes this row
    torch.manual_seed(1234)
    draws = 40_000
    counts = torch.bincount(_emitted_after_one_accepted(params, LOGITS, draft, draws), minlength=len(LOGITS))
    assert 0.5 * (counts.double() / draws - target).abs().sum().item() < BOUND
