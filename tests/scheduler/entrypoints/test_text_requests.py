"""A request's text across engine steps: multi-byte characters split over tokens, stop strings spanning tokens,
``include_stop_str_in_output`` and ``skip_special_tokens``, as the streamed deltas and the final text show them.

The engine is left out: :class:`TextRequest` is fed snapshots of a sample's growing token list, as the
output processor feeds it after each step, in chunks of one to three tokens.
"""

from __future__ import annotations

import random

import pytest
from text_helpers import tiny_tokenizer

from scheduler.core.outputs import CompletionOutput, RequestOutput
from scheduler.core.params import SamplingParams
from scheduler.entrypoints.detokenizer import REPLACEMENT
from scheduler.entrypoints.output_processor import TextRequest

TEXTS = ["héllo 日本 😀 wörld the fox", "naïve café €100 → done", "stop here. and there. 😀😀 end",
         "ab ab abc abcd"]
PROMPT = [5, 6]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def _snapshot(ids: list[int], finish_reason: str | None) -> RequestOutput:
    sample = CompletionOutput(index=0, token_ids=list(ids), finish_reason=finish_reason, cumulative_logprob=0.0,
                              logprobs=[0.0] * len(ids), top_logprobs=[{}] * len(ids))  # fmt: skip
    return RequestOutput(request_id="r", prompt_token_ids=PROMPT, outputs=[sample], finished=finish_reason is not None,
                         arrival_time=0.0, first_token_time=None, finish_time=None, num_preemptions=0)  # fmt: skip


def _run(tok, ids: list[int], params: SamplingParams, cuts: list[int], last_reason: str = "length"):
    """Feed ``ids`` in the chunks ending at ``cuts``; (every delta's text, the final text, its finish and stop)."""
    req = TextRequest("r", PROMPT, params, tok, eos_token_ids=frozenset({tok.eos_token_id}))
    pieces = []
    for i in cuts:
        for d in req.update(_snapshot(ids[:i], last_reason if i == len(ids) else None)):
            pieces.append(d.text)
            if d.finish_reason:
                (out,) = req.result().outputs
                return pieces, out.text, out.finish_reason, out.stop_reason
    raise AssertionError("the sample never finished")


def _expected(tok, ids: list[int], cuts: list[int], stops: list[str], keep: bool) -> tuple[str, str | None]:
    """The text a stream shows: after each chunk the decode so far (unchanged while it ends inside a
    character), cut at the earliest stop string in it (before it, or after it when ``keep``): a stop
    string that a chunk completes wins over one that a later chunk would complete earlier in the text."""
    visible = ""
    for i in cuts:
        text = tok.decode(ids[:i], clean_up_tokenization_spaces=False)
        visible = visible if text.endswith(REPLACEMENT) else text
        hits = sorted((visible.find(s), k, s) for k, s in enumerate(stops) if s in visible)
        if hits:  # the earliest; of two at one place, the first listed
            at, _, stop = hits[0]
            return visible[: at + len(stop) * keep], stop
    return visible, None


@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_streamed_text_is_the_final_text_whole_characters_cut_at_stop_strings_spanning_tokens(tok, seed, keep):
    rng = random.Random(seed)
    for _ in range(150):
        text = rng.choice(TEXTS)
        ids = tok.encode(text)
        stops = []
        for _ in range(rng.randint(1, 3)):  # substrings of the text: most span several tokens
            a = rng.randrange(len(text))
            stops.append(text[a : a + rng.randint(1, 6)])
        cuts, i = [], 0
        while i < len(ids):
            i = min(len(ids), i + rng.randint(1, 3))
            cuts.append(i)
        params = SamplingParams(max_tokens=len(ids), stop=tuple(stops), include_stop_str_in_output=keep)
        pieces, final, reason, stop_reason = _run(tok, ids, params, cuts)
        want, stop = _expected(tok, ids, cuts, stops, keep)
        case = (text, stops, cuts, pieces)
        assert (final, stop_reason) == (want, stop), case
        assert reason == ("stop" if stop else "length"), case
        assert "".join(pieces) == final, case  # no fragment of a stop string went out before it was known
        assert not any(REPLACEMENT in p for p in pieces), case  # a split character goes out whole


def test_a_multi_byte_character_over_three_tokens_goes_out_in_one_piece(tok):
    ids = tok.encode("a€b")  # "€" is three bytes the tiny vocabulary does not merge
    assert sum(REPLACEMENT in tok.decode([t]) for t in ids) >= 2
    pieces, final, _, _ = _run(tok, ids, SamplingParams(max_tokens=len(ids)), list(range(1, len(ids) + 1)))
    assert final == "a€b" and "€" in "".join(p for p in pieces if p and not p.isascii())
    assert all(p == "" or REPLACEMENT not in p for p in pieces)


def test_include_stop_str_in_output_keeps_the_stop_and_the_stop_tokens_text(tok):
    ids = tok.encode("hello world") + [tok.eos_token_id]
    cuts = list(range(1, len(ids) + 1))
    default = _run(tok, ids, SamplingParams(max_tokens=20), cuts, last_reason="stop")
    assert default[1:] == ("hello world", "stop", None)  # EOS: no text, no stop reason
    shown = _run(tok, ids, SamplingParams(max_tokens=20, include_stop_str_in_output=True, skip_special_tokens=False),
                 cuts, last_reason="stop")  # fmt: skip
    assert shown[1:] == ("hello world<|im_end|>", "stop", None)
    # a stop token id's text is kept as vLLM keeps it (and it is the stop reason)
    stop_id = tok.encode(" world")[-1]
    ids = tok.encode("hello world")
    assert ids[-1] == stop_id
    kept = _run(tok, ids, SamplingParams(max_tokens=20, stop_token_ids=(stop_id,), include_stop_str_in_output=True),
                cuts[: len(ids)], last_reason="stop")  # fmt: skip
    cut = _run(tok, ids, SamplingParams(max_tokens=20, stop_token_ids=(stop_id,)), cuts[: len(ids)], last_reason="stop")
    assert kept[1] == "hello world" and cut[1] == tok.decode(ids[:-1]) and kept[3] == cut[3] == stop_id
    # a stop string: cut after it, the rest of its token dropped
    params = SamplingParams(max_tokens=20, stop=("lo w",), include_stop_str_in_output=True)
    incl = _run(tok, tok.encode("hello world"), params, cuts[: len(ids)])
    assert incl[1:] == ("hello w", "stop", "lo w")


def test_skip_special_tokens_false_shows_special_tokens_in_the_text(tok):
    ids = tok.encode("hi") + [tok.convert_tokens_to_ids("<|im_start|>")] + tok.encode("there")
    cuts = list(range(1, len(ids) + 1))
    assert _run(tok, ids, SamplingParams(max_tokens=20), cuts)[1] == "hithere"
    assert _run(tok, ids, SamplingParams(max_tokens=20, skip_special_tokens=False), cuts)[1] == "hi<|im_start|>there"
