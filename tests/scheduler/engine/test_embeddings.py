"""Embedding requests on SmolLM2 against transformers: LAST and MEAN pooling of the final-norm hidden states,
normalized or not, chunked prefill, batches, prefix-cache hits, Matryoshka truncation, token-id inputs, blocks
freed, aborts, and generation requests in the same steps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from paged_kv.errors import InvalidArgumentError
from scheduler.core.config import CacheConfig, EngineConfig, SchedulerConfig
from scheduler.core.params import SamplingParams
from scheduler.core.pooling_params import PoolerConfig, PoolingParams
from scheduler.entrypoints.llm import LLM
from scheduler.model.loader import LoadedModel

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "hi",
    "Paris is the capital of France, a large city with many museums, parks and old bridges over the Seine river.",
]
RAW = PoolingParams(normalize=False)
ATOL = 2e-4  # float32 on both sides; the hidden states reach ~30 in magnitude


def _llm(smollm2, *, budget: int = 512, pooler: PoolerConfig | None = None, prefix: bool = True) -> LLM:
    """An LLM over the session's SmolLM2 with ``budget`` tokens per step (chunked prefill past it)."""
    hf, tokenizer = smollm2
    config = EngineConfig(cache=CacheConfig(block_size=4, num_gpu_blocks=256, enable_prefix_caching=prefix),
                          scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=4), device="cpu",
                          pooler_config=pooler or PoolerConfig())  # fmt: skip
    return LLM(LoadedModel(hf, tokenizer, "smollm2"), engine_config=config)


@pytest.fixture(scope="module")
def llm(smollm2) -> LLM:
    """LAST pooling (the default), 8 tokens per step: every text but "hi" is prefilled in chunks."""
    return _llm(smollm2, budget=8)


@pytest.fixture(scope="module")
def hidden(smollm2):
    """transformers' final hidden states (after the final norm: ``last_hidden_state`` of the base model) of a
    token list, float32 [T, hidden]."""
    hf, _ = smollm2

    def run(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return hf.model(torch.tensor([ids])).last_hidden_state[0].float()

    return run


def _vector(out) -> torch.Tensor:
    return torch.tensor(out.outputs.embedding)


def test_last_token_pooling_equals_transformers_normalized_or_not(llm, hidden):
    ids = [llm.tokenizer.encode(t) for t in TEXTS]
    assert len(ids[0]) > 8 and len(ids[2]) > 16 and len(ids[1]) < 8  # chunked, chunked, one step
    raw, normed = llm.embed(TEXTS, RAW), llm.embed(TEXTS)
    for prompt, r, n in zip(ids, raw, normed):
        ref = hidden(prompt)[-1]
        assert r.finished and r.prompt_token_ids == prompt and r.outputs.hidden_size == ref.shape[0]
        torch.testing.assert_close(_vector(r), ref, atol=ATOL, rtol=1e-4)
        torch.testing.assert_close(_vector(n), F.normalize(ref, dim=0), atol=1e-5, rtol=1e-4)
        assert abs(_vector(n).norm().item() - 1.0) < 1e-5


def test_chunked_prefill_equals_one_step(smollm2, llm):
    whole = _llm(smollm2, budget=512)
    for a, b in zip(llm.embed(TEXTS, RAW), whole.embed(TEXTS, RAW)):
        torch.testing.assert_close(_vector(a), _vector(b), atol=ATOL, rtol=1e-4)


def test_mean_pooling_equals_transformers_across_chunks(smollm2, hidden):
    mean = _llm(smollm2, budget=8, pooler=PoolerConfig(pooling_type="MEAN", normalize=False))
    for text, out in zip(TEXTS, mean.embed(TEXTS)):
        ref = hidden(mean.tokenizer.encode(text)).mean(0)
        torch.testing.assert_close(_vector(out), ref, atol=ATOL, rtol=1e-4)
    again = mean.embed(TEXTS[2])[0]  # MEAN reads no prefix cache: every token's hidden state is computed again
    assert again.num_cached_tokens == 0
    torch.testing.assert_close(_vector(again), hidden(again.prompt_token_ids).mean(0), atol=ATOL, rtol=1e-4)


def test_prefix_cache_hits_give_the_same_vector(llm, hidden):
    text = TEXTS[2] + " It is old."
    llm.embed(text)
    (hit,) = llm.embed(text, RAW)  # every full block but the one holding the last token is cached now
    assert len(hit.prompt_token_ids) - 4 <= hit.num_cached_tokens < len(hit.prompt_token_ids)
    torch.testing.assert_close(_vector(hit), hidden(hit.prompt_token_ids)[-1], atol=ATOL, rtol=1e-4)


def test_a_batch_of_token_id_prompts_equals_one_by_one_and_the_text_prompts(llm):
    ids = [llm.tokenizer.encode(t) for t in TEXTS]
    batch = llm.embed(ids, RAW)
    for prompt, out in zip(ids, batch):
        (alone,) = llm.embed(prompt, RAW)
        torch.testing.assert_close(_vector(out), _vector(alone), atol=ATOL, rtol=1e-4)
    for a, b in zip(batch, llm.embed(TEXTS, RAW)):
        torch.testing.assert_close(_vector(a), _vector(b), atol=ATOL, rtol=1e-4)


def test_matryoshka_dimensions_truncate_then_normalize(smollm2, hidden):
    pooler = PoolerConfig(is_matryoshka=True, matryoshka_dimensions=(64, 128))
    m = _llm(smollm2, pooler=pooler)
    ref = hidden(m.tokenizer.encode(TEXTS[0]))[-1]
    (cut,) = m.embed(TEXTS[0], PoolingParams(dimensions=64))
    torch.testing.assert_close(_vector(cut), F.normalize(ref[:64], dim=0), atol=1e-5, rtol=1e-4)
    (raw,) = m.embed(TEXTS[0], PoolingParams(dimensions=128, normalize=False))
    torch.testing.assert_close(_vector(raw), ref[:128], atol=ATOL, rtol=1e-4)
    with pytest.raises(InvalidArgumentError, match="dimensions"):
        m.embed(TEXTS[0], PoolingParams(dimensions=100))  # not a listed size
    assert not m.engine.has_unfinished_requests()


def test_dimensions_refused_on_a_model_that_is_not_matryoshka(llm):
    hidden_size = llm.engine.model.config.hidden_size
    with pytest.raises(InvalidArgumentError, match="Matryoshka"):
        llm.embed(TEXTS, PoolingParams(dimensions=64))
    (full,) = llm.embed(TEXTS[0], PoolingParams(dimensions=hidden_size))  # its own size is no truncation
    assert full.outputs.hidden_size == hidden_size
    assert not llm.engine.has_unfinished_requests()


def test_blocks_are_freed_and_an_abort_mid_prefill_frees_them(llm):
    engine = llm.engine
    start = engine.block_manager.gpu.num_free
    llm.embed(TEXTS)
    assert engine.block_manager.seq_ids() == [] and engine.block_manager.gpu.num_free == start
    prompt = llm.tokenizer.encode(TEXTS[2] * 2)
    engine.add_pooling_request("long", prompt)
    engine.step()  # one 8-token chunk of a long prompt
    group = engine.scheduler.requests["long"]
    assert 0 < group.seqs[0].num_computed < len(prompt) and engine.block_manager.seq_ids()
    out = engine.abort("long")
    assert out.finished and out.outputs.embedding == []
    assert engine.block_manager.seq_ids() == [] and engine.block_manager.gpu.num_free == start


def test_stop_samples_refuses_an_embedding_request_and_leaves_it_running(llm, hidden):
    """An embedding request has no samples: stop_samples raises naming request_id, and the request still ends
    with its vector."""
    engine = llm.engine
    prompt = llm.tokenizer.encode("A prompt no other test sends, so none of it is cached: " + TEXTS[0])
    engine.add_pooling_request("emb", prompt, RAW)
    engine.step()  # one 8-token chunk: still running
    group = engine.scheduler.requests["emb"]
    before = (group.seqs[0].num_computed, group.is_finished())
    with pytest.raises(InvalidArgumentError, match="request_id.*embedding request"):
        engine.stop_samples("emb", [0])
    assert (group.seqs[0].num_computed, group.is_finished()) == before
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    (out,) = outs
    torch.testing.assert_close(_vector(out), hidden(prompt)[-1], atol=ATOL, rtol=0)


def test_generation_in_the_same_steps_is_unchanged(smollm2):
    llm = _llm(smollm2, budget=16)
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    (alone,) = llm.generate(TEXTS[0], greedy)
    (ref,) = llm.embed(TEXTS[2], RAW)
    engine = llm.engine
    engine.add_request("gen", llm.tokenizer.encode(TEXTS[0]), greedy)
    engine.add_pooling_request("emb", llm.tokenizer.encode(TEXTS[2]), RAW)
    done = {}
    while engine.has_unfinished_requests():
        steps = {o.request_id: o for o in engine.step()}
        assert "emb" not in steps or "gen" not in done  # the embedding finished while generation ran
        done |= steps
    assert done["gen"].outputs[0].token_ids == alone.outputs[0].token_ids
    torch.testing.assert_close(_vector(done["emb"]), _vector(ref), atol=ATOL, rtol=1e-4)
