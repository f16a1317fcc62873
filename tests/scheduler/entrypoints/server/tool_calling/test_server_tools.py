"""Tool calling on /v1/chat/completions with the official client: validation, rendering, named, "required", "auto".

One server serves the module, with ``--enable-auto-tool-choice --tool-call-parser hermes`` and
``--trust-request-chat-template``; a test that needs "auto" off swaps the frontend's options.
The tiny model is random: a call's arguments follow its schema because the grammar holds them
to it, and "auto" is made to write a hermes call by a regex constraint on its output.
"""

from __future__ import annotations

import dataclasses
import json

import httpx
import jsonschema
import pytest
import xgrammar as xgr
from server_helpers import CHAT, force_thinking, refused, serving

from scheduler.core.structured_params import StructuredOutputsParams
from scheduler.entrypoints.server.config import ServerConfig
from scheduler.entrypoints.server.tool_calling.choice import required_schema
from scheduler.entrypoints.server.tool_calling.protocol import Tool

WEATHER = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}, "days": {"enum": [1, 2, 3]}},
           "required": ["unit", "days"], "additionalProperties": False}  # fmt: skip
CLOCK = {"type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"],
         "additionalProperties": False}  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "the forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "clock", "parameters": CLOCK}}]  # fmt: skip
SCHEMAS = {"weather": WEATHER, "clock": CLOCK}
CALLED = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [
              {"id": "call-1", "type": "function", "function": {"name": "weather", "arguments": '{"unit": "c"}'}}]},
          {"role": "tool", "tool_call_id": "call-1", "content": "sunny"}]  # fmt: skip
TOOL_TEMPLATE = (
    "{% for t in tools or [] %}[tool {{ t['function']['name'] }}: {{ t['function']['parameters'] | tojson }}]\n"
    "{% endfor %}"
    "{% for m in messages %}[{{ m['role'] }}{% if m['tool_call_id'] %} {{ m['tool_call_id'] }}{% endif %}] "
    "{{ m['content'] }}{% for c in m['tool_calls'] or [] %}<call {{ c['function']['name'] }} "
    "unit={{ c['function']['arguments']['unit'] }}>{% endfor %}\n{% endfor %}[assistant]"
)
NAMED = {"type": "function", "function": {"name": "weather"}}
AUTO_CALL = r'Hi <tool_call>\{"name": "clock", "arguments": \{"utc": (true|false)\}\}</tool_call>'  # "auto" calls


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    """A server with "auto" tool choice (hermes) and request chat templates enabled."""
    config = ServerConfig(enable_auto_tool_choice=True, tool_call_parser="hermes", trust_request_chat_template=True)
    with serving(tiny_model_dir, config) as s:
        yield s


def ask(served, **body) -> httpx.Response:
    """A chat completion of CHAT (unless ``messages`` is given) with ``body``."""
    return served.post("chat/completions", {"model": served.model, "messages": CHAT, "max_tokens": 256, **body})


def whole(choice) -> list[dict]:
    """A non-streamed choice's calls, each its name and arguments."""
    return [{"name": c.function.name, "arguments": c.function.arguments} for c in choice.message.tool_calls or []]


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "none"}, "tools"),  # duplicate names
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}], "tool_choice": "none"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "a.b"}}]}, "tools"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools"),
    ({"tools": []}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "use_beam_search": True, "n": 2}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": NAMED, "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": TOOLS, "tool_choice": "required", "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ({"messages": [*CHAT, {"role": "tool", "content": "x"}]}, "messages"),  # no tool_call_id
    ({"messages": [{"role": "user", "content": "x", "tool_calls": CALLED[2]["tool_calls"]}]}, "messages"),
    ({"messages": [*CHAT, {**CALLED[2], "tool_calls": [{**CALLED[2]["tool_calls"][0], "function": {
        "name": "weather", "arguments": "{unit"}}]}]}, "messages"),  # arguments not JSON
])  # fmt: skip
def test_a_bad_tool_field_is_a_400_naming_it(served, body, param):
    refused(ask(served, **body), param)


def test_auto_needs_the_flags_and_is_the_default_with_tools(served, monkeypatch):
    front = served.app.state.frontend
    monkeypatch.setattr(front, "config", dataclasses.replace(front.config, enable_auto_tool_choice=False))
    for body in ({"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "auto"}):
        error = refused(ask(served, **body), "tool_choice")
        assert "--enable-auto-tool-choice" in error["message"] and "--tool-call-parser" in error["message"]
    assert ask(served, tools=TOOLS, tool_choice="none", max_tokens=2).status_code == 200


@pytest.mark.parametrize("template", [None, TOOL_TEMPLATE])
def test_tools_and_tool_messages_render_as_transformers_renders(served, template):
    body = {"messages": CALLED, "tools": TOOLS} | ({"chat_template": template} if template else {})
    tokens = httpx.post(f"{served.url}/tokenize", json=body, timeout=60)
    assert tokens.status_code == 200, tokens.text
    answer = ask(served, **body, tool_choice="none", max_tokens=1)
    assert answer.json()["usage"]["prompt_tokens"] == len(tokens.json()["tokens"])
    tok = served.llm.tokenizer
    decoded = [*CALLED[:2], {**CALLED[2], "content": "", "tool_calls": [{**CALLED[2]["tool_calls"][0], "function": {
        "name": "weather", "arguments": {"unit": "c"}}}]}, CALLED[3]]  # fmt: skip
    text = tok.apply_chat_template(decoded, tools=TOOLS, chat_template=template, add_generation_prompt=True,
                                   tokenize=False)  # fmt: skip
    assert tokens.json()["tokens"] == tok(text, add_special_tokens=False)["input_ids"]
    if template:  # the template reads the tools and the calls: they are in the prompt
        assert "[tool weather:" in text and "<call weather unit=c>" in text and "[tool call-1] sunny" in text


def test_exclude_tools_when_tool_choice_none_renders_a_none_chat_without_its_tools(served, monkeypatch):
    front = served.app.state.frontend

    def prompt_tokens(exclude: bool, **body) -> int:
        config = dataclasses.replace(front.config, exclude_tools_when_tool_choice_none=exclude)
        monkeypatch.setattr(front, "config", config)
        out = ask(served, tools=TOOLS, chat_template=TOOL_TEMPLATE, max_tokens=1, **body)
        assert out.status_code == 200, out.text
        return out.json()["usage"]["prompt_tokens"]

    def tokenized(**body) -> int:
        out = httpx.post(f"{served.url}/tokenize", json={"messages": CHAT, "chat_template": TOOL_TEMPLATE, **body})
        assert out.status_code == 200, out.text
        return len(out.json()["tokens"])

    with_tools, without = tokenized(tools=TOOLS), tokenized()
    assert with_tools > without  # the template prints the tools
    assert prompt_tokens(True, tool_choice="none") == without
    assert prompt_tokens(False, tool_choice="none") == prompt_tokens(True, tool_choice=NAMED) == with_tools
    assert prompt_tokens(True) == with_tools  # unset with tools: "auto"


def test_a_named_function_is_called_with_arguments_that_follow_its_schema(served, client):
    out = client.chat.completions.create(model=served.model, messages=CHAT, tools=TOOLS, tool_choice=NAMED, n=2,
                                         temperature=1.0, seed=5, max_tokens=256)  # fmt: skip
    ids = set()
    for choice in out.choices:
        [call] = choice.message.tool_calls
        assert (call.function.name, call.type, choice.message.content) == ("weather", "function", "")
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
        assert choice.finish_reason == "stop" and call.id.startswith("chatcmpl-tool-")
        ids.add(call.id)
    assert len(ids) == 2


def test_the_required_constraint_writes_each_calls_name_before_its_parameters(served):
    """xgrammar keeps a schema's property order (its default): "required"'s reader names a call as soon as
    its name's string closes, before any of its parameters."""
    tools = [Tool.model_validate(t) for t in TOOLS]
    grammar = served.llm.engine.structured.grammar(StructuredOutputsParams(json=required_schema(tools, True)))
    assert xgr.GrammarMatcher(grammar).accept_string('[{"name": "clock", "parameters": {"utc": true}}]')
    assert not xgr.GrammarMatcher(grammar).accept_string('[{"parameters"')


def streamed(client, kw: dict) -> tuple[list[dict], list[int], str, str | None]:
    """A streamed answer's calls (each its name and arguments), how many deltas carried each call's arguments, its
    content and its finish reason; each call's first delta checked to carry its index, id, type and name."""
    calls, pieces, content, finish = [], [], "", None
    for chunk in client.chat.completions.create(stream=True, **kw):
        [choice] = chunk.choices
        finish, content = choice.finish_reason or finish, content + (choice.delta.content or "")
        for delta in choice.delta.tool_calls or []:
            if delta.id is not None:  # a call's first delta: its index, id, type and name
                assert (delta.index, delta.type, delta.id[:14]) == (len(calls), "function", "chatcmpl-tool-")
                calls.append({"name": delta.function.name, "arguments": ""})
                pieces.append(0)
            assert delta.id is not None or delta.function.name is None
            calls[delta.index]["arguments"] += delta.function.arguments
            pieces[delta.index] += bool(delta.function.arguments)
    return calls, pieces, content, finish


def accumulated(client, kw: dict) -> tuple[list[dict], str, str | None]:
    """A streamed answer joined by the official client's own accumulator: its calls, content and finish reason."""
    with client.chat.completions.stream(**kw) as stream:
        joined = stream.get_final_completion().choices[0]
    return whole(joined), joined.message.content or "", joined.finish_reason


@pytest.mark.parametrize("kind", ["named", "required", "auto"])
def test_streamed_calls_are_the_whole_responses_arriving_in_pieces(served, client, kind):
    kw = {"model": served.model, "messages": CHAT, "tools": TOOLS, "temperature": 0.0, "max_tokens": 256}
    auto = {"tool_choice": "auto", "extra_body": {"structured_outputs": {"regex": AUTO_CALL}}}
    kw |= {"named": {"tool_choice": NAMED}, "required": {"tool_choice": "required"}, "auto": auto}[kind]
    out = client.chat.completions.create(**kw).choices[0]
    calls, pieces, _, finish = streamed(client, kw)
    assert calls == whole(out) and finish == out.finish_reason
    assert pieces[0] > 1, pieces  # the arguments came as they were generated, not whole
    assert accumulated(client, kw) == (whole(out), out.message.content or "", out.finish_reason)


FORCED = {  # each parser's format as a regex the output is held to: its content, then a call of clock
    "hermes": ("Hi ", AUTO_CALL),
    "llama3_json": ("", r'<\|python_tag\|>\{"name": "clock", "parameters": \{"utc": (true|false)\}\}'),
    "pythonic": ("", r"\[clock\(utc=(True|False)\)\]"),
    "mistral": ("Hi ", r'Hi \[TOOL_CALLS\]\[\{"name": "clock", "arguments": \{"utc": (true|false)\}\}\]'),
    "mistral:args": ("Hi ", r'Hi \[TOOL_CALLS\]clock\[ARGS\]\{"utc": (true|false)\}'),  # tokenizers v11+
    # (its value is text: the call's {"utc": true} shows the tools' schema typed it)
    "qwen3_coder": ("Hi ", "Hi <tool_call>\n<function=clock>\n<parameter=utc>\n(true|false)\n</parameter>\n"
                           "</function>\n</tool_call>"),
    "deepseek_v3": ("Hi ", "Hi <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>clock\n```json\n"
                           '\\{"utc": (true|false)\\}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
    "deepseek_v31": ("Hi ", 'Hi <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>clock<｜tool▁sep｜>\\{"utc": (true|false)\\}'
                            "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
}


@pytest.mark.parametrize("parser", FORCED)
def test_each_parser_reads_auto_calls_whole_and_streamed_alike(served, client, captured, monkeypatch, parser):
    """The tiny model writes each format because a regex holds its output to it (as the hermes tests do)."""
    front = served.app.state.frontend
    content, regex = FORCED[parser]
    parser = parser.split(":")[0]  # mistral:args: mistral's parser, its [ARGS] format
    monkeypatch.setattr(front, "config", dataclasses.replace(front.config, tool_call_parser=parser))
    kw = {"model": served.model, "messages": CHAT, "tools": TOOLS, "tool_choice": "auto", "temperature": 0.0,
          "max_tokens": 256, "extra_body": {"structured_outputs": {"regex": regex}}}  # fmt: skip
    out = client.chat.completions.create(**kw).choices[0]
    [call] = whole(out)
    assert call["name"] == "clock" and json.loads(call["arguments"]) in ({"utc": True}, {"utc": False})
    assert (out.message.content or "", out.finish_reason) == (content, "tool_calls")
    calls, pieces, said, finish = streamed(client, kw)
    assert (calls, said, finish) == (whole(out), content, "tool_calls")
    assert pieces[0] == 1 if parser == "pythonic" else pieces[0] > 1, pieces  # pythonic: each call whole
    assert accumulated(client, kw) == (whole(out), content, "tool_calls")
    keeps = parser not in ("llama3_json", "pythonic")  # the others' tags may be special tokens (vLLM's ask too)
    assert [params.skip_special_tokens for _, [params] in captured] == [not keeps] * 3


@pytest.mark.parametrize("choice", ["named", "required"])
def test_under_a_reasoning_parser_the_calls_follow_the_thinking(served, client, monkeypatch, choice):
    """With --reasoning-parser a named or "required" call is served (it was refused): the thinking is free, the
    call's grammar holds the answer after it, each of n seeded samples on its own; streamed, the client's
    accumulator joins the same reasoning and calls as the whole response's."""
    front = served.app.state.frontend
    monkeypatch.setattr(front, "config", dataclasses.replace(front.config, reasoning_parser="deepseek_r1"))
    force_thinking(served, monkeypatch, "which tool")
    kw = {"model": served.model, "messages": CHAT, "tools": TOOLS, "max_tokens": 400,
          "tool_choice": NAMED if choice == "named" else "required", "parallel_tool_calls": False}  # fmt: skip
    for out in client.chat.completions.create(n=2, temperature=1.0, seed=5, **kw).choices:
        assert out.message.model_extra["reasoning"] == "which tool" and out.message.content == ""
        assert out.finish_reason == ("stop" if choice == "named" else "tool_calls") and out.message.tool_calls
        for call in out.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    out = client.chat.completions.create(temperature=0.0, **kw).choices[0]
    with client.chat.completions.stream(temperature=0.0, **kw) as stream:
        joined = stream.get_final_completion().choices[0]
    assert joined.message.model_extra["reasoning"] == out.message.model_extra["reasoning"] == "which tool"
    assert (whole(joined), joined.finish_reason) == (whole(out), out.finish_reason) and whole(out)


def test_required_calls_follow_their_tools_schemas_and_parallel_false_makes_one(served, client):
    for parallel in (True, False):
        out = client.chat.completions.create(model=served.model, messages=CHAT, tools=TOOLS, tool_choice="required",
                                             n=3, seed=11, max_tokens=400, parallel_tool_calls=parallel)  # fmt: skip
        for choice in out.choices:
            assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
            assert parallel or len(choice.message.tool_calls) == 1
            for call in choice.message.tool_calls:
                jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_auto_reads_hermes_calls_out_of_the_text(served, captured):
    body = {"tools": TOOLS, "tool_choice": "auto", "structured_outputs": {"regex": AUTO_CALL}, "temperature": 0.0}
    out = ask(served, **body).json()["choices"][0]
    [(_, [params])] = captured
    assert params.skip_special_tokens is False  # as vLLM's hermes parser asks: a tag may be a special token
    [call] = out["message"]["tool_calls"]
    assert out["message"]["content"] == "Hi " and out["finish_reason"] == "tool_calls"
    assert call["function"]["name"] == "clock" and json.loads(call["function"]["arguments"]) in ({"utc": True},
                                                                                                {"utc": False})
    plain = ask(served, **{**body, "structured_outputs": {"regex": "no tools here"}}).json()["choices"][0]
    assert plain["message"] == {"role": "assistant", "content": "no tools here"} and plain["finish_reason"] == "stop"
