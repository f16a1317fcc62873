"""The OpenAI-compatible server through the official client, against a real uvicorn server on 127.0.0.1."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import CHAT, hold_steps, refused, wait_aborted, wait_idle

from scheduler.core.params import SamplingParams

PROMPTS = ["hello world", "the quick brown fox", "what is the capital of france?", "numbers: 1 2 3"]


def _greedy(offline, prompts, max_tokens=12, **kw):
    outs = offline.generate(prompts, SamplingParams(max_tokens=max_tokens, **kw))
    return [o.outputs[0] for o in outs]


def _model(served) -> str:
    return served.llm.model_name


def test_models_and_health(served, client):
    assert [m.id for m in client.models.list().data] == [_model(served)]
    assert httpx.get(served.url + "/health").status_code == 200


def test_greedy_completions_equal_the_offline_llm(served, client, offline):
    for prompt, ref in zip(PROMPTS, _greedy(offline, PROMPTS)):
        r = client.completions.create(model=_model(served), prompt=prompt, max_tokens=12, temperature=0)
        (choice,) = r.choices
        assert (choice.text, choice.finish_reason) == (ref.text, ref.finish_reason)
        assert r.usage.completion_tokens == len(ref.token_ids)
        assert r.usage.prompt_tokens == len(offline.tokenizer.encode(prompt))


def test_streamed_completion_with_usage_equals_the_offline_text(served, client, offline):
    (ref,) = _greedy(offline, [PROMPTS[1]], max_tokens=20)
    chunks = list(client.completions.create(
        model=_model(served), prompt=PROMPTS[1], max_tokens=20, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert chunks[-2].choices[0].finish_reason == ref.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_whole_and_streamed_equal_the_offline_chat(served, client, offline):
    (ref,) = offline.chat(CHAT, SamplingParams(max_tokens=16))
    r = client.chat.completions.create(model=_model(served), messages=CHAT, max_tokens=16, temperature=0)
    assert r.choices[0].message.content == ref.outputs[0].text and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    chunks = list(client.chat.completions.create(
        model=_model(served), messages=CHAT, max_tokens=16, temperature=0, stream=True))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.outputs[0].text
    assert chunks[-1].choices[0].finish_reason == ref.outputs[0].finish_reason


def test_n_samples_with_a_seed_repeat_and_match_the_offline_samples(served, client, offline):
    kw = dict(model=_model(served), prompt="hello", max_tokens=10, temperature=1.0, n=3, seed=7)
    a, b = (client.completions.create(**kw, extra_body={"ignore_eos": True}) for _ in range(2))
    texts = lambda r: [c.text for c in sorted(r.choices, key=lambda c: c.index)]  # noqa: E731
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert texts(a) == texts(b) and len(set(texts(a))) > 1
    (ref,) = offline.generate("hello", SamplingParams(max_tokens=10, temperature=1.0, n=3, seed=7, ignore_eos=True))
    assert texts(a) == [s.text for s in ref.outputs]
    c = client.completions.create(**{**kw, "seed": 8}, extra_body={"ignore_eos": True})
    assert texts(c) != texts(a)


def test_a_batch_of_prompts_gives_n_choices_per_prompt(served, client, offline):
    r = client.completions.create(model=_model(served), prompt=PROMPTS[:2], max_tokens=6, temperature=0, n=2)
    refs = _greedy(offline, PROMPTS[:2], max_tokens=6)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [refs[0].text] * 2 + [refs[1].text] * 2
    assert r.usage.prompt_tokens == sum(len(offline.tokenizer.encode(p)) for p in PROMPTS[:2])


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_cut_the_text(served, client, offline, stream):
    (full,) = _greedy(offline, [PROMPTS[0]], max_tokens=24, ignore_eos=True)
    text = full.text
    k = next(i for i in range(3, len(text) - 2) if text.find(text[i : i + 2]) == i and text[i : i + 2].strip())
    kw = dict(model=_model(served), prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=[text[k : k + 2]],
              extra_body={"ignore_eos": True}, stream=stream)  # fmt: skip
    r = client.completions.create(**kw)
    if stream:
        chunks = list(r)
        got, reason = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
    else:
        got, reason = r.choices[0].text, r.choices[0].finish_reason
    assert (got, reason) == (text[:k], "stop")


def test_logprobs_match_the_offline_logprobs(served, client, offline):
    (ref,) = offline.generate(PROMPTS[2], SamplingParams(max_tokens=5, logprobs=2))
    r = client.completions.create(model=_model(served), prompt=PROMPTS[2], max_tokens=5, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(ref.outputs[0].logprobs, abs=1e-4)
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs)
    chunks = list(client.completions.create(model=_model(served), prompt=PROMPTS[2], max_tokens=5, temperature=0,
                                            logprobs=2, stream=True))  # fmt: skip
    assert [x for c in chunks for x in c.choices[0].logprobs.token_logprobs] == pytest.approx(lp.token_logprobs)
    chat = client.chat.completions.create(model=_model(served), messages=CHAT, max_tokens=4, temperature=0,
                                          logprobs=True, top_logprobs=3)  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob >= t.logprob - 1e-5 for t in content)


def test_cache_salt_is_accepted_and_changes_no_output(served, client, offline):
    (ref,) = _greedy(offline, [PROMPTS[3]], max_tokens=8)
    r = client.completions.create(model=_model(served), prompt=PROMPTS[3], max_tokens=8, temperature=0,
                                  extra_body={"cache_salt": "tenant-a", "top_k": 5})  # fmt: skip
    assert r.choices[0].text == ref.text


def test_32_concurrent_streams_equal_their_offline_answers(served, offline):
    prompts = [f"{PROMPTS[i % 4]} {i}" for i in range(32)]
    lengths = [4 + (i * 7) % 20 for i in range(32)]
    refs = [offline.generate(p, SamplingParams(max_tokens=m))[0].outputs[0].text for p, m in zip(prompts, lengths)]

    async def one(client, prompt, max_tokens) -> str:
        stream = await client.completions.create(model=_model(served), prompt=prompt, max_tokens=max_tokens,
                                                 temperature=0, stream=True)  # fmt: skip
        return "".join([c.choices[0].text async for c in stream])

    async def run() -> list[str]:
        async with openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0) as client:
            return await asyncio.gather(*(one(client, p, m) for p, m in zip(prompts, lengths)))

    assert asyncio.run(run()) == refs
    wait_idle(served)


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(served, client, monkeypatch):
    before = served.engine.num_aborted
    hold_steps(served, monkeypatch, after_texts=2)  # it is still running when the client leaves
    stream = client.completions.create(model=_model(served), prompt="hello", max_tokens=480, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})  # fmt: skip
    chunks = iter(stream)
    next(chunks), next(chunks)
    assert served.llm.engine.block_manager.seq_ids()  # it holds blocks while it runs
    stream.close()
    wait_idle(served)
    wait_aborted(served, before + 1)
    assert served.engine.num_aborted == before + 1  # aborted, not run to its 480 tokens


def test_an_overloaded_server_answers_503_with_retry_after(served, client, monkeypatch):
    engine, limit = served.engine, served.engine.max_in_flight
    hold_steps(served, monkeypatch)  # the stream is in flight until it is closed
    engine.max_in_flight = 1
    try:
        stream = client.completions.create(model=_model(served), prompt="hello", max_tokens=480, stream=True,
                                           extra_body={"ignore_eos": True})  # fmt: skip
        next(iter(stream))
        with pytest.raises(openai.APIStatusError) as info:
            client.completions.create(model=_model(served), prompt="hello", max_tokens=4)
        stream.close()
    finally:
        engine.max_in_flight = limit
    assert info.value.status_code == 503 and info.value.response.headers["retry-after"] == "1"
    assert info.value.response.json()["error"]["type"] == "server_overloaded"
    wait_idle(served)


GOOD = {"prompt": "hello", "max_tokens": 3}
BAD_BODIES = {  # case -> (body, status, the field the error names)
    "not json": (b"{not json", 400, None),
    "a list": (b"[1, 2]", 400, None),
    "model a number": ({"model": 5, **GOOD}, 400, "model"),
    "unknown model": ({"model": "gpt-9", **GOOD}, 404, "model"),
    "temperature < 0": ({"temperature": -1, **GOOD}, 400, "temperature"),
    "top_p 0": ({"top_p": 0, **GOOD}, 400, "top_p"),
    "n 0": ({"n": 0, **GOOD}, 400, "n"),
    "n past max_num_seqs": ({"n": 100, **GOOD}, 400, "n"),
    "max_tokens 0": ({**GOOD, "max_tokens": 0}, 400, "max_tokens"),
    "max_tokens a string": ({**GOOD, "max_tokens": "many"}, 400, "max_tokens"),
    "seed past int64": ({"seed": 1 << 63, **GOOD}, 400, "seed"),
    "top_k past int64": ({"top_k": 1 << 64, **GOOD}, 400, "top_k"),
    "empty stop": ({"stop": [""], **GOOD}, 400, "stop"),
    "penalty past 2": ({"presence_penalty": 2.5, **GOOD}, 400, "presence_penalty"),
    "logprobs 100": ({"logprobs": 100, **GOOD}, 400, "logprobs"),
    "prompt_logprobs streamed": ({"prompt_logprobs": 1, "stream": True, **GOOD}, 400, "prompt_logprobs"),
    "empty prompt list": ({"prompt": [], "max_tokens": 3}, 400, "prompt"),
    "token past vocab": ({"prompt": [1, 99999], "max_tokens": 3}, 400, "prompt"),
    "negative token": ({"prompt": [1, -1], "max_tokens": 3}, 400, "prompt"),
    "longer than the model": ({"prompt": "hello " * 400, "max_tokens": 3}, 400, "prompt"),
    "max_tokens past the context": ({"prompt": "hello", "max_tokens": 5000}, 400, "max_tokens"),
    "samples past the KV pool": ({"prompt": "hello", "max_tokens": 300, "n": 8}, 400, "max_tokens"),
    "prompt an object": ({"prompt": {"a": 1}, "max_tokens": 3}, 400, "prompt"),
}


@pytest.mark.parametrize("case", list(BAD_BODIES))
def test_bad_requests_get_openai_errors_naming_the_field_and_the_server_keeps_serving(served, client, case):
    body, status, param = BAD_BODIES[case]
    if isinstance(body, dict):
        body = {"model": _model(served), **body} if "model" not in body else body
        r = httpx.post(served.url + "/v1/completions", json=body)
    else:
        r = httpx.post(served.url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    refused(r, param, status)
    assert client.completions.create(model=_model(served), **GOOD).choices[0].finish_reason


BAD_CHATS = {
    "no messages": {"messages": []},
    "bad role": {"messages": [{"role": "wizard", "content": "hi"}]},
    "content a number": {"messages": [{"role": "user", "content": 5}]},
    "top_logprobs 50": {"messages": CHAT, "logprobs": True, "top_logprobs": 50},
}


@pytest.mark.parametrize("case", list(BAD_CHATS))
def test_bad_chat_requests_get_400(served, client, case):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=_model(served), max_tokens=3, **BAD_CHATS[case])
    assert info.value.body["message"]
    assert client.chat.completions.create(model=_model(served), messages=CHAT, max_tokens=2).choices


def test_chat_without_max_tokens_runs_to_eos_or_the_context(served, client):
    r = client.chat.completions.create(model=_model(served), messages=CHAT, temperature=0)
    context = served.llm.engine.model.config.max_position_embeddings
    assert r.usage.total_tokens == context or r.choices[0].finish_reason == "stop"
    assert r.usage.total_tokens <= context


def test_unknown_routes_get_an_openai_404(served):
    r = httpx.get(served.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == 404


def test_metrics_parse_and_count_the_requests(served, client):
    client.completions.create(model=_model(served), prompt="hello", max_tokens=5, temperature=0)
    text = httpx.get(served.url + "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:num_requests_swapped",
                 "vllm:kv_cache_usage_perc", "vllm:num_preemptions", "vllm:time_to_first_token_seconds",
                 "vllm:time_per_output_token_seconds", "vllm:e2e_request_latency_seconds", "vllm:generation_tokens",
                 "paged_kv:prefix_cache_hit_rate", "paged_kv:cow_copies"):  # fmt: skip
        assert name in families, name
    samples = {s.name: s.value for f in families.values() for s in f.samples}
    assert samples["vllm:generation_tokens_total"] >= 5
    assert samples["vllm:e2e_request_latency_seconds_count"] >= 1
    assert samples["vllm:num_requests_running"] == 0


def test_a_client_that_gives_up_on_a_whole_response_aborts_it(served, monkeypatch):
    before = served.engine.num_aborted
    hold_steps(served, monkeypatch)  # no answer before the timeout, and aborted rather than run out
    body = {"model": _model(served), "prompt": "hello", "max_tokens": 480, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(served.url + "/v1/completions", json=body, timeout=0.3)
    wait_idle(served)
    wait_aborted(served, before + 1)
    assert served.engine.num_aborted == before + 1
