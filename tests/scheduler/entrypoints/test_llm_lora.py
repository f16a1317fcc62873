"""LLM.generate / chat / beam_search with lora_request: each prompt through its adapter, as transformers merged."""

from __future__ import annotations

import pytest
from beam_helpers import hf_beams
from lora_helpers import merged, write_adapter
from sched_helpers import greedy_reference

from paged_kv.errors import InvalidArgumentError
from scheduler import LLM, CacheConfig, EngineConfig, LoRARequest, SamplingParams
from scheduler.engine.beam_selection import BeamSearchParams

NEW = 8
GREEDY = SamplingParams(max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    config = EngineConfig(cache=CacheConfig(block_size=4, num_gpu_blocks=256), device="cpu")
    return LLM(tiny_model_dir, engine_config=config, enable_lora=True, max_loras=2, max_lora_rank=8)


@pytest.fixture(scope="module")
def adapters(hf, tmp_path_factory):
    root = tmp_path_factory.mktemp("llm-adapters")
    return [LoRARequest(name=n, path=write_adapter(root / n, hf, seed=10 + i)) for i, n in enumerate(("a", "b"))]


def test_generate_takes_one_adapter_per_prompt(llm, hf, adapters):
    prompts = ["hello world", "hello world", "hello world"]
    loras = [adapters[0], adapters[1], None]
    outs = llm.generate(prompts, GREEDY, lora_request=loras)
    ids = llm.encode("hello world")[0]
    want = [greedy_reference(merged(hf, r.path) if r else hf, [ids], NEW)[0] for r in loras]
    assert [o.outputs[0].token_ids for o in outs] == want
    assert len({tuple(w) for w in want}) == 3  # the adapters change the answer


def test_chat_and_one_adapter_for_all(llm, hf, adapters):
    chat = [{"role": "user", "content": "hi"}]
    outs = llm.chat([chat, chat], GREEDY, lora_request=adapters[1])
    ids = llm.chat_prompt(chat)
    want = greedy_reference(merged(hf, adapters[1].path), [ids], NEW)[0]
    assert [o.outputs[0].token_ids for o in outs] == [want, want]


def test_beam_search_through_an_adapter(llm, hf, adapters):
    ids = llm.encode("hello")[0]
    (out,) = llm.beam_search([ids], BeamSearchParams(width=2, max_tokens=4), lora_request=adapters[0])
    eos = hf.generation_config.eos_token_id
    assert [h.token_ids for h in out.hypotheses] == hf_beams(merged(hf, adapters[0].path), ids, width=2, new=4,
                                                             eos=eos)[0]  # fmt: skip


def test_a_bad_adapter_queues_nothing(llm, adapters, tmp_path):
    bad = LoRARequest(name="bad", path=str(tmp_path))
    with pytest.raises(InvalidArgumentError, match="^lora_request.path="):
        llm.generate(["x", "y"], GREEDY, lora_request=[adapters[0], bad])
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(InvalidArgumentError, match="^lora_request="):
        llm.generate(["x", "y"], GREEDY, lora_request=[adapters[0]])
