"""The answers clients rely on: model cards and lengths, logprobs, stop tokens, cached tokens, admission, limits."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest
from server_helpers import CHAT, hold_steps, refused, serving, sse_events, wait_idle
from text_helpers import first_text_token

from scheduler.core.config import CacheConfig, EngineConfig
from scheduler.core.params import SamplingParams
from scheduler.entrypoints.server.config import ServerConfig

PROMPT = "the quick brown fox"


def _usable_tokens(engine) -> int:
    """The longest sample the pool holds: a KV slot per token but the last (never fed back)."""
    pool = engine.block_manager.config
    return (pool.num_blocks - pool.watermark_blocks) * pool.block_size + 1


def test_models_advertise_what_one_request_can_get_and_each_model_has_its_card(served, client):
    engine = served.llm.engine
    expected = min(engine.model.config.max_position_embeddings, _usable_tokens(engine))
    (card,) = client.models.list().data
    assert (card.id, card.max_model_len) == (served.model, expected)
    assert client.models.retrieve(served.model).model_dump() == card.model_dump()
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")
    refused(httpx.get(f"{served.url}/v1/models/gpt-9"), "model", status=404)


@pytest.mark.parametrize(("blocks", "cap"), [(24, None), (512, 100)])
def test_max_model_len_is_the_kv_pool_or_the_cap_and_a_longer_request_is_refused(tiny_model_dir, blocks, cap):
    engine = EngineConfig(cache=CacheConfig(block_size=4, num_gpu_blocks=blocks), device="cpu")
    with serving(tiny_model_dir, ServerConfig(max_model_len=cap), engine) as s:
        longest = httpx.get(f"{s.url}/v1/models").json()["data"][0]["max_model_len"]
        assert longest == (cap or _usable_tokens(s.llm.engine)) < s.llm.engine.model.config.max_position_embeddings
        ids = s.llm.tokenizer.encode(PROMPT)
        body = {"prompt": ids, "max_tokens": longest - len(ids), "ignore_eos": True}
        r = s.post("completions", body)
        assert r.status_code == 200 and r.json()["usage"]["total_tokens"] == longest
        error = refused(s.post("completions", {**body, "max_tokens": longest - len(ids) + 1}), "max_tokens")
        assert f"max_model_len is {longest}" in error["message"]
        refused(s.post("completions", {"prompt": [5] * longest, "max_tokens": 1}), "prompt")
        chat = {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
        assert s.post("chat/completions", chat).json()["usage"]["total_tokens"] == longest


def test_samples_get_every_token_their_share_of_the_pool_holds(tiny_model_dir):
    """n=2 samples on 24 blocks of 4: 12 blocks, 48 KV slots each; a sample's last token is never fed back, so
    each gets prompt + max_tokens = 49 tokens (it was held to 48). An omitted max_tokens is that much, an explicit
    one that much is served, and one more is refused."""
    engine = EngineConfig(cache=CacheConfig(block_size=4, num_gpu_blocks=24, watermark=0.0), device="cpu")
    with serving(tiny_model_dir, ServerConfig(), engine) as s:
        ids = s.llm.tokenizer.encode(PROMPT)
        most = 49 - len(ids)
        body = {"prompt": ids, "n": 2, "temperature": 1.0, "seed": 1, "ignore_eos": True}
        r = s.post("completions", {**body, "max_tokens": most})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2 * most
        error = refused(s.post("completions", {**body, "max_tokens": most + 1}), "max_tokens")
        assert f"at most {most}: 2 samples must fit" in error["message"]
        chat = {"messages": [{"role": "user", "content": "hi"}], "n": 2, "ignore_eos": True, "temperature": 1.0}
        prompt_len = len(s.llm.chat_prompt(chat["messages"]))
        assert s.post("chat/completions", chat).json()["usage"]["completion_tokens"] == 2 * (49 - prompt_len)


def test_the_model_context_bounds_max_tokens_as_vllm_serves_it(served):
    """The served max_model_len is the model's context here (the pool holds more). As vLLM's server: a chat's
    omitted max_tokens is clamped to it (the answer stops there with "length"), an explicit one past it is a
    400 (a completion's omitted max_tokens is OpenAI's 16), and a prompt that leaves no room is a 400."""
    context = served.llm.engine.model.config.max_position_embeddings
    words = next(m for m in range(8, context, 8) if len(served.llm.chat_prompt(_long_chat(m))) > context - 24)
    room = context - len(served.llm.chat_prompt(_long_chat(words)))
    chat = {"model": served.model, "messages": _long_chat(words), "ignore_eos": True, "temperature": 0}
    r = served.post("chat/completions", chat).json()
    assert (r["choices"][0]["finish_reason"], r["usage"]["completion_tokens"]) == ("length", room)
    refused(served.post("chat/completions", chat | {"max_tokens": room + 1}), "max_tokens")
    body = {"model": served.model, "prompt": [5] * (context - 6), "ignore_eos": True, "temperature": 0}
    r = served.post("completions", body | {"max_tokens": 6}).json()
    assert (r["choices"][0]["finish_reason"], r["usage"]["completion_tokens"]) == ("length", 6)
    refused(served.post("completions", body), "max_tokens")  # the default 16 does not fit
    refused(served.post("completions", body | {"prompt": [5] * context, "max_tokens": 1}), "prompt")


def _long_chat(words: int) -> list[dict]:
    return [{"role": "user", "content": "hello " * words}]


def test_completion_logprobs_hold_the_sampled_token_and_streamed_offsets_continue(served):
    body = {"model": served.model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    for k in (0, 2):
        lp = served.post("completions", {**body, "logprobs": k}).json()["choices"][0]["logprobs"]
        for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
            assert top[token] == logprob and len(top) <= k + 1  # (tokens of equal text share a key)
            assert top == {token: logprob} if k == 0 else len(top) >= 1
        assert k == 0 or any(len(top) > 1 for top in lp["top_logprobs"])
    whole = served.post("completions", {**body, "logprobs": 1}).json()["choices"][0]["logprobs"]
    assert whole["text_offset"] == [sum(len(t) for t in whole["tokens"][:i]) for i in range(len(whole["tokens"]))]
    events = sse_events(served.post("completions", {**body, "logprobs": 1, "stream": True}).text)
    blocks = [e["choices"][0]["logprobs"] for e in events if e["choices"][0]["logprobs"]["tokens"]]
    assert len(blocks) > 1 and [x for b in blocks for x in b["text_offset"]] == whole["text_offset"]
    assert [x for b in blocks for x in b["tokens"]] == whole["tokens"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_token_leaves_no_text_and_is_the_stop_reason(served, offline, stream):
    (ref,) = offline.generate(PROMPT, SamplingParams(max_tokens=16, ignore_eos=True))
    tokens = ref.outputs[0].token_ids
    k = first_text_token(offline.tokenizer, tokens)
    body = {"model": served.model, "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
            "stop_token_ids": [tokens[k]], "stream": stream}  # fmt: skip
    body |= {"stream_options": {"include_usage": True}} if stream else {}
    r = served.post("completions", body)
    if stream:
        events = sse_events(r.text)
        text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
        last, usage = events[-2]["choices"][0], events[-1]["usage"]
    else:
        last = r.json()["choices"][0]
        text, usage = last["text"], r.json()["usage"]
    assert text == offline.tokenizer.decode(tokens[:k]) and not text.endswith(offline.tokenizer.decode([tokens[k]]))
    assert (last["finish_reason"], last["stop_reason"], usage["completion_tokens"]) == ("stop", tokens[k], k + 1)


def test_cached_tokens_count_the_prompt_tokens_found_in_the_prefix_cache(served, client):
    prompt = "the quick brown fox jumps over the lazy dog " * 3
    kw = dict(model=served.model, prompt=prompt, max_tokens=2, extra_body={"cache_salt": "cached-tokens-test"})
    first, second = client.completions.create(**kw), client.completions.create(**kw)
    n = first.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == (n - 1) // 4 * 4  # whole blocks, never the last token
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == (n - 1) // 4 * 4


def test_a_batch_larger_than_max_in_flight_is_a_400_and_one_that_fits_later_a_503(served, client, monkeypatch):
    engine, limit = served.engine, served.engine.max_in_flight
    hold_steps(served, monkeypatch)  # the stream is in flight until it is closed
    engine.max_in_flight = 2
    try:
        error = refused(served.post("completions", {"model": served.model, "prompt": ["a", "b", "c"]}), "prompt")
        assert "--max-in-flight" in error["message"]
        stream = client.completions.create(model=served.model, prompt="hello", max_tokens=480, stream=True,
                                           extra_body={"ignore_eos": True})  # fmt: skip
        next(iter(stream))
        r = served.post("completions", {"model": served.model, "prompt": ["a", "b"], "max_tokens": 2})
        stream.close()
    finally:
        engine.max_in_flight = limit
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    wait_idle(served)


def test_best_of_returns_the_most_likely_of_its_samples(served):
    body = {"model": served.model, "prompt": PROMPT, "max_tokens": 6, "temperature": 1.0, "seed": 3,
            "ignore_eos": True, "logprobs": 0}  # fmt: skip
    samples = served.post("completions", {**body, "n": 3}).json()
    best = max(samples["choices"], key=lambda c: sum(c["logprobs"]["token_logprobs"]))
    r = served.post("completions", {**body, "best_of": 3}).json()
    assert [c["text"] for c in r["choices"]] == [best["text"]]
    assert samples["usage"]["completion_tokens"] == 18  # n = 3: every sample is returned
    assert r["usage"]["completion_tokens"] == 6  # as vLLM: the returned sample's tokens, not the 18 generated
    refused(served.post("completions", {**body, "best_of": 3, "stream": True}), "best_of")
    refused(served.post("completions", {**body, "n": 3, "best_of": 2}), "best_of")


def test_a_body_over_the_limit_is_a_413_before_it_is_parsed(tiny_model_dir):
    with serving(tiny_model_dir, ServerConfig(max_request_bytes=2048, log_requests=False)) as s:
        big = {"model": s.model, "prompt": "x" * 3000}
        error = refused(s.post("completions", big), None, status=413)
        assert "2048 bytes" in error["message"]
        chunked = httpx.post(f"{s.url}/v1/completions", content=(b"x" * 1000 for _ in range(3)),
                             headers={"content-type": "application/json"})  # fmt: skip
        refused(chunked, None, status=413)
        assert s.post("completions", {"model": s.model, "prompt": "hi", "max_tokens": 2}).status_code == 200


def test_health_answers_while_a_huge_prompt_is_tokenized(served, monkeypatch):
    # the tokenizer is held mid-request until the probes are done: the same interleaving whether tokenizing
    # takes a second or a millisecond and the machine is idle or loaded (if it ran on the event loop, the
    # probes would hang until their timeout)
    prompt = "the quick brown fox jumps over the lazy dog " * 30_000  # 1.3 MB, far past max_model_len
    entered, release, encode = threading.Event(), threading.Event(), served.llm.encode
    done = {}

    def held(*args, **kw):
        entered.set()
        assert release.wait(60)
        return encode(*args, **kw)

    def post() -> None:
        done["response"] = served.post("completions", {"model": served.model, "prompt": prompt, "max_tokens": 1})

    monkeypatch.setattr(served.llm, "encode", held)
    thread = threading.Thread(target=post)
    thread.start()
    try:
        assert entered.wait(30), "the request never reached the tokenizer"
        for _ in range(5):
            assert httpx.get(f"{served.url}/health", timeout=10).status_code == 200
        assert not done  # every probe was answered while the request was still being tokenized
    finally:
        release.set()
        thread.join(60)
    refused(done["response"], "prompt")  # far past max_model_len


@pytest.mark.parametrize("prompt", ["the quick brown fox", [5, 6, 7, 8]])
def test_a_streamed_echo_sends_each_choice_what_the_whole_response_holds(served, prompt):
    """Streamed, echo is each choice's first chunk: the prompt and its tokens' logprobs; the chunks of a choice
    add up to the non-streamed choice (text, tokens, logprobs, text offsets)."""
    body = {"model": served.model, "prompt": prompt, "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 1,
            "n": 2, "seed": 3}  # fmt: skip
    whole = served.post("completions", body)
    assert whole.status_code == 200, whole.text
    streamed = served.post("completions", {**body, "stream": True})
    assert streamed.status_code == 200, streamed.text
    chunks = [c["choices"][0] for c in sse_events(streamed.text)]
    for choice in whole.json()["choices"]:
        mine = [c for c in chunks if c["index"] == choice["index"]]
        echo = mine[0]
        assert echo["text"] == prompt if isinstance(prompt, str) else len(echo["logprobs"]["tokens"]) == len(prompt)
        assert echo["logprobs"]["token_logprobs"][0] is None and echo["finish_reason"] is None
        assert "".join(c["text"] for c in mine) == choice["text"]
        for key in ("tokens", "text_offset"):
            assert [v for c in mine for v in c["logprobs"][key]] == choice["logprobs"][key]
        lps = [v for c in mine for v in c["logprobs"]["token_logprobs"]]
        assert lps[1:] == pytest.approx(choice["logprobs"]["token_logprobs"][1:], abs=1e-5)


def test_echo_and_prompt_logprobs_show_the_prompt_as_the_offline_engine_scores_it(served, offline):
    """echo puts the prompt before the text and its tokens (first: no logprob) before the output's;
    prompt_logprobs (vLLM) gives each prompt token's log-probability, equal to the offline engine's."""
    prompt = "the quick brown fox"
    body = {"model": served.model, "prompt": prompt, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 1,
            "prompt_logprobs": 2}  # fmt: skip
    r = served.post("completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    ref = offline.generate(prompt, SamplingParams(max_tokens=3, prompt_logprobs=2))[0]
    ids, scored = ref.prompt_token_ids, ref.prompt_logprobs
    assert choice["text"] == prompt + ref.outputs[0].text
    lps = choice["logprobs"]["token_logprobs"]
    assert len(lps) == len(ids) + 3 and lps[0] is None and choice["logprobs"]["top_logprobs"][0] is None
    assert lps[1 : len(ids)] == pytest.approx([scored[i][t] for i, t in enumerate(ids) if i], abs=1e-5)
    shown = choice["prompt_logprobs"]
    assert shown[0] is None and len(shown) == len(ids)
    for i, t in enumerate(ids[1:], start=1):
        assert shown[i][str(t)]["logprob"] == pytest.approx(scored[i][t], abs=1e-5)
        top = sorted(scored[i].items(), key=lambda kv: -kv[1])[:2]
        assert {int(k): e["rank"] for k, e in shown[i].items()} == {t: ref.prompt_ranks[i]} | {
            k: rank for rank, (k, _) in enumerate(top, start=1)}  # the top two by place, the token by its rank
    assert max(ref.prompt_ranks[1:]) > 2  # a token past the top two has its rank too (it used to be null)
    chat = served.post("chat/completions", {"model": served.model, "messages": CHAT, "max_tokens": 2,
                                            "prompt_logprobs": 0})  # fmt: skip
    assert chat.status_code == 200 and chat.json()["prompt_logprobs"][0] is None
