"""The sampler: greedy, temperature, top-k, top-p, per-row generators, log-probabilities."""

from __future__ import annotations

import math

import pytest
import torch

from scheduler import SamplingParams
from scheduler.runner.logits_processors import empty_histories
from scheduler.runner.sampler import PromptRows, Sampler, SampleRow, apply_top_k_top_p, sample

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])


def _draw(params: SamplingParams, rows: int = 20_000, seed: int = 0) -> torch.Tensor:
    """Token counts of ``rows`` draws from PROBS (one row per draw, the global generator seeded)."""
    torch.manual_seed(seed)
    logits = PROBS.log().expand(rows, -1).clone()
    tokens = sample(logits, [params] * rows, [None] * rows).token_ids
    return torch.bincount(torch.tensor(tokens), minlength=4).float() / rows


def test_greedy_rows_take_the_argmax_beside_random_rows():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    params = [SamplingParams(), SamplingParams(temperature=1.0)] * 3
    result = sample(logits, params, [None] * 6)
    assert [result.token_ids[i] for i in (0, 2, 4)] == logits.argmax(-1)[::2].tolist()
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(result.token_ids)[:, None])[:, 0]
    assert result.logprobs == pytest.approx(expected.tolist())
    assert result.top_logprobs == [None] * 6


def test_temperature_one_follows_the_distribution():
    freq = _draw(SamplingParams(temperature=1.0))
    assert torch.allclose(freq, PROBS, atol=0.015)


def test_low_temperature_sharpens_and_top_k_one_is_greedy():
    sharp = _draw(SamplingParams(temperature=0.25))
    expected = PROBS**4 / (PROBS**4).sum()
    assert torch.allclose(sharp, expected, atol=0.015)
    assert _draw(SamplingParams(temperature=2.0, top_k=1), rows=500).tolist() == [1.0, 0.0, 0.0, 0.0]


FILTERS = [(2, 1.0, 2), (3, 1.0, 3), (0, 0.7, 2), (0, 0.85, 3), (0, 0.5, 1), (2, 0.9, 2)]  # (top_k, top_p, kept)


@pytest.mark.parametrize("top_k, top_p, kept", FILTERS)
def test_top_k_and_top_p_renormalize_over_the_kept_tokens(top_k, top_p, kept):
    freq = _draw(SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p))
    expected = torch.cat([PROBS[:kept] / PROBS[:kept].sum(), torch.zeros(4 - kept)])
    assert torch.allclose(freq, expected, atol=0.015)


def test_filters_leave_rows_without_them_untouched():
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(0))
    out = apply_top_k_top_p(logits, torch.tensor([0, 3, 0]), torch.tensor([1.0, 1.0, 0.5]))
    assert torch.equal(out[0], logits[0])
    assert (out[1] > -math.inf).sum() == 3 and torch.equal(out[1].topk(3).indices, logits[1].topk(3).indices)
    assert 1 <= (out[2] > -math.inf).sum() < 10


def test_top_k_keeps_every_logit_tied_with_the_kth_as_transformers_does():
    from transformers.generation.logits_process import TopKLogitsWarper

    logits = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0, 0.5], [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    out = apply_top_k_top_p(logits, torch.tensor([2, 1]), torch.tensor([1.0, 1.0]))
    for row, k in enumerate((2, 1)):
        oracle = TopKLogitsWarper(top_k=k)(None, logits[row : row + 1].clone())[0]
        assert torch.equal(out[row], oracle)
    assert (out[0] > -math.inf).tolist() == [True, True, True, True, False, False]


def test_seeded_rows_do_not_depend_on_their_neighbours():
    logits = torch.randn(5, 100, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=1.0)] * 5

    def run(seeded_row: int, batch: torch.Tensor) -> int:
        gens = [None] * len(batch)
        gens[seeded_row] = torch.Generator().manual_seed(42)
        return sample(batch, params[: len(batch)], gens).token_ids[seeded_row]

    alone = [run(0, logits[i : i + 1]) for i in range(5)]
    torch.manual_seed(99)  # the unseeded rows' draws must not matter
    in_batch = [run(i, logits) for i in range(5)]
    assert alone == in_batch


def test_top_logprobs_report_the_raw_distribution():
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0]])
    result = sample(logits, [SamplingParams(logprobs=2, temperature=5.0, top_k=1)], [None])
    lp = torch.log_softmax(logits, -1)[0]
    assert result.top_logprobs[0] == pytest.approx({0: lp[0].item(), 2: lp[2].item()})
    assert result.token_ids == [0] and result.logprobs[0] == pytest.approx(lp[0].item())


def _vocab_rank(logits: torch.Tensor, tokens: list[int]) -> list[int]:
    """vLLM's rank of each row's token: how many tokens of the row have a logit at least its own."""
    picked = logits.gather(1, torch.tensor(tokens)[:, None])
    return (logits >= picked).sum(-1).tolist()


def test_sampled_and_prompt_tokens_carry_their_rank_in_the_whole_vocabulary():
    """Ranks past the top k too, for any logprobs asked (0 included), on the raw logits; a tie counts against."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 50, generator=g)
    logits[1, 7] = logits[1].max()  # a tie at the top
    params = [SamplingParams(temperature=1.0, seed=1, logprobs=k % 3) for k in range(6)]
    params[1] = SamplingParams(logprobs=1)  # greedy over the tie
    gens = [torch.Generator().manual_seed(i) for i in range(6)]
    prompt_logits = torch.randn(5, 50, generator=g)
    targets = torch.randint(0, 50, (5,), generator=g).tolist()
    result = Sampler(50, torch.device("cpu"))(
        logits, [SampleRow(p, gen, h) for p, gen, h in zip(params, gens, empty_histories(6))], prompt_logits,
        PromptRows(targets, [0, 1, 2, 0, 3]),
    )  # fmt: skip
    assert result.ranks == _vocab_rank(logits, result.token_ids)
    assert result.ranks[1] == 2 and max(result.ranks) > 3  # ranks well past the top ones were drawn
    assert result.prompt_ranks == _vocab_rank(prompt_logits, targets)
    assert max(result.prompt_ranks) > 3
