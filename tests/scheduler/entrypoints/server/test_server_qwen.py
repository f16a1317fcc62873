"""The server over a Qwen3 checkpoint folder: its ChatML template renders and the answer is transformers' greedy one."""

from __future__ import annotations

import httpx
import pytest
from sched_helpers import NUM_NEW, greedy_reference
from server_helpers import CHAT, serving

NO_THINKING = {"enable_thinking": False}  # Qwen3's template switch: an empty thinking block opens the answer


@pytest.fixture(scope="module")
def served_qwen(tmp_path_factory):
    """(server, the transformers model it serves): a tiny random Qwen3 folder (q/k norms, head_dim 32, tied)."""
    from text_helpers import save_tiny_qwen

    from scheduler.model.loader import load_model

    folder = save_tiny_qwen(tmp_path_factory.mktemp("qwen") / "tiny-qwen3", "qwen3", head_dim=32,
                            tie_word_embeddings=True)  # fmt: skip
    loaded = load_model(folder)
    with serving(loaded) as s:
        yield s, loaded.hf_model


def test_a_chat_completion_renders_the_qwen_template_and_answers_transformers_tokens(served_qwen):
    import openai

    served, hf = served_qwen
    tokenizer = served.llm.tokenizer  # the folder's
    ids = list(tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False,
                                             **NO_THINKING))  # fmt: skip
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    body = {"model": served.model, "messages": CHAT, "chat_template_kwargs": NO_THINKING}
    r = httpx.post(f"{served.url}/tokenize", json=body, timeout=60)  # vLLM's route, outside /v1
    assert r.json()["tokens"] == ids
    with openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        out = client.chat.completions.create(
            model=served.model, messages=CHAT, max_tokens=NUM_NEW, temperature=0,
            extra_body={"chat_template_kwargs": NO_THINKING, "ignore_eos": True},
        )  # fmt: skip
    (ref,) = greedy_reference(hf, [ids])
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == NUM_NEW
    assert out.choices[0].message.content == tokenizer.decode(ref, skip_special_tokens=True)
