"""vLLM's use_beam_search on both endpoints: the offline LLM.beam_search hypotheses, best first, whole or streamed;
fields that would not apply refused naming them; a client that leaves aborts the search, every beam freed."""

from __future__ import annotations

import json
import socket
import threading
from urllib.parse import urlparse

import httpx
import pytest
from server_helpers import CHAT, hold_steps, refused, scrape, sse_events, wait_aborted, wait_idle

from scheduler.engine.beam_search import BeamSearchParams

PROMPT = "hello world the quick"
BEAM = {"use_beam_search": True}


def _offline(offline, ids, **params):
    """The offline search's hypotheses of these prompt ids: (text, finish reason, token count, cumulative logprob)."""
    (out,) = offline.beam_search(ids, BeamSearchParams(**params))
    return [(h.text, h.finish_reason, len(h.token_ids), h.cumulative_logprob) for h in out.hypotheses]


def _prompt_ids(served) -> list[int]:
    """The completion prompt's ids as the server tokenizes it (with the tokenizer's special tokens)."""
    return list(served.llm.tokenizer.encode(PROMPT, add_special_tokens=True))


def _stop_token(offline, ids) -> int:
    """A token the best width-3 hypothesis reaches (third), so a stop id on it ends hypotheses."""
    (out,) = offline.beam_search(ids, BeamSearchParams(width=3, max_tokens=8, ignore_eos=True))
    return out.hypotheses[0].token_ids[2]


@pytest.mark.parametrize("case", ["plain", "length_penalty", "stop"])
def test_completions_give_the_offline_hypotheses_best_first(served, offline, client, case):
    """n=3 beams: the choices are LLM.beam_search's hypotheses in rank order (text, finish reason); usage counts the
    prompt once and every hypothesis' tokens; temperature is ignored."""
    ids = _prompt_ids(served)
    params, extra, stop = dict(width=3, max_tokens=8, ignore_eos=True), {"ignore_eos": True}, None
    if case == "length_penalty":
        params["length_penalty"] = extra["length_penalty"] = 0.3
    if case == "stop":  # a stop id on the best path: some hypotheses end on it, their text keeps its text
        stop = _stop_token(offline, ids)
        params |= dict(stop_token_ids=(stop,), include_stop_str_in_output=True)
        extra |= {"stop_token_ids": [stop], "include_stop_str_in_output": True}
    ref = _offline(offline, ids, **params)
    r = client.completions.create(model=served.model, prompt=PROMPT, n=3, max_tokens=8, temperature=0.7,
                                  extra_body=BEAM | extra)  # fmt: skip
    assert [(c.index, c.text, c.finish_reason) for c in r.choices] == [(i, t, f) for i, (t, f, _, _) in enumerate(ref)]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), sum(n for _, _, n, _ in ref))
    # a choice's stop_reason is a normal request's: the stop id that ended it (None for EOS, or at length)
    assert [c.model_extra["stop_reason"] for c in r.choices] == [stop if f == "stop" else None for _, f, _, _ in ref]
    if case == "stop":
        assert any(f == "stop" for _, f, _, _ in ref) and any(f == "length" for _, f, _, _ in ref)
    wait_idle(served)


def test_chat_gives_the_offline_hypotheses(served, offline, client):
    """Chat with n=2 beams: each choice's message is an offline hypothesis' text, best first."""
    ids = offline.chat_prompt(CHAT)
    ref = _offline(offline, ids, width=2, max_tokens=6)
    r = client.chat.completions.create(model=served.model, messages=CHAT, n=2, max_tokens=6, extra_body=BEAM)
    assert [(c.message.content, c.finish_reason) for c in r.choices] == [(t, f) for t, f, _, _ in ref]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), sum(n for _, _, n, _ in ref))


def test_streams_send_each_final_choice_whole_then_usage(served, offline, client):
    """Streamed, each choice comes once the search ends, in one chunk with its whole text and finish reason, then
    the usage chunk; chat sends the roles first."""
    ids = _prompt_ids(served)
    ref = _offline(offline, ids, width=3, max_tokens=8, ignore_eos=True)
    kw = dict(model=served.model, n=3, max_tokens=8, stream=True, stream_options={"include_usage": True})
    chunks = list(client.completions.create(prompt=PROMPT, extra_body=BEAM | {"ignore_eos": True}, **kw))
    texts = [(c.choices[0].index, c.choices[0].text, c.choices[0].finish_reason) for c in chunks if c.choices]
    assert texts == [(i, t, f) for i, (t, f, _, _) in enumerate(ref)]
    assert chunks[-1].usage.completion_tokens == sum(n for _, _, n, _ in ref) and not chunks[-1].choices
    chat_ref = _offline(offline, offline.chat_prompt(CHAT), width=2, max_tokens=6)
    chat = list(client.chat.completions.create(messages=CHAT, **kw | {"n": 2, "max_tokens": 6}, extra_body=BEAM))
    roles = [c.choices[0].delta.role for c in chat[:2]]
    finals = [(c.choices[0].delta.content or "", c.choices[0].finish_reason) for c in chat[2:] if c.choices]
    assert roles == ["assistant", "assistant"] and finals == [(t, f) for t, f, _, _ in chat_ref]


def test_chosen_token_logprobs_and_echo(served, offline, client):
    """logprobs=0 (completions) and logprobs without top ones (chat) give the chosen tokens' log-probabilities,
    summing to each hypothesis' cumulative one; echo puts the prompt first."""
    ids = _prompt_ids(served)
    ref = _offline(offline, ids, width=2, max_tokens=5, ignore_eos=True)
    extra = BEAM | {"ignore_eos": True}
    r = client.completions.create(model=served.model, prompt=PROMPT, n=2, max_tokens=5, logprobs=0, extra_body=extra)
    for choice, (_, _, n, cum) in zip(r.choices, ref):
        assert len(choice.logprobs.token_logprobs) == n and sum(choice.logprobs.token_logprobs) == pytest.approx(cum)
    echoed = client.completions.create(model=served.model, prompt=PROMPT, n=2, max_tokens=5, echo=True,
                                       extra_body=extra)  # fmt: skip
    assert [c.text for c in echoed.choices] == [PROMPT + t for t, _, _, _ in ref]
    chat_ref = _offline(offline, offline.chat_prompt(CHAT), width=2, max_tokens=4, ignore_eos=True)
    chat = client.chat.completions.create(model=served.model, messages=CHAT, n=2, max_tokens=4, logprobs=True,
                                          extra_body=extra)  # fmt: skip
    for choice, (_, _, _, cum) in zip(chat.choices, chat_ref):
        assert sum(t.logprob for t in choice.logprobs.content) == pytest.approx(cum)
        assert all(t.top_logprobs == [] for t in choice.logprobs.content)


def _offline_tops(offline, ids, k, **params):
    """The offline search's hypotheses as (tokens, their logprobs, per token {token: logprob} of the top k), each
    token named as return_tokens_as_token_ids names it (distinct tokens, distinct names)."""
    (out,) = offline.beam_search(ids, BeamSearchParams(logprobs=k, **params))
    text = lambda t: f"token_id:{t}"  # noqa: E731
    tops = lambda h: [{text(t): v for t, v in top.items()} for top in h.top_logprobs]  # noqa: E731
    return [([text(t) for t in h.token_ids], h.logprobs, tops(h)) for h in out.hypotheses]


def test_top_logprobs_are_the_offline_searchs(served, offline, client):
    """logprobs=k (completions) and top_logprobs=k (chat) give each token the k most likely tokens of its beam, as
    the offline search's hypotheses have them; a completion's also holds the chosen token, as a sampled one's."""
    extra = BEAM | {"ignore_eos": True, "return_tokens_as_token_ids": True}
    ref = _offline_tops(offline, _prompt_ids(served), 3, width=2, max_tokens=5, ignore_eos=True)
    r = client.completions.create(model=served.model, prompt=PROMPT, n=2, max_tokens=5, logprobs=3, extra_body=extra)
    for choice, (texts, lps, tops) in zip(r.choices, ref, strict=True):
        got = choice.logprobs
        assert got.tokens == texts and got.token_logprobs == pytest.approx(lps, abs=1e-4)
        for have, top, text, lp in zip(got.top_logprobs, tops, texts, lps, strict=True):
            assert len(top) == 3 and have == pytest.approx(top | {text: lp}, abs=1e-4)
    chat_ref = _offline_tops(offline, offline.chat_prompt(CHAT), 2, width=2, max_tokens=4, ignore_eos=True)
    chat = client.chat.completions.create(model=served.model, messages=CHAT, n=2, max_tokens=4, logprobs=True,
                                          top_logprobs=2, extra_body=extra)  # fmt: skip
    for choice, (texts, _, tops) in zip(chat.choices, chat_ref, strict=True):
        assert [t.token for t in choice.logprobs.content] == texts
        for entry, top in zip(choice.logprobs.content, tops, strict=True):
            assert {a.token: a.logprob for a in entry.top_logprobs} == pytest.approx(top, abs=1e-4)
            assert len(entry.top_logprobs) == 2


REFUSED = {
    "top_p": 0.5, "top_k": 5, "min_p": 0.1, "seed": 1, "presence_penalty": 0.5, "frequency_penalty": 0.5,
    "repetition_penalty": 1.2, "logit_bias": {"5": 1}, "stop": ["x"], "min_tokens": 2, "bad_words": ["x"],
    "allowed_token_ids": [1, 2], "prompt_logprobs": 1, "best_of": 3,
    "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a+"},
}  # fmt: skip


@pytest.mark.parametrize(("field", "value"), list(REFUSED.items()))
def test_a_field_that_would_not_apply_to_the_beams_is_refused_naming_it(served, captured, field, value):
    """A 400 whose param names the field, before anything reaches the engine."""
    body = {"model": served.model, "prompt": PROMPT, "n": 2, "max_tokens": 4, **BEAM, field: value}
    error = refused(served.post("completions", body), field)
    assert "use_beam_search" in error["message"] and not captured


def test_a_constraint_refused_names_the_field_that_set_it(served, captured):
    """structured_outputs beside a text response_format: the refusal names structured_outputs, which constrains."""
    body = {"model": served.model, "prompt": PROMPT, "n": 2, "max_tokens": 4, **BEAM,
            "response_format": {"type": "text"}, "structured_outputs": {"regex": "a+"}}  # fmt: skip
    error = refused(served.post("completions", body), "structured_outputs")
    assert "use_beam_search" in error["message"] and not captured


@pytest.mark.parametrize(("path", "body", "field"), [
    ("chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21, **BEAM}, "top_logprobs"),
    ("completions", {"prompt": PROMPT, "logprobs": 21, **BEAM}, "logprobs"),  # past --max-logprobs=20
    ("completions", {"prompt": PROMPT, "echo": True, "logprobs": 0, **BEAM}, "logprobs"),
    ("completions", {"prompt": PROMPT, "length_penalty": 0.5}, "length_penalty"),  # ranks beams only
    ("completions", {"prompt": PROMPT, "max_tokens": 10**6, **BEAM}, "max_tokens"),
])  # fmt: skip
def test_other_refusals(served, captured, path, body, field):
    """Top log-probabilities past --max-logprobs, an echo's logprobs, length_penalty without beams, a max_tokens
    past the context."""
    refused(served.post(path, {"model": served.model, "max_tokens": 4} | body), field)
    assert not captured


def test_a_search_runs_beside_sampled_requests(served, offline, client):
    """A beam search and greedy requests sent together each get what they get alone."""
    ids = _prompt_ids(served)
    ref = _offline(offline, ids, width=4, max_tokens=12, ignore_eos=True)
    greedy = client.completions.create(model=served.model, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    results: dict[str, object] = {}

    def beams() -> None:
        results["beams"] = client.completions.create(model=served.model, prompt=PROMPT, n=4, max_tokens=12,
                                                     extra_body=BEAM | {"ignore_eos": True})  # fmt: skip

    thread = threading.Thread(target=beams)
    thread.start()
    texts = [client.completions.create(model=served.model, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
             for _ in range(3)]  # fmt: skip
    thread.join()
    assert texts == [greedy] * 3
    assert [c.text for c in results["beams"].choices] == [t for t, _, _, _ in ref]


def _admitted_then_held(served, monkeypatch) -> threading.Event:
    """An event set when the engine thread first steps a request; that step is held until no handler is left."""
    hold_steps(served, monkeypatch, after_texts=0)
    processor, held, stepped = served.engine.processor, served.engine.processor.step, threading.Event()

    def step():
        stepped.set()
        return held()

    monkeypatch.setattr(processor, "step", step)
    return stepped


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_aborts_the_search_and_frees_every_beam(served, monkeypatch, stream):
    """The search is aborted (counted as 4 aborted samples) and the pool holds no block of it."""
    wait_idle(served)
    before, aborted = scrape(served), served.engine.num_aborted
    stepped = _admitted_then_held(served, monkeypatch)
    body = {"model": served.model, "prompt": PROMPT, "n": 4, "max_tokens": 60, "stream": stream,
            "ignore_eos": True, **BEAM}  # fmt: skip
    url = urlparse(served.url)
    payload = json.dumps(body).encode()
    with socket.create_connection((url.hostname, url.port)) as sock:  # a raw client: it leaves mid-request
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))  # fmt: skip
        assert stepped.wait(30), "the search never reached the engine"
    wait_idle(served)
    wait_aborted(served, aborted + 1)
    engine = served.llm.engine
    assert served.engine.num_aborted == aborted + 1 and not engine.beams
    assert engine.block_manager.gpu.num_used == 0 and engine.block_manager.stats().num_sequences == 0
    key = ("vllm:request_success_total", tuple(sorted({"model_name": served.model, "engine": "0",
                                                        "finished_reason": "abort"}.items())))  # fmt: skip
    after = scrape(served)
    assert after[key] - before[key] == 4


def test_metrics_count_the_search_once_with_its_hypotheses(served, client):
    """One request: TTFT observed once (when its result is ready), its n hypotheses counted as finished samples and
    their tokens as generation tokens."""
    wait_idle(served)
    labels = {"model_name": served.model, "engine": "0"}
    value = lambda samples, name, **kw: samples[(name, tuple(sorted((labels | kw).items())))]  # noqa: E731
    before = scrape(served)
    r = client.completions.create(model=served.model, prompt=PROMPT, n=3, max_tokens=6,
                                  extra_body=BEAM | {"ignore_eos": True})  # fmt: skip
    wait_idle(served)
    after = scrape(served)
    delta = lambda name, **kw: value(after, name, **kw) - value(before, name, **kw)  # noqa: E731
    assert delta("vllm:time_to_first_token_seconds_count") == 1 == delta("vllm:e2e_request_latency_seconds_count")
    assert delta("vllm:request_success_total", finished_reason="length") == 3
    assert delta("vllm:generation_tokens_total") == r.usage.completion_tokens == 18
    assert delta("vllm:prompt_tokens_total") == r.usage.prompt_tokens


def test_raw_stream_ends_with_done(served):
    """The stream's events, read raw: one per choice, then [DONE] (no empty chunk for the admission)."""
    body = {"model": served.model, "prompt": PROMPT, "n": 2, "max_tokens": 4, "stream": True, **BEAM}
    events = sse_events(httpx.post(f"{served.url}/v1/completions", json=body, timeout=60).text)
    assert [e["choices"][0]["index"] for e in events] == [0, 1]
    assert all(e["choices"][0]["finish_reason"] in ("stop", "length") for e in events)
