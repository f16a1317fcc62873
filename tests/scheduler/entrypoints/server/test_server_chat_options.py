"""vLLM's chat-rendering options on /v1/chat/completions and /tokenize: each renders as transformers renders.

``add_generation_prompt``, ``continue_final_message``, ``add_special_tokens``, ``chat_template_kwargs``,
and ``chat_template`` (only with ``--trust-request-chat-template``): the prompt the engine gets, the one
/tokenize answers and usage.prompt_tokens all equal the tiny tokenizer's own rendering with the same
arguments; bad combinations are 400s naming the field, and nothing is queued.
"""

from __future__ import annotations

import httpx
import pytest
from server_helpers import CHAT, refused, serving

from scheduler.core.params import SamplingParams
from scheduler.entrypoints.server.config import ServerConfig

CONTINUED = [*CHAT, {"role": "assistant", "content": "hello wor"}]
TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}{% if greeting is defined %} {{ greeting }}{% endif %}"
)


def tokenize(served, body: dict) -> httpx.Response:
    """``POST /tokenize`` (not under /v1)."""
    return httpx.post(f"{served.url}/tokenize", json=body, timeout=60)


def expected_ids(tok, messages: list[dict], add_special_tokens: bool = False, **kw) -> list[int]:
    """transformers' rendering of ``messages`` with ``kw``, encoded as vLLM encodes it."""
    text = tok.apply_chat_template(messages, tokenize=False, **kw)
    return tok(text, add_special_tokens=add_special_tokens)["input_ids"]


def served_ids(served, captured, body: dict) -> list[int]:
    """The prompt /tokenize gives for ``body``, checked equal to the one a chat completion hands to the engine."""
    tokens = tokenize(served, body)
    assert tokens.status_code == 200, tokens.text
    chat = served.post("chat/completions", {**body, "max_tokens": 1})
    assert chat.status_code == 200, chat.text
    [([(ids, _)], _)] = captured[-1:]
    assert tokens.json()["tokens"] == ids and chat.json()["usage"]["prompt_tokens"] == len(ids)
    return ids


@pytest.mark.parametrize(("messages", "options"), [
    (CHAT, {}),
    (CHAT, {"add_generation_prompt": True, "continue_final_message": False, "add_special_tokens": False}),
    (CHAT, {"add_generation_prompt": False}),
    (CONTINUED, {"add_generation_prompt": False, "continue_final_message": True}),
    (CHAT, {"add_generation_prompt": False, "continue_final_message": True}),  # a user's final message, as vLLM
    (CHAT, {"chat_template_kwargs": {"enable_thinking": False}}),  # a variable the template does not read
])  # fmt: skip
def test_each_option_renders_as_transformers_renders(served, captured, messages, options):
    ids = served_ids(served, captured, {"messages": messages, **options})
    kw = {k: v for k, v in options.items() if k != "chat_template_kwargs"} | options.get("chat_template_kwargs", {})
    kw.setdefault("add_generation_prompt", True)
    assert ids == expected_ids(served.llm.tokenizer, messages, **kw)


def test_the_default_rendering_is_unchanged(served, captured):
    ids = served_ids(served, captured, {"messages": CHAT})
    assert ids == served.llm.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)["input_ids"]


def test_add_special_tokens_puts_the_tokenizers_bos_before_the_rendering(served, captured, bos):
    plain = served_ids(served, captured, {"messages": CHAT})
    ids = served_ids(served, captured, {"messages": CHAT, "add_special_tokens": True})
    tok = served.llm.tokenizer
    assert ids == expected_ids(tok, CHAT, add_special_tokens=True, add_generation_prompt=True) == [bos, *plain]


def test_continue_final_message_leaves_the_assistants_text_open_and_continues_it(served, captured, offline):
    body = {"messages": CONTINUED, "add_generation_prompt": False, "continue_final_message": True}
    ids = served_ids(served, captured, body)
    tok = served.llm.tokenizer
    assert tok.decode(ids).endswith("<|im_start|>assistant\nhello wor") and ids[-1] != tok.eos_token_id
    r = served.post("chat/completions", {**body, "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200, r.text
    greedy = SamplingParams(max_tokens=5, temperature=0)
    (ref,) = offline.chat(CONTINUED, greedy, add_generation_prompt=False, continue_final_message=True)
    assert ref.prompt_token_ids == ids and r.json()["choices"][0]["message"]["content"] == ref.outputs[0].text


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": CONTINUED, "continue_final_message": True}, "continue_final_message"),  # with the default True
    ({"messages": CHAT, "chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    ({"messages": CHAT, "chat_template_kwargs": {"chat_template": "{{ 1 }}"}}, "chat_template_kwargs"),
    ({"messages": CHAT, "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ({"messages": CHAT, "chat_template_kwargs": ["x"]}, "chat_template_kwargs"),
    ({"messages": CHAT, "chat_template": TEMPLATE}, "chat_template"),  # without --trust-request-chat-template
    ({"messages": CHAT, "add_special_tokens": 1}, "add_special_tokens"),
    ({"messages": CHAT, "continue_final_message": "yes"}, "continue_final_message"),
])  # fmt: skip
def test_bad_options_are_400s_naming_the_field_and_nothing_is_queued(served, captured, body, param):
    error = refused(served.post("chat/completions", {**body, "max_tokens": 2}), param)
    refused(tokenize(served, body), param)
    assert captured == [] and served.engine.num_in_flight == 0
    if param == "continue_final_message" and body["continue_final_message"] is True:
        assert "add_generation_prompt" in error["message"] and "cannot set both" in error["message"]


@pytest.fixture(scope="module")
def trusted(tiny_model_dir):
    """A server that renders with a request's own chat template (``--trust-request-chat-template``)."""
    with serving(tiny_model_dir, ServerConfig(trust_request_chat_template=True)) as s:
        yield s


@pytest.mark.parametrize("kwargs", [{}, {"greeting": "hello"}])
def test_a_trusted_servers_requests_render_with_their_own_template(trusted, kwargs):
    body = {"messages": CHAT, "chat_template": TEMPLATE, "chat_template_kwargs": kwargs}
    ids = tokenize(trusted, body).json()["tokens"]
    tok = trusted.llm.tokenizer
    assert ids == expected_ids(tok, CHAT, chat_template=TEMPLATE, add_generation_prompt=True, **kwargs)
    assert tok.decode(ids).startswith("[system] be brief") and tok.decode(ids).endswith(
        "[assistant]" + (" hello" if kwargs else ""))
    r = trusted.post("chat/completions", {**body, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(ids), r.text


@pytest.mark.parametrize(("template", "param"), [
    ("{{ raise_exception('no system messages') }}", "chat_template"),  # the template refuses the conversation
    ("{% for m in messages %}", "chat_template"),  # not Jinja
    ("{{ messages[0]['nope']['x'] }}", "chat_template"),  # a runtime error
])  # fmt: skip
def test_a_template_that_fails_is_a_400_naming_chat_template(trusted, template, param):
    body = {"messages": CHAT, "chat_template": template}
    refused(trusted.post("chat/completions", {**body, "max_tokens": 2}), param)
    refused(tokenize(trusted, body), param)
    assert trusted.engine.num_in_flight == 0
    assert trusted.post("chat/completions", {"messages": CHAT, "max_tokens": 1}).status_code == 200


EFFORT = "{% for m in messages %}{{ m.content }}\n{% endfor %}effort={{ reasoning_effort }} " \
         "thinking={{ enable_thinking }}"


@pytest.mark.parametrize(("effort", "kwargs", "seen"), [
    (None, {}, "effort= thinking="),  # unset: the template sees neither
    ("low", {}, "effort=low thinking=True"),
    ("none", {}, "effort=none thinking=False"),
    (None, {"reasoning_effort": "medium"}, "effort=medium thinking="),  # the kwargs' own entry
    ("high", {"reasoning_effort": "medium", "enable_thinking": False}, "effort=high thinking=False"),
])  # fmt: skip
def test_reasoning_effort_is_a_template_variable_over_the_kwargs_entry(trusted, monkeypatch, effort, kwargs, seen):
    """As vLLM: the field wins over a chat_template_kwargs entry of its name and sets enable_thinking unless the
    kwargs do (sent through the official client, which types reasoning_effort)."""
    import openai

    prompts, generate = [], trusted.engine.generate
    spy = lambda p, params, **kw: prompts.append(p) or generate(p, params, **kw)  # noqa: E731
    monkeypatch.setattr(trusted.engine, "generate", spy)
    extra = {"chat_template": EFFORT, "chat_template_kwargs": kwargs}
    effort_kw = {} if effort is None else {"reasoning_effort": effort}
    with openai.OpenAI(base_url=trusted.url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        client.chat.completions.create(model=trusted.model, messages=CHAT, max_tokens=1, extra_body=extra, **effort_kw)
    assert trusted.llm.tokenizer.decode(prompts[-1][0][0]).endswith(seen)
