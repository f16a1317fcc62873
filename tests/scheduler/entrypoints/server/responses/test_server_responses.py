"""/v1/responses with the official client: answers as chat's, rendering, tools, formats, streams, the store, refusals.

The module's one server (the conftest's) serves plain chat; a test that needs "auto" tool choice or a
reasoning parser swaps the frontend's options. The tiny model is random and never stops by itself:
a plain answer runs to ``max_output_tokens`` (incomplete), and a schema or regex constraint makes a
complete one. The chat completion of the same conversation is the oracle.
"""

from __future__ import annotations

import dataclasses
import json

import httpx
import jsonschema
import openai
import pytest
from fault_helpers import FAULT_SALT, plant_sampling_fault
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from server_helpers import force_thinking, hold_steps, refused, wait_aborted, wait_idle

WEATHER = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}, "days": {"enum": [1, 2, 3]}},
           "required": ["unit", "days"], "additionalProperties": False}  # fmt: skip
TOOL = {"type": "function", "name": "weather", "description": "the forecast", "parameters": WEATHER}
CHAT_TOOL = {"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}
NAMED = {"type": "function", "name": "weather"}
ANSWER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "ok": {"type": "boolean"}},
          "required": ["city", "ok"], "additionalProperties": False}  # fmt: skip
JSON_SCHEMA = {"format": {"type": "json_schema", "name": "answer", "schema": ANSWER, "strict": True}}
AUTO_CALL = r'Hi <tool_call>\{"name": "weather", "arguments": \{"unit": "c", "days": 2\}\}</tool_call>'
EVENTS = TypeAdapter(ResponseStreamEvent)
USER = {"role": "user", "content": "hello there"}  # the chat message of the default input


def create(served, client, **kw) -> Response:
    """A greedy response (kw overrides), checked against OpenAI's Response type."""
    kw = {"model": served.model, "input": "hello there", "temperature": 0.0, "max_output_tokens": 8} | kw
    raw = client.responses.with_raw_response.create(**kw)
    response = raw.parse()
    assert Response.model_validate(raw.http_response.json()) == response
    return response


def chat(served, client, messages, **kw):
    """The oracle: the chat completion of ``messages``."""
    kw = {"model": served.model, "temperature": 0.0, "max_completion_tokens": 8} | kw
    return client.chat.completions.create(messages=messages, **kw)


def events_of(served, client, **kw) -> list:
    """A streamed response's events, each checked against OpenAI's event types, numbered 0, 1, 2, ..."""
    kw = {"model": served.model, "input": "hello there", "temperature": 0.0, "max_output_tokens": 8} | kw
    events = list(client.responses.create(stream=True, **kw))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert all(EVENTS.validate_python(e.model_dump(by_alias=True)) == e for e in events)
    return events


def same(a: Response, b: Response) -> bool:
    """Two responses alike but for their ids, times and prefix-cache hits (and the client's parsed fields)."""

    def strip(r):
        body = r.model_dump(exclude={"id", "created_at"})
        body["usage"]["input_tokens_details"].pop("cached_tokens")
        for item in body["output"]:
            for key in ("id", "call_id", "parsed_arguments"):
                item.pop(key, None)
            for part in item.get("content") or []:
                part.pop("parsed", None)
        return body

    return strip(a) == strip(b)


def rendered(served, messages, tools=None) -> list[int]:
    """The prompt ids of a chat conversation as /tokenize renders it (as chat completions do)."""
    body = {"model": served.model, "messages": messages} | ({"tools": tools} if tools else {})
    r = httpx.post(served.url + "/tokenize", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


@pytest.fixture
def options(served, monkeypatch):
    """Set server options of the frontend for one test (e.g. a reasoning parser)."""
    front = served.app.state.frontend

    def set_options(**kw):
        monkeypatch.setattr(front, "config", dataclasses.replace(front.config, **kw))

    return set_options


def test_a_text_answer_is_the_chat_completion_of_the_same_messages(served, client):
    for sampling in ({"temperature": 0.0}, {"temperature": 1.0, "extra_body": {"seed": 7}}):
        r = create(served, client, instructions="be brief", **sampling)
        c = chat(served, client, [{"role": "system", "content": "be brief"}, USER], **sampling)
        assert r.output_text == c.choices[0].message.content and r.output_text
        assert [item.type for item in r.output] == ["message"] and r.output[0].content[0].type == "output_text"
        u = r.usage
        assert (u.input_tokens, u.output_tokens, u.total_tokens) == (
            c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.total_tokens)  # fmt: skip
        assert u.output_tokens_details.reasoning_tokens == 0
        again = create(served, client, instructions="be brief", **sampling).usage.input_tokens_details
        assert again.cached_tokens == c.usage.prompt_tokens_details.cached_tokens > 0  # the prompt's blocks, cached
    assert r.id.startswith("resp_") and r.object == "response" and r.model == served.model
    assert (r.instructions, r.temperature, r.top_p, r.tools, r.tool_choice) == ("be brief", 1.0, 1.0, [], "none")
    assert (r.parallel_tool_calls, r.metadata, r.text.format.type, r.store) == (True, {}, "text", True)


def test_max_output_tokens_makes_an_incomplete_response(served, client):
    r = create(served, client, max_output_tokens=5)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5 and r.max_output_tokens == 5 and r.output[0].status == "incomplete"


def test_instructions_and_items_render_as_the_chat_messages_they_are(served, client, captured):
    items = [
        {"role": "developer", "content": "use tools"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "weather "},
                                                        {"type": "input_text", "text": "in Paris?"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me see."}]},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"unit": "c", "days": 1}'},
        {"type": "function_call", "call_id": "c2", "name": "weather", "arguments": '{"unit": "f", "days": 2}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rain"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},  # a chat message has no thinking: not rendered
        {"role": "user", "content": "thanks"},
    ]  # fmt: skip
    r = create(served, client, instructions="be brief", input=items, tools=[TOOL], tool_choice="none")
    calls = [{"id": f"c{i}", "type": "function", "function": {"name": "weather", "arguments": a}}
             for i, a in ((1, '{"unit": "c", "days": 1}'), (2, '{"unit": "f", "days": 2}'))]  # fmt: skip
    messages = [
        {"role": "system", "content": "be brief"}, {"role": "developer", "content": "use tools"},
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": "Let me see.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
        {"role": "user", "content": "thanks"},
    ]  # fmt: skip
    expected = rendered(served, messages, [CHAT_TOOL])
    assert captured[-1][0][0][0] == expected and r.usage.input_tokens == len(expected)
    c = chat(served, client, messages, tools=[CHAT_TOOL], tool_choice="none")
    assert r.output_text == c.choices[0].message.content


def test_a_json_schema_format_gives_json_that_follows_it(served, client):
    r = create(served, client, text=JSON_SCHEMA, max_output_tokens=100)
    assert r.status == "completed" and r.output[0].status == "completed"
    jsonschema.validate(json.loads(r.output_text), ANSWER)
    assert r.text.format.type == "json_schema" and r.text.format.schema_ == ANSWER
    r = create(served, client, text={"format": {"type": "json_object"}}, max_output_tokens=20)
    assert r.output_text.startswith("{") and r.text.format.type == "json_object"  # any object: it may not end


def test_a_named_tool_choice_gives_one_function_call_item(served, client):
    first, second = (create(served, client, tools=[TOOL], tool_choice=NAMED, max_output_tokens=100) for _ in "ab")
    for r in (first, second):
        assert [item.type for item in r.output] == ["function_call"] and r.status == "completed"
        call = r.output[0]
        assert call.name == "weather" and call.status == "completed" and call.id.startswith("fc_")
        jsonschema.validate(json.loads(call.arguments), WEATHER)
        assert r.tool_choice.name == "weather" and r.tools[0].name == "weather" and r.output_text == ""
    assert first.output[0].call_id != second.output[0].call_id  # a fresh call id each time


def test_a_function_call_output_continues_the_stored_response(served, client, captured):
    called = create(served, client, instructions="be brief", tools=[TOOL], tool_choice=NAMED, max_output_tokens=100)
    call = called.output[0]
    answer = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    r = create(served, client, previous_response_id=called.id, input=[answer], tools=[TOOL], tool_choice="none")
    assert r.previous_response_id == called.id and r.instructions is None  # instructions are not carried over
    function = {"name": "weather", "arguments": call.arguments}
    messages = [USER, {"role": "assistant", "content": None,
                       "tool_calls": [{"id": call.call_id, "type": "function", "function": function}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}]  # fmt: skip
    assert captured[-1][0][0][0] == rendered(served, messages, [CHAT_TOOL])
    then = create(served, client, previous_response_id=r.id, input="and tomorrow?", tools=[TOOL], tool_choice="none")
    messages += [{"role": "assistant", "content": r.output_text}, {"role": "user", "content": "and tomorrow?"}]
    assert captured[-1][0][0][0] == rendered(served, messages, [CHAT_TOOL]) and then.status == "incomplete"


def test_a_stream_builds_the_whole_response(served, client):
    for kw in ({"text": JSON_SCHEMA, "max_output_tokens": 100, "temperature": 1.0, "extra_body": {"seed": 3}},
               {"tools": [TOOL], "tool_choice": NAMED, "max_output_tokens": 100, "temperature": 0.0}):
        with client.responses.stream(model=served.model, input="hello there", **kw) as stream:
            events = list(stream)
            final = stream.get_final_response()
        whole = create(served, client, **kw)
        assert same(final, whole) and final.status == "completed"
        assert events[-1].type == "response.completed" and events[-1].response.id == final.id
        assert [e.type for e in events[:3]] == ["response.created", "response.in_progress",
                                                "response.output_item.added"]  # fmt: skip
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert arguments == done[0].arguments == final.output[0].arguments and done[0].item_id == final.output[0].id


def test_a_streamed_text_answer_is_the_whole_one_piece_by_piece(served, client):
    events = events_of(served, client)
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]  # fmt: skip
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    item = events[2].item
    assert all((e.item_id, e.output_index, e.content_index) == (item.id, 0, 0) for e in deltas)
    final = events[-1].response
    assert "".join(e.delta for e in deltas) == final.output_text == events[-4].text
    assert same(final, create(served, client)) and final.usage.output_tokens == 8


def test_a_stream_closed_early_aborts_its_request(served, client, monkeypatch):
    before = served.engine.num_aborted
    hold_steps(served, monkeypatch, after_texts=2)  # it is still running when the client leaves
    stream = client.responses.create(model=served.model, input="hello", max_output_tokens=400, stream=True,
                                     extra_body={"ignore_eos": True})  # fmt: skip
    events = iter(stream)
    next(events), next(events), next(events)
    stream.close()
    wait_idle(served)
    wait_aborted(served, before + 1)
    assert served.engine.num_aborted == before + 1


FAULTY = {"input": "hi", "max_output_tokens": 20, "cache_salt": FAULT_SALT}  # failed by plant_sampling_fault


def test_a_request_that_fails_on_the_engine_is_a_500_and_is_not_stored(served, monkeypatch):
    plant_sampling_fault(monkeypatch, after=2)  # mid-answer
    kept = len(served.app.state.responses)
    r = served.post("responses", {"model": served.model, **FAULTY})
    assert r.status_code == 500 and "planted sampling fault" in r.json()["error"]["message"], r.text
    assert len(served.app.state.responses) == kept
    wait_idle(served)


def test_a_stream_that_fails_on_the_engine_ends_with_an_error_event(served, client, monkeypatch):
    plant_sampling_fault(monkeypatch, after=2)  # mid-answer: after the stream has begun
    kept = len(served.app.state.responses)
    events = events_of(served, client, **{k: v for k, v in FAULTY.items() if k != "cache_salt"},
                       extra_body={"cache_salt": FAULT_SALT})  # fmt: skip
    assert events[-1].type == "error" and "planted sampling fault" in events[-1].message
    assert "response.output_text.delta" in [e.type for e in events]
    assert not [e for e in events if e.type in ("response.completed", "response.incomplete")]
    assert len(served.app.state.responses) == kept  # a failed response is not stored
    wait_idle(served)


def test_responses_are_stored_retrieved_and_deleted(served, client):
    r = create(served, client, metadata={"k": "v"})
    assert client.responses.retrieve(r.id) == r and r.metadata == {"k": "v"}
    client.responses.delete(r.id)
    for call in (client.responses.retrieve, client.responses.delete):
        with pytest.raises(openai.NotFoundError) as info:
            call(r.id)
        assert info.value.body["param"] == "response_id" and r.id in info.value.body["message"]
    kept = len(served.app.state.responses)
    unstored = create(served, client, store=False)
    assert len(served.app.state.responses) == kept
    refused(httpx.get(f"{served.url}/v1/responses/{unstored.id}", timeout=60), "response_id", 404)
    kept_one = create(served, client, extra_body={"request_id": "resp_mine"})  # vLLM's: the response's id
    assert kept_one.id == "resp_mine" and client.responses.retrieve("resp_mine") == kept_one
    with pytest.raises(openai.BadRequestError) as info:  # a background response's events: none run here
        client.responses.retrieve(kept_one.id, stream=True)
    assert info.value.body["param"] == "stream"
    body = {"model": served.model, "input": "hi", "previous_response_id": unstored.id}
    refused(served.post("responses", body), "previous_response_id", 404)


def test_the_reasoning_is_an_item_of_its_own_and_its_tokens_count(served, client, options, monkeypatch):
    options(reasoning_parser="deepseek_r1")
    force_thinking(served, monkeypatch, "let me see")  # then the model's own answer
    kw = {"max_output_tokens": 100, "reasoning": {"effort": "low"}}
    r = create(served, client, **kw)
    assert [item.type for item in r.output] == ["reasoning", "message"] and r.reasoning.effort == "low"
    assert r.output[0].content[0].text == "let me see"
    c = chat(served, client, [USER], max_completion_tokens=100, logprobs=True)
    message = c.choices[0].message
    assert r.output[0].content[0].text == message.model_extra["reasoning"] and r.output_text == message.content
    tokens, text = 0, ""  # the thinking's tokens: up to the one that completes its end tag
    while "</think>" not in text:
        text, tokens = text + c.choices[0].logprobs.content[tokens].token, tokens + 1
    assert r.usage.output_tokens_details.reasoning_tokens == tokens < r.usage.output_tokens
    events = events_of(served, client, **kw)
    kinds = [e.type for e in events if e.type.endswith(".delta")]
    assert kinds[0] == "response.reasoning_text.delta" and kinds[-1] == "response.output_text.delta"
    assert same(events[-1].response, r)


def test_an_auto_tool_call_is_read_as_chat_reads_it(served, client, options):
    options(enable_auto_tool_choice=True, tool_call_parser="hermes")
    kw = {"tools": [TOOL], "max_output_tokens": 100, "extra_body": {"structured_outputs": {"regex": AUTO_CALL}}}
    r = create(served, client, **kw)
    assert [item.type for item in r.output] == ["message", "function_call"] and r.tool_choice == "auto"
    assert r.output_text == "Hi " and json.loads(r.output[1].arguments) == {"unit": "c", "days": 2}
    assert same(events_of(served, client, **kw)[-1].response, r)


GOOD = {"input": "hello", "max_output_tokens": 4}
BAD_FIELDS = {  # case -> (the body's changes, the field the 400 names)
    "unknown field": ({"frobnicate": 1}, "frobnicate"),
    "hosted tool": ({"tools": [{"type": "web_search"}]}, "tools"),
    "bad function name": ({"tools": [TOOL | {"name": "a b"}]}, "tools"),
    "bad schema": ({"tools": [TOOL | {"parameters": {"type": 3}}]}, "tools"),
    "chat-shaped tool": ({"tools": [CHAT_TOOL]}, "tools"),
    "allowed tools choice": ({"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice"),
    "unknown function": ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "clock"}}, "tool_choice"),
    "auto without a parser": ({"tools": [TOOL]}, "tool_choice"),
    "background": ({"background": True}, "background"),
    "truncation auto": ({"truncation": "auto"}, "truncation"),
    "top_logprobs": ({"top_logprobs": 2}, "top_logprobs"),
    "include": ({"include": ["reasoning.encrypted_content"]}, "include"),
    "conversation": ({"conversation": "conv_1"}, "conversation"),
    "empty input": ({"input": []}, "input"),
    "image input": ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    "arguments not JSON": ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
                           "input"),
    "no schema": ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
    "zero max_output_tokens": ({"max_output_tokens": 0}, "max_output_tokens"),
    "max_output_tokens past the context": ({"max_output_tokens": 10**6}, "max_output_tokens"),
    "temperature": ({"temperature": 200.0}, "temperature"),
    "metadata value": ({"metadata": {"k": 3}}, "metadata"),
    "reasoning effort": ({"reasoning": {"effort": "huge"}}, "reasoning"),
    "unknown model": ({"model": "nope"}, "model"),
    "top_k as text": ({"top_k": "4"}, "top_k"),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD_FIELDS)
def test_a_bad_field_is_a_400_naming_it_and_stores_nothing(served, case):
    change, param = BAD_FIELDS[case]
    kept = len(served.app.state.responses)
    status = 404 if param == "model" else 400
    refused(served.post("responses", {"model": served.model, **GOOD, **change}), param, status)
    assert len(served.app.state.responses) == kept


def test_a_response_cut_off_inside_a_call_continues_without_it(served, client, captured):
    """max_output_tokens reached mid-arguments: the call item is "incomplete", its arguments unfinished JSON; a
    continuation leaves the call out (it was never made) and answers the new input (it was a 400)."""
    cut = create(served, client, tools=[TOOL], tool_choice=NAMED, max_output_tokens=3)
    (call,) = cut.output
    assert cut.status == "incomplete" and call.type == "function_call" and call.status == "incomplete"
    with pytest.raises(ValueError):
        json.loads(call.arguments)
    r = create(served, client, previous_response_id=cut.id, input="go on", tools=[TOOL], tool_choice="none")
    messages = [USER, {"role": "user", "content": "go on"}]
    assert captured[-1][0][0][0] == rendered(served, messages, [CHAT_TOOL]) and r.output_text
    sent_back = [USER | {"type": "message"}, call.model_dump(exclude_none=True), {"role": "user", "content": "go on"}]
    again = create(served, client, input=sent_back, tools=[TOOL], tool_choice="none")  # the item sent back as input
    assert captured[-1][0][0][0] == rendered(served, messages, [CHAT_TOOL]) and again.output_text == r.output_text


def test_a_refused_input_item_is_named_by_its_place_in_input(served, client):
    """Chat's refusal of the message an item became names the item (input[2]), not the chat message (which counts
    the instructions as messages[0])."""
    items = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
             {"type": "function_call", "call_id": "c", "name": "weather", "arguments": "{"}]  # fmt: skip
    with pytest.raises(openai.BadRequestError) as info:
        create(served, client, instructions="be brief", input=items)
    error = info.value.body
    assert error["param"] == "input" and error["message"].startswith("input[2].arguments: "), error
    assert "messages" not in error["message"]


def test_reasoning_effort_reaches_the_chat_template(served, client, captured, monkeypatch):
    template = "{% for m in messages %}{{ m.content }}\n{% endfor %}effort={{ reasoning_effort }}"
    monkeypatch.setattr(served.llm.tokenizer, "chat_template", template)
    for reasoning, seen in ((None, "effort="), ({"effort": "low"}, "effort=low"), ({"summary": "auto"}, "effort=")):
        create(served, client, **({"reasoning": reasoning} if reasoning else {}))
        assert served.llm.tokenizer.decode(captured[-1][0][0][0]).endswith(seen)
    create(served, client, reasoning={"effort": "high"}, extra_body={"chat_template_kwargs": {"reasoning_effort": "x"}})
    assert served.llm.tokenizer.decode(captured[-1][0][0][0]).endswith("effort=high")  # over the kwargs' entry


def test_a_prompt_that_ended_the_thinking_makes_no_reasoning_item(served, client, options, monkeypatch):
    options(reasoning_parser="deepseek_r1")
    ended = "{% for m in messages %}{{ m.content }}\n{% endfor %}<think>\n\n</think>\n\n"
    monkeypatch.setattr(served.llm.tokenizer, "chat_template", ended)
    r = create(served, client)
    assert [item.type for item in r.output] == ["message"] and r.output_text
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert same(events_of(served, client)[-1].response, r)
