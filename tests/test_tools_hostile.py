"""Hostile tool-calling requests without a fleet, pure: what a client's mistake or a model's stray output
must never become. A 200 never carries a call whose arguments fail its function's schema (``auto`` answers
are read, not constrained: such a call is the text it was, whole or streamed, and a schema whose
arguments cannot be checked gives no calls); a ``parameters`` that is no JSON schema is a 400 whatever the
choice; tools beside a structured output answer in that format; ``stop`` cannot cut a forced call; a tool
result answers a call made earlier; a call's arguments are JSON (no NaN / Infinity)."""

from __future__ import annotations

import json

import pytest

from batchfleet.common.wire.protocol import Result
from batchfleet.gateway.errors import APIError
from batchfleet.gateway.openai.chat.format import Shape
from batchfleet.gateway.openai.chat.request import request_job
from batchfleet.gateway.openai.tools.calling import ToolStream
from batchfleet.gateway.openai.tools.parsers import FAMILIES
from tests.helpers.tools import ADD, TOOLS, WEATHER

pytestmark = pytest.mark.unit
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def answer(tools: list, text: str, family: str = "hermes", **body) -> dict:
    """The whole answer's choice for ``text`` written by the model under ``tools`` (tool_choice auto)."""
    job = request_job(True, {"messages": ASK, "tools": tools, **body}, 60, 16)
    shape = Shape(chat=True, job_id="x", model="m", created=0, tools=job.tools, family=FAMILIES[family])
    return shape.response([Result("j", [5], text, "stop", 1, 1, 0.0, 0.0, 0.0, "w", 1)])["choices"][0]


def streamed(tools: list, text: str, family: str = "hermes") -> tuple[str, list]:
    job = request_job(True, {"messages": ASK, "tools": tools}, 60, 16)
    reader = ToolStream(job.tools, FAMILIES[family])
    sent = "".join(reader.feed(text[i:i + 7]) for i in range(0, len(text), 7))
    rest, calls = reader.finish()
    return sent + rest, calls


@pytest.mark.parametrize(("family", "text"), [
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": "one", "b": 2}}\n</tool_call>'),  # a string
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'),  # b required
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2, "c": 3}}\n</tool_call>'),  # extra key
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 200}}\n</tool_call>'),  # past maximum
    ("hermes", '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n'  # one of two is bad
               '<tool_call>{"name": "get_weather", "arguments": {"city": "Reykjavik!", "unit": "kelvin"}}</tool_call>'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}'),
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": {"a": -1, "b": 2}}]'),
])
def test_an_auto_call_whose_arguments_break_its_schema_is_text(family, text):
    choice = answer(TOOLS, text, family)
    assert choice["message"] == {"role": "assistant", "content": text} and choice["finish_reason"] == "stop"
    assert streamed(TOOLS, text, family) == (text, [])


def test_a_valid_auto_call_in_any_key_order_is_a_call():
    # jsonschema's semantics, not the generator's: properties in any order, integers written as 2.0
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"unit": "celsius", "city": "Paris"}}\n</tool_call>'
    (call,) = answer(TOOLS, text)["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"unit": "celsius", "city": "Paris"}
    assert answer([ADD], '<tool_call>{"name": "add", "arguments": {"a": 2.0, "b": 1}}</tool_call>')[
        "finish_reason"] == "tool_calls"


@pytest.mark.timeout(120)  # a backtracking engine would take ages on ^(a+)+$ against 40 a's and a b
def test_patterns_are_matched_in_linear_time_and_pattern_properties_give_no_call():
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "s": {"type": "string", "pattern": "^(a+)+$"}, "t": {"type": "string", "pattern": "[0-9]"}}}}}
    call = '<tool_call>{"name": "f", "arguments": %s}</tool_call>'
    assert answer([tool], call % json.dumps({"s": "a" * 40 + "b"}))["finish_reason"] == "stop"
    assert answer([tool], call % json.dumps({"s": "a" * 40, "t": "x1y"}))["finish_reason"] == "tool_calls"
    assert answer([tool], call % json.dumps({"t": "xy"}))["finish_reason"] == "stop"
    keyed = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "patternProperties": {
        "^(a+)+$": {"type": "integer"}}}}}
    assert answer([keyed], call % json.dumps({"a" * 40 + "b": 1}))["message"].get("tool_calls") is None


def test_a_forced_call_is_not_second_guessed_by_float_arithmetic():
    # generated under the schema; jsonschema would call 0.3 no multiple of 0.1 (0.3 / 0.1 = 2.9999999999999996)
    tenths = {"type": "function", "function": {"name": "t", "parameters": {
        "type": "object", "properties": {"x": {"type": "number", "multipleOf": 0.1}}, "required": ["x"]}}}
    job = request_job(True, {"messages": ASK, "tools": [tenths], "tool_choice": "required"}, 60, 16)
    text = '<tool_call>\n{"name":"t","arguments":{"x":0.3}}\n</tool_call>'
    content, calls = job.tools.calls(FAMILIES["hermes"], text)
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"x": 0.3}


@pytest.mark.parametrize("schema", [
    {"$ref": "#"},  # loops
    {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}, "$defs": {"a": {"$ref": "#/$defs/a"}}},
    {"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}},  # never fetched
    {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}},
])
def test_a_call_whose_arguments_cannot_be_checked_is_text_never_a_500(schema):
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    text = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    assert answer([tool], text)["message"] == {"role": "assistant", "content": text}


@pytest.mark.parametrize("parameters", [
    {"type": "object", "properties": {"a": {"type": "bogus"}}},
    {"type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}},
    {"type": "object", "properties": {"a": {"minimum": "zero"}}},
    {"type": "object", "required": "a"},
    {"$schema": 5},
])
@pytest.mark.parametrize("choice", ["none", "auto", "required"])
def test_parameters_that_are_no_json_schema_are_a_400_whatever_the_choice(parameters, choice):
    tools = [ADD, {"type": "function", "function": {"name": "bad", "parameters": parameters}}]
    with pytest.raises(APIError) as exc:
        request_job(True, {"messages": ASK, "tools": tools, "tool_choice": choice}, 60, 16)
    assert exc.value.status == 400 and exc.value.param == "tools.1.function.parameters", exc.value.message


def test_tools_beside_a_structured_output_answer_in_that_format():
    # auto: the answer follows response_format, so it is content even when it looks like a call
    text = '{"name": "add", "parameters": {"a": 1, "b": 2}}'
    for rf in ({"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object"}}}):
        choice = answer(TOOLS, text, "llama3_json", response_format=rf)
        assert choice["message"] == {"role": "assistant", "content": text} and choice["finish_reason"] == "stop"
    assert request_job(True, {"messages": ASK, "tools": TOOLS, "guided_regex": "a+"}, 60, 16).tools.choice == "none"
    for forced in ("required", {"type": "function", "function": {"name": "add"}}):
        with pytest.raises(APIError) as exc:
            request_job(True, {"messages": ASK, "tools": TOOLS, "tool_choice": forced, "guided_choice": ["a"]}, 60, 16)
        assert exc.value.param == "tool_choice"


def test_stop_cannot_cut_a_forced_call():
    for forced in ("required", {"type": "function", "function": {"name": "add"}}):
        with pytest.raises(APIError) as exc:
            request_job(True, {"messages": ASK, "tools": TOOLS, "tool_choice": forced, "stop": ["}"]}, 60, 16)
        assert exc.value.param == "stop"
    assert request_job(True, {"messages": ASK, "tools": TOOLS, "stop": ["}"]}, 60, 16).tools.choice == "auto"


def call(call_id: str = "c1", arguments: str = '{"a": 1, "b": 2}') -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": "add", "arguments": arguments}}]}


@pytest.mark.parametrize(("messages", "param"), [
    ([*ASK, {"role": "tool", "tool_call_id": "c1", "content": "3"}], "messages.1.tool_call_id"),  # no call yet
    ([*ASK, call(), {"role": "tool", "tool_call_id": "c2", "content": "3"}], "messages.2.tool_call_id"),
    ([*ASK, {"role": "tool", "tool_call_id": "c1", "content": "3"}, call()], "messages.1.tool_call_id"),  # later
    ([*ASK, call(arguments='{"a": NaN, "b": 2}')], "messages.1.tool_calls.0.function.arguments"),
    ([*ASK, call(arguments='{"a": Infinity, "b": 2}')], "messages.1.tool_calls.0.function.arguments"),
    ([*ASK, call(arguments='{"a": 1e999, "b": 2}')], "messages.1.tool_calls.0.function.arguments"),
])
def test_a_conversation_a_template_cannot_render_truthfully_is_a_400(messages, param):
    with pytest.raises(APIError) as exc:
        request_job(True, {"messages": messages, "tools": TOOLS}, 60, 16)
    assert exc.value.status == 400 and exc.value.param == param, exc.value.message


def test_tool_results_of_earlier_calls_are_taken():
    messages = [*ASK, call("c1", '{"a": "NaN", "b": 1e300}'), call("c2"), {"role": "tool", "tool_call_id": "c1",
                                                                          "content": "3"},
                {"role": "tool", "tool_call_id": "c2", "content": "4"}, {"role": "user", "content": "thanks"}]
    job = request_job(True, {"messages": messages, "tools": [WEATHER]}, 60, 16)
    assert [m["role"] for m in job.prompt.messages] == ["user", "assistant", "assistant", "tool", "tool", "user"]
    assert job.prompt.messages[1]["tool_calls"][0]["function"]["arguments"] == {"a": "NaN", "b": 1e300}
