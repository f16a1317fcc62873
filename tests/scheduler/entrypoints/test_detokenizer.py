"""Incremental detokenization equals the full decode; stop strings are found and held back across deltas."""

from __future__ import annotations

import random

import pytest
from text_helpers import tiny_tokenizer

from scheduler.entrypoints.detokenizer import REPLACEMENT, IncrementalDetokenizer, find_stop, holdback


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def _stream(tok, ids, **kw) -> list[str]:
    detok = IncrementalDetokenizer(tok, **kw)
    pieces = [detok.add([t]) for t in ids]
    return pieces + [detok.flush()]


def test_multibyte_characters_split_across_tokens_come_out_whole(tok):
    text = "héllo 日本 😀 wörld the fox"
    ids = tok.encode(text)
    assert any(REPLACEMENT in tok.decode([t]) for t in ids)  # the tokenizer really splits characters
    pieces = _stream(tok, ids)
    assert "".join(pieces) == text
    assert not any(REPLACEMENT in p for p in pieces)
    assert "😀" in pieces  # the 4-byte emoji arrives as one delta once its last byte is in


@pytest.mark.parametrize("seed", range(5))
def test_random_token_sequences_equal_the_full_decode(tok, seed):
    rng = random.Random(seed)
    ids = [rng.randrange(len(tok)) for _ in range(60)]
    for skip in (True, False):
        full = tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
        assert "".join(_stream(tok, ids, skip_special_tokens=skip)) == full


@pytest.mark.parametrize("seed", range(3))
def test_chunks_of_several_tokens_and_prompt_context(tok, seed):
    rng = random.Random(100 + seed)
    prompt = tok.encode("hello world")
    ids = [rng.randrange(3, len(tok)) for _ in range(40)]
    detok = IncrementalDetokenizer(tok, prompt)
    out, i = [], 0
    while i < len(ids):
        k = rng.randint(1, 4)
        out.append(detok.add(ids[i : i + k]))
        i += k
    out.append(detok.flush())
    assert "".join(out) == tok.decode(ids, clean_up_tokenization_spaces=False)


def test_find_stop_reports_the_earliest_stop_ending_in_new_text():
    assert find_stop("abc STOP x", 0, ["STOP", "x"]) == (4, "STOP")
    assert find_stop("abc STOP x", 6, ["STOP"]) == (4, "STOP")  # straddles the old / new boundary
    assert find_stop("abc STOP x", 8, ["STOP"]) is None  # already seen before
    assert find_stop("abc", 0, ["zz"]) is None


def test_holdback_keeps_only_a_tail_that_may_become_a_stop():
    assert holdback("hello wor", ["world"]) == 3
    assert holdback("hello", ["world"]) == 0
    assert holdback("ab", ["abc", "bx"]) == 2
    assert holdback("anything", []) == 0


@pytest.mark.slow
def test_smollm2_incremental_text_equals_the_full_decode(smollm2):
    _, tokenizer = smollm2
    rng = random.Random(7)
    text = "Olá! 你好, 世界 🌍🚀 — naïve café, ½ × π ≈ 1.57"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert "".join(_stream(tokenizer, ids)) == tokenizer.decode(ids, clean_up_tokenization_spaces=False)
    for _ in range(3):
        ids = [rng.randrange(len(tokenizer)) for _ in range(80)]
        full = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        assert "".join(_stream(tokenizer, ids)) == full
