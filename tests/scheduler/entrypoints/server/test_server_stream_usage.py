"""vLLM's ``stream_options.continuous_usage_stats``: with ``include_usage``, every streamed chunk carries its prompt's
tokens and its choice's tokens so far; the final usage chunk still closes the stream. Off by default, and ignored
without ``include_usage`` (as vLLM)."""

from __future__ import annotations

from collections import defaultdict

import pytest
from server_helpers import CHAT, refused, sse_events

PROMPTS = ["hello world", "the quick brown fox jumps"]
CONTINUOUS = {"include_usage": True, "continuous_usage_stats": True}


def _check_running_usage(chunks, prompt_tokens: list[int], n: int) -> dict[int, int]:
    """Every chunk but the last carries a running usage (prompt tokens of its choice's prompt, completion tokens
    non-decreasing per choice); the last chunk's completion tokens are the sum of the choices' final counts."""
    *streamed, final = chunks
    last: dict[int, int] = defaultdict(int)
    for c in streamed:
        (choice,) = c.choices
        u = c.usage
        assert u is not None and u.prompt_tokens == prompt_tokens[choice.index // n], c
        assert u.completion_tokens >= last[choice.index] and u.total_tokens == u.prompt_tokens + u.completion_tokens
        last[choice.index] = u.completion_tokens
    assert final.choices == [] and final.usage.prompt_tokens == sum(prompt_tokens)
    assert final.usage.completion_tokens == sum(last.values()) and sorted(last) == list(range(len(prompt_tokens) * n))
    return last


def _prompt_tokens(served, prompts: list[str]) -> list[int]:
    return [len(served.llm.tokenizer.encode(p)) for p in prompts]


@pytest.mark.parametrize("n", [1, 3])
def test_each_completion_chunk_carries_its_prompt_and_choice_usage(served, client, n):
    chunks = list(client.completions.create(
        model=served.model, prompt=PROMPTS, max_tokens=7, n=n, temperature=1.0, seed=3, stream=True,
        stream_options=CONTINUOUS, extra_body={"ignore_eos": True},
    ))  # fmt: skip
    last = _check_running_usage(chunks, _prompt_tokens(served, PROMPTS), n)
    assert set(last.values()) == {7}


def test_a_stopped_choice_counts_the_tokens_it_generated(served, client):
    whole = client.completions.create(model=served.model, prompt=PROMPTS[1], max_tokens=12, temperature=0)
    stop = whole.choices[0].text[3:6]  # a stop string the greedy text meets: its tokens held back, then cut
    chunks = list(client.completions.create(
        model=served.model, prompt=PROMPTS[1], max_tokens=12, temperature=0, stop=[stop], stream=True,
        stream_options=CONTINUOUS,
    ))  # fmt: skip
    _check_running_usage(chunks, _prompt_tokens(served, PROMPTS[1:]), 1)


def test_an_echo_chunk_carries_the_usage_before_its_first_token(served, client):
    chunks = list(client.completions.create(
        model=served.model, prompt=PROMPTS[0], max_tokens=4, temperature=0, echo=True, stream=True,
        stream_options=CONTINUOUS,
    ))  # fmt: skip
    assert chunks[0].choices[0].text == PROMPTS[0] and chunks[0].usage.completion_tokens == 0
    assert _check_running_usage(chunks, _prompt_tokens(served, PROMPTS[:1]), 1) == {0: 4}


def test_an_echo_of_the_prompt_alone_counts_no_completion_tokens(served, client):
    chunks = list(client.completions.create(
        model=served.model, prompt=PROMPTS[0], max_tokens=0, echo=True, stream=True, stream_options=CONTINUOUS,
    ))  # fmt: skip
    assert _check_running_usage(chunks, _prompt_tokens(served, PROMPTS[:1]), 1) == {0: 0}


@pytest.mark.parametrize("n", [1, 2])
def test_chat_role_chunks_carry_the_prompt_and_no_completion_tokens(served, client, n):
    chunks = list(client.chat.completions.create(
        model=served.model, messages=CHAT, max_tokens=6, n=n, temperature=1.0, seed=5, stream=True,
        stream_options=CONTINUOUS, extra_body={"ignore_eos": True},
    ))  # fmt: skip
    prompt = len(served.llm.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)["input_ids"])
    roles = chunks[:n]
    assert all(c.choices[0].delta.role == "assistant" and c.usage.completion_tokens == 0 for c in roles)
    assert _check_running_usage(chunks, [prompt], n) == dict.fromkeys(range(n), 6)


@pytest.mark.parametrize("options", [None, {"include_usage": True}, {"include_usage": True,
                                     "continuous_usage_stats": False}, {"continuous_usage_stats": True}])  # fmt: skip
def test_off_unless_asked_and_ignored_without_include_usage(served, client, options):
    kw = {"stream_options": options} if options else {}
    chunks = list(client.completions.create(model=served.model, prompt=PROMPTS[0], max_tokens=4, temperature=0,
                                            stream=True, **kw))  # fmt: skip
    final = bool(options and options.get("include_usage"))
    assert all(c.usage is None for c in chunks[: len(chunks) - final])
    assert (chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4) if final else chunks[-1].choices


def test_continuous_usage_stats_must_be_a_bool_and_needs_a_stream(served):
    body = {"model": served.model, "prompt": "hi", "max_tokens": 2}
    not_a_bool = {"stream": True, "stream_options": {"continuous_usage_stats": 1}}
    error = refused(served.post("completions", body | not_a_bool), "stream_options")
    assert "continuous_usage_stats" in error["message"]
    refused(served.post("completions", body | {"stream_options": CONTINUOUS}), "stream_options")
    events = sse_events(served.post("completions", body | {"stream": True, "stream_options": CONTINUOUS}).text)
    assert events[0]["usage"]["completion_tokens"] >= 1 and "prompt_tokens_details" in events[-1]["usage"]


def test_beam_search_chunks_carry_each_hypothesis_usage(served, client):
    chunks = list(client.completions.create(
        model=served.model, prompt=PROMPTS[1], max_tokens=5, n=2, stream=True, stream_options=CONTINUOUS,
        extra_body={"use_beam_search": True, "ignore_eos": True},
    ))  # fmt: skip
    assert _check_running_usage(chunks, _prompt_tokens(served, PROMPTS[1:]), 2) == {0: 5, 1: 5}
