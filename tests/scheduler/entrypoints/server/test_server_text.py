"""The text the server sends, through the official client: characters split over tokens, stop strings spanning
tokens (never leaked into a stream), include_stop_str_in_output, skip_special_tokens, chat logprob bytes, an echo
of the prompt alone (max_tokens=0), the chunk layout of streams with n > 1, and -inf log-probabilities as JSON.

A structured-output choice makes the tiny random model write a known text: its multi-byte characters are
not in the tiny vocabulary, so the model writes them byte by byte, over several tokens each.
"""

from __future__ import annotations

import json

import pytest
from server_helpers import CHAT, refused

TARGET = "naïve 日本 😀 café!"
FORCED = {"structured_outputs": {"choice": [TARGET]}}
REPLACEMENT = "\ufffd"


def test_split_characters_stream_whole_and_chat_logprob_bytes_join_into_the_text(served, client):
    r = client.chat.completions.create(model=served.model, messages=CHAT, max_tokens=40, temperature=0,
                                       logprobs=True, top_logprobs=2, extra_body=FORCED)  # fmt: skip
    (choice,) = r.choices
    assert choice.message.content == TARGET
    entries = choice.logprobs.content
    assert sum(REPLACEMENT in e.token for e in entries) >= 4  # the characters really are split over tokens
    # as OpenAI's: each token's own bytes, which join into the text (a split character's part included)
    assert bytes(b for e in entries for b in e.bytes).startswith(TARGET.encode())
    assert all(bytes(t.bytes) for e in entries for t in e.top_logprobs)
    chunks = list(client.chat.completions.create(model=served.model, messages=CHAT, max_tokens=40, temperature=0,
                                                 stream=True, extra_body=FORCED))  # fmt: skip
    pieces = [c.choices[0].delta.content or "" for c in chunks]
    assert "".join(pieces) == TARGET and not any(REPLACEMENT in p for p in pieces)
    assert "😀" in pieces  # four bytes over several tokens, sent as one piece once whole


@pytest.mark.parametrize("stop", ["日本 😀", "本", "😀 c", " café!", "ïve 日"])
@pytest.mark.parametrize("keep", [False, True])
def test_stop_strings_spanning_split_characters_never_leak_into_the_stream(served, client, stop, keep):
    want = TARGET[: TARGET.index(stop) + len(stop) * keep]
    kw = dict(model=served.model, prompt="hello", max_tokens=40, temperature=0, stop=[stop],
              extra_body={**FORCED, "include_stop_str_in_output": keep})  # fmt: skip
    whole = client.completions.create(**kw).choices[0]
    assert (whole.text, whole.finish_reason, whole.model_extra["stop_reason"]) == (want, "stop", stop)
    chunks = list(client.completions.create(**kw, stream=True))
    pieces = [c.choices[0].text for c in chunks]
    assert "".join(pieces) == want and not any(REPLACEMENT in p for p in pieces)
    assert chunks[-1].choices[0].finish_reason == "stop" and all(c.choices[0].finish_reason is None
                                                                  for c in chunks[:-1])  # fmt: skip


def test_skip_special_tokens_false_shows_special_tokens(served, client):
    im_start = served.llm.tokenizer.convert_tokens_to_ids("<|im_start|>")
    kw = dict(model=served.model, prompt="hello", max_tokens=3, temperature=0)
    bias = {"logit_bias": {str(im_start): 100}, "ignore_eos": True}
    assert client.completions.create(**kw, extra_body=bias).choices[0].text == ""
    shown = client.completions.create(**kw, extra_body={**bias, "skip_special_tokens": False})
    assert shown.choices[0].text == "<|im_start|>" * 3


def test_echo_with_max_tokens_0_scores_the_prompt_alone(served, client):
    prompts = ["hello world", "the quick brown fox"]
    kw = dict(model=served.model, prompt=prompts, echo=True, logprobs=1, temperature=0)
    scored = client.completions.create(**kw, max_tokens=0)
    one = client.completions.create(**kw, max_tokens=1)  # the prompt's scores, and one token after it
    assert scored.usage.completion_tokens == 0
    assert scored.usage.prompt_tokens == one.usage.prompt_tokens == sum(
        len(served.llm.tokenizer.encode(p)) for p in prompts)  # fmt: skip
    for prompt, c, ref in zip(prompts, scored.choices, one.choices):
        n = len(served.llm.tokenizer.encode(prompt))
        assert (c.text, c.finish_reason) == (prompt, "length")
        assert c.logprobs.tokens == ref.logprobs.tokens[:n] and len(c.logprobs.tokens) == n
        assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
        assert c.logprobs.token_logprobs[1:] == pytest.approx(ref.logprobs.token_logprobs[1:n], abs=1e-4)
        assert c.logprobs.text_offset == ref.logprobs.text_offset[:n]
    chunks = list(client.completions.create(**kw, max_tokens=0, stream=True, stream_options={"include_usage": True}))
    for i, prompt in enumerate(prompts):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert "".join(c.text for c in mine) == prompt and mine[-1].finish_reason == "length"
        assert sum(len(c.logprobs.tokens) for c in mine) == len(served.llm.tokenizer.encode(prompt))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 0


def test_max_tokens_0_without_echo_is_refused(served):
    r = served.post("completions", {"model": served.model, "prompt": "hello", "max_tokens": 0})
    refused(r, "max_tokens")
    r = served.post("chat/completions", {"model": served.model, "messages": CHAT, "max_completion_tokens": 0})
    refused(r, "max_completion_tokens")


def _per_choice(chunks) -> dict[int, list]:
    """Each choice's chunks, in order (a chunk carries one choice)."""
    out: dict[int, list] = {}
    for c in chunks:
        assert len(c.choices) <= 1
        for choice in c.choices:
            out.setdefault(choice.index, []).append(choice)
    return out


@pytest.mark.parametrize("path", ["completions", "chat/completions"])
def test_streams_with_n_samples_lay_out_each_choice_as_openai_does(served, client, path):
    """Per choice: the role first (chat), text deltas, finish_reason on its last chunk only; then one usage chunk
    with no choices; the texts and usage equal the whole response's (seeded samples)."""
    chat = path.startswith("chat")
    kw = dict(model=served.model, max_tokens=8, temperature=1.0, n=2, seed=11)
    if chat:
        create, kw = client.chat.completions.create, {**kw, "messages": CHAT}
        text, whole_text = (lambda c: c.delta.content or ""), (lambda c: c.message.content)
    else:
        create, kw = client.completions.create, {**kw, "prompt": ["hello", "the fox"]}
        text = whole_text = lambda c: c.text
    whole = create(**kw)
    chunks = list(create(**kw, stream=True, stream_options={"include_usage": True}))
    usage_chunk, chunks = chunks[-1], chunks[:-1]
    counts = lambda u: (u.prompt_tokens, u.completion_tokens, u.total_tokens)  # noqa: E731 (cached: the 2nd hits)
    assert usage_chunk.choices == [] and counts(usage_chunk.usage) == counts(whole.usage)
    assert all(c.usage is None and c.id == usage_chunk.id for c in chunks)
    by_index = _per_choice(chunks)
    assert sorted(by_index) == [c.index for c in whole.choices] == list(range(len(whole.choices)))
    for c in whole.choices:
        mine = by_index[c.index]
        if chat:
            assert mine[0].delta.role == "assistant" and all(m.delta.role is None for m in mine[1:])
        assert [m.finish_reason for m in mine] == [None] * (len(mine) - 1) + [c.finish_reason]
        assert "".join(text(m) for m in mine) == whole_text(c)


def _strict_json(text: str) -> list[dict]:
    """The events of a stream, parsed as strict JSON (no NaN or Infinity)."""

    def refuse(constant: str):
        raise AssertionError(f"{constant} is not JSON")

    data = [line[6:] for line in text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]
    return [json.loads(d, parse_constant=refuse) for d in data]


@pytest.mark.parametrize("path", ["completions", "chat/completions"])
def test_top_logprobs_of_ruled_out_tokens_are_the_floor_not_infinity(served, path):
    """A grammar that allows one token a step, four top log-probabilities asked for: the others are -inf to the
    engine, and -9999.0 (vLLM's floor) in the body, whole or streamed (JSON has no infinity: it was a 500)."""
    chat = path.startswith("chat")
    asked = {"messages": CHAT, "logprobs": True, "top_logprobs": 4} if chat else {"prompt": "hello", "logprobs": 4}
    body = {"model": served.model, "max_tokens": 6, **FORCED, **asked}
    for stream in (False, True):
        r = served.post(path, {**body, "stream": stream})
        assert r.status_code == 200, r.text
        events = _strict_json(r.text) if stream else _strict_json("data: " + r.text)
        blocks = [c["logprobs"] for e in events for c in e["choices"] if c.get("logprobs")]
        if chat:
            values = [t["logprob"] for b in blocks for e in b["content"] for t in e["top_logprobs"]]
        else:
            values = [v for b in blocks for top in b["top_logprobs"] for v in top.values()]
        assert values and -9999.0 in values and all(-9999.0 <= v <= 0.0 for v in values)


class _PieceTokenizer:
    """A tokenizer with SentencePiece's byte fallback: ids 0-2 are the bytes of "€" (<0xE2> <0x82> <0xAC>)."""

    pieces = ["<0xE2>", "<0x82>", "<0xAC>", "▁café"]

    def decode(self, ids: list[int]) -> str:
        return "".join(" café" if i == 3 else REPLACEMENT for i in ids)

    def convert_ids_to_tokens(self, token_id: int) -> str:
        return self.pieces[token_id]


def test_token_bytes_of_byte_fallback_and_byte_level_tokens(served):
    from scheduler.entrypoints.server.serving import token_bytes

    tok = _PieceTokenizer()
    assert [token_bytes(tok, i) for i in range(3)] == [[0xE2], [0x82], [0xAC]]
    assert token_bytes(tok, 3) == list(" café".encode())
    tiny = served.llm.tokenizer  # byte-level BPE: "€" is three tokens, one per byte
    ids = tiny.encode("€")
    assert len(ids) == 3 and bytes(b for i in ids for b in token_bytes(tiny, i)).decode() == "€"
