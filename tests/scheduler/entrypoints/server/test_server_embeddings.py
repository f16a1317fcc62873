"""``POST /v1/embeddings`` through the official client against a real server (``--convert embed``), transformers'
final hidden states as the oracle; generation on the same server; refusals naming their field; metrics; blocks."""

from __future__ import annotations

import dataclasses

import httpx
import openai
import pytest
import torch
import torch.nn.functional as F
from server_helpers import CHUNKED, refused, scrape, serving, wait_idle

from scheduler.core.pooling_params import PoolerConfig

TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog and runs far away into the woods", "abc"]


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    """Embeddings and generation from one engine whose steps hold 32 tokens (long inputs run in chunks)."""
    from scheduler.entrypoints.server.config import ServerConfig

    with serving(tiny_model_dir, ServerConfig(max_in_flight=64, convert="embed"), engine=CHUNKED) as s:
        yield s


@pytest.fixture(scope="module")
def hf_hidden(tiny_model_dir):
    """transformers' last hidden states (after the final norm) of a token list: [T, hidden] float32."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)).eval()

    def run(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return hf.model(torch.tensor([ids])).last_hidden_state[0].float()

    return run


def _client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _ids(served, text: str) -> list[int]:
    return served.llm.tokenizer.encode(text, add_special_tokens=True)


def test_strings_equal_transformers_last_token_normalized(served, hf_hidden):
    with _client(served) as client:
        r = client.embeddings.create(model=served.model, input=TEXTS, encoding_format="float")
    assert [d.index for d in r.data] == [0, 1, 2] and r.model == served.model
    ids = [_ids(served, t) for t in TEXTS]
    assert len(ids[1]) > 32  # prefilled in chunks
    for d, prompt in zip(r.data, ids):
        ref = F.normalize(hf_hidden(prompt)[-1], dim=0)
        torch.testing.assert_close(torch.tensor(d.embedding), ref, atol=1e-5, rtol=1e-4)
    total = sum(map(len, ids))
    assert (r.usage.prompt_tokens, r.usage.total_tokens) == (total, total)


def test_base64_the_client_default_decodes_to_the_floats(served):
    with _client(served) as client:
        floats = client.embeddings.create(model=served.model, input=TEXTS[0], encoding_format="float")
        default = client.embeddings.create(model=served.model, input=TEXTS[0])  # the client asks for base64
    assert default.data[0].embedding == pytest.approx(floats.data[0].embedding, abs=1e-7)
    raw = served.post("embeddings", {"input": TEXTS[0], "encoding_format": "base64"}).json()
    assert isinstance(raw["data"][0]["embedding"], str) and raw["object"] == "list"


def test_token_ids_and_lists_of_token_ids_equal_their_texts(served):
    ids = [_ids(served, t) for t in TEXTS]
    with _client(served) as client:
        texts = client.embeddings.create(model=served.model, input=TEXTS, encoding_format="float")
        one = client.embeddings.create(model=served.model, input=ids[0], encoding_format="float")
        many = client.embeddings.create(model=served.model, input=ids, encoding_format="float")
    assert one.data[0].embedding == pytest.approx(texts.data[0].embedding, abs=1e-5)
    for a, b in zip(many.data, texts.data):
        assert a.embedding == pytest.approx(b.embedding, abs=1e-5)
    assert one.usage.prompt_tokens == len(ids[0])
    zero = served.post("embeddings", {"input": [0], "encoding_format": "float"})  # token id 0 is a token
    assert zero.status_code == 200 and zero.json()["usage"]["prompt_tokens"] == 1


def test_truncate_prompt_tokens_keeps_the_last_tokens(served, hf_hidden):
    ids = _ids(served, TEXTS[1])
    body = {"input": TEXTS[1], "truncate_prompt_tokens": 5, "encoding_format": "float"}
    r = served.post("embeddings", body).json()
    assert r["usage"]["prompt_tokens"] == 5
    ref = F.normalize(hf_hidden(ids[-5:])[-1], dim=0)
    torch.testing.assert_close(torch.tensor(r["data"][0]["embedding"]), ref, atol=1e-5, rtol=1e-4)
    refused(served.post("embeddings", {"input": "a", "truncate_prompt_tokens": 0}), "truncate_prompt_tokens")


def test_bad_inputs_are_refused_naming_the_field(served):
    limit = served.app.state.frontend.max_model_len
    vocab = served.llm.engine.model.config.vocab_size
    for bad in ("", [], [""], [[]], [1, -1]):
        refused(served.post("embeddings", {"input": bad}), "input")
    refused(served.post("embeddings", {"input": [1] * (limit + 1)}), "input")  # longer than max_model_len
    refused(served.post("embeddings", {"input": [1, vocab]}), "input")  # outside the vocabulary
    refused(served.post("embeddings", {"input": "hi", "dimensions": 8}), "dimensions")  # not a Matryoshka model
    refused(served.post("embeddings", {"input": "hi", "dimensions": 0}), "dimensions")
    refused(served.post("embeddings", {"input": "hi", "encoding_format": "int8"}), "encoding_format")
    refused(served.post("embeddings", {"input": "hi", "pooling": "cls"}), "pooling")  # unknown field
    refused(served.post("embeddings", {"input": "hi", "model": "other"}), "model", status=404)
    with _client(served) as client, pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=served.model, input="")
    assert e.value.body["param"] == "input"
    wait_idle(served)


def test_generation_still_served_and_metrics_count_prompt_tokens_and_no_block_leaks(served):
    blocks = served.llm.engine.block_manager
    wait_idle(served)
    free = blocks.gpu.num_free  # cached blocks count as free (evictable)
    before = scrape(served)
    with _client(served) as client:
        r = client.embeddings.create(model=served.model, input=TEXTS, encoding_format="float")
        c = client.completions.create(model=served.model, prompt="hello", max_tokens=4, temperature=0)
    assert c.choices[0].finish_reason in ("length", "stop") and c.usage.completion_tokens >= 1
    wait_idle(served)
    after = scrape(served)
    key = next(k for k in after if k[0] == "vllm:prompt_tokens_total")
    assert after[key] - before.get(key, 0.0) == r.usage.prompt_tokens + c.usage.prompt_tokens
    assert blocks.seq_ids() == [] and blocks.gpu.num_free == free
    assert [m["id"] for m in httpx.get(served.url + "/v1/models").json()["data"]] == [served.model]


def test_matryoshka_dimensions_and_a_server_without_the_endpoint(tiny_model_dir, hf_hidden):
    from scheduler.entrypoints.server.config import ServerConfig

    engine = dataclasses.replace(CHUNKED, pooler_config=PoolerConfig(is_matryoshka=True, matryoshka_dimensions=(8,)))
    with serving(tiny_model_dir, ServerConfig(convert="embed"), engine=engine) as s:
        with _client(s) as client:
            r = client.embeddings.create(model=s.model, input="hello world", dimensions=8, encoding_format="float")
        ref = F.normalize(hf_hidden(_ids(s, "hello world"))[-1][:8], dim=0)
        torch.testing.assert_close(torch.tensor(r.data[0].embedding), ref, atol=1e-5, rtol=1e-4)
        refused(s.post("embeddings", {"input": "hi", "dimensions": 4}), "dimensions")  # not a listed size
    with serving(tiny_model_dir, ServerConfig(), engine=CHUNKED) as plain:
        assert plain.post("embeddings", {"input": "hi"}).status_code == 404
