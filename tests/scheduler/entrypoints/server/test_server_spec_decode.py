"""A server with speculative decoding: vLLM's spec-decode counters on /metrics, answers equal to those without drafts
(a request with penalties and bad words drafts too), and no such series when it is off."""

from __future__ import annotations

import dataclasses

import openai
import pytest
from server_helpers import ENGINE, scrape, serving, wait_idle

from scheduler.core.params import SamplingParams
from scheduler.core.speculative_config import SpeculativeConfig

SPEC_ENGINE = dataclasses.replace(ENGINE, speculative_config=SpeculativeConfig(
    num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1))  # fmt: skip
PROMPT = "the cat sat on the mat, the cat sat on the"
COUNTERS = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
            "vllm:spec_decode_num_accepted_tokens_total")  # fmt: skip


@pytest.fixture(scope="module")
def served_spec(looping_model_dir):
    from scheduler.entrypoints.server.config import ServerConfig

    with serving(looping_model_dir, ServerConfig(max_in_flight=16), engine=SPEC_ENGINE) as s:
        yield s


@pytest.fixture(scope="module")
def plain(looping_model_dir):
    from scheduler.entrypoints.llm import LLM

    return LLM(looping_model_dir, engine_config=ENGINE)


def _counters(samples: dict) -> dict:
    per_pos = {dict(labels)["position"]: v for (name, labels), v in samples.items()
               if name == "vllm:spec_decode_num_accepted_tokens_per_pos_total"}  # fmt: skip
    totals = {name: v for (name, labels), v in samples.items() if name in COUNTERS}
    return totals | {"per_pos": per_pos}


def test_metrics_show_the_spec_decode_counters_of_the_engine(served_spec, plain):
    before = _counters(scrape(served_spec))  # empty until the engine published its first step
    with openai.OpenAI(base_url=served_spec.url + "/v1", api_key="-", max_retries=0) as client:
        answer = client.completions.create(model=served_spec.llm.model_name, prompt=PROMPT, max_tokens=40,
                                           temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    (want,) = plain.generate([PROMPT], SamplingParams(max_tokens=40, ignore_eos=True))
    assert answer.choices[0].text == want.outputs[0].text
    wait_idle(served_spec)
    after = _counters(scrape(served_spec))
    stats = served_spec.llm.engine.spec.stats
    assert after["vllm:spec_decode_num_drafts_total"] == stats.num_drafts > before.get(COUNTERS[0], 0)
    assert after["vllm:spec_decode_num_draft_tokens_total"] == stats.num_draft_tokens
    assert after["vllm:spec_decode_num_accepted_tokens_total"] == stats.num_accepted_tokens > 0
    assert after["per_pos"] == {str(i): n for i, n in enumerate(stats.accepted_per_pos)} and len(after["per_pos"]) == 3
    assert sum(after["per_pos"].values()) == stats.num_accepted_tokens


def test_a_request_with_logits_controls_drafts_and_answers_as_without(served_spec, plain):
    """Penalties and bad words (the server tokenizes them) are applied per draft row: drafts run, same answer."""
    wait_idle(served_spec)
    before = served_spec.llm.engine.spec.stats.num_drafts
    controls = dict(frequency_penalty=0.05, presence_penalty=0.05)
    extra = dict(ignore_eos=True, repetition_penalty=1.05, bad_words=["mat"])
    with openai.OpenAI(base_url=served_spec.url + "/v1", api_key="-", max_retries=0) as client:
        answer = client.completions.create(model=served_spec.llm.model_name, prompt=PROMPT, max_tokens=30,
                                           temperature=0, **controls, extra_body=extra)  # fmt: skip
    (want,) = plain.generate([PROMPT], SamplingParams(max_tokens=30, **controls, **extra))
    assert answer.choices[0].text == want.outputs[0].text
    wait_idle(served_spec)
    assert served_spec.llm.engine.spec.stats.num_drafts > before


def test_no_spec_decode_series_when_it_is_off(served_chunked):
    assert not any(name.startswith("vllm:spec_decode") for name, _ in scrape(served_chunked))
