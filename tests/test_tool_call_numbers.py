"""Tool calls whose arguments hold numbers, pure: the arguments are passed on as the model wrote them
(never re-serialized by Python's json, which reads ``2E0017489145`` as inf and writes ``Infinity``), and a
number past a double's range is refused: an ``auto`` answer is then text, a forced call a 400
``guide_failed``, in chat answers, chat streams and Responses alike (issue 54, item 7)."""

from __future__ import annotations

import json

import pytest

from batchfleet.common.wire.protocol import Result
from batchfleet.gateway.errors import APIError
from batchfleet.gateway.openai.chat.format import Shape
from batchfleet.gateway.openai.chat.request import request_job
from batchfleet.gateway.openai.responses.format import ResponseShape
from batchfleet.gateway.openai.tools.calling import ToolStream
from batchfleet.gateway.openai.tools.parsers import FAMILIES, Call

pytestmark = pytest.mark.unit
ASK = [{"role": "user", "content": "Pick a number"}]
NUMBER = {"type": "function", "function": {"name": "n", "parameters": {
    "type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}}}
NAMED = {"type": "function", "function": {"name": "n"}}
# written by each family: its call markup around the arguments' text
WRAP = {"hermes": '<tool_call>\n{"name":"n","arguments":%s}\n</tool_call>',
        "llama3_json": '{"name":"n","parameters":%s}', "mistral": '[{"name":"n","arguments":%s}]'}
HUGE = ['{"x":2E0017489145}', '{"x":-1e309}', '{"x":%s}' % ("9" * 309), '{"x":-%s}' % ("1" * 5000),
        '{"x":[1,{"y":1e400}]}']
FITTING = ['{"x":2E17}', '{"x": 1.000000000000000000001 }', '{"x":%s}' % ("1" * 300), '{"x":-0.0e-999}',
           '{"x":1e308}']


def whole(choice, family: str, text: str, **kw) -> dict:
    job = request_job(True, {"messages": ASK, "tools": [NUMBER], "tool_choice": choice, **kw}, 60, 16)
    shape = Shape(chat=True, job_id="x", model="m", created=0, tools=job.tools, family=FAMILIES[family])
    return shape.response([Result("j", [5], text, "eos", 1, 1, 0.0, 0.0, 0.0, "w", 1)])["choices"][0]


def streamed(choice, family: str, text: str) -> tuple[str, list]:
    job = request_job(True, {"messages": ASK, "tools": [NUMBER], "tool_choice": choice}, 60, 16)
    reader = ToolStream(job.tools, FAMILIES[family])
    sent = "".join(reader.feed(text[i:i + 5]) for i in range(0, len(text), 5))
    rest, deltas = reader.finish()
    return sent + rest, deltas


def response_output(choice, family: str, text: str) -> list:
    job = request_job(True, {"messages": ASK, "tools": [NUMBER], "tool_choice": choice}, 60, 16)
    shape = ResponseShape("x", "m", {}, job.tools, FAMILIES[family])
    return shape.response(Result("j", [5], text, "eos", 1, 1, 0.0, 0.0, 0.0, "w", 1))["output"]


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("arguments", HUGE)
def test_a_number_past_a_doubles_range_is_marked_by_every_parser(family, arguments):
    assert FAMILIES[family].parse(WRAP[family] % arguments, ["n"]) == (None, [Call("n", arguments, False)])


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("arguments", FITTING)
def test_arguments_are_passed_on_as_the_model_wrote_them(family, arguments):
    text = WRAP[family] % arguments
    assert FAMILIES[family].parse(text, ["n"]) == (None, [Call("n", arguments)])
    for choice in ("auto", "required", NAMED):
        (call,) = whole(choice, family, text)["message"]["tool_calls"]
        assert call["function"]["arguments"] == arguments
        _, deltas = streamed(choice, family, text)
        assert deltas[1]["function"]["arguments"] == arguments
        (item,) = response_output(choice, family, text)
        assert item["type"] == "function_call" and item["arguments"] == arguments


def test_arguments_written_as_json_text_are_passed_on_as_that_text():
    text = '<tool_call>{"name": "n", "arguments": "{\\"x\\": 2E17}"}</tool_call>'
    assert FAMILIES["hermes"].parse(text, ["n"]) == (None, [Call("n", '{"x": 2E17}')])
    huge = '<tool_call>{"name": "n", "arguments": "{\\"x\\": 2E0017489145}"}</tool_call>'
    assert FAMILIES["hermes"].parse(huge, ["n"]) == (None, [Call("n", '{"x": 2E0017489145}', False)])


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("arguments", HUGE[:3])
def test_an_auto_call_with_a_number_past_a_doubles_range_is_text(family, arguments):
    text = WRAP[family] % arguments
    choice = whole("auto", family, text)
    assert choice["message"] == {"role": "assistant", "content": text} and choice["finish_reason"] == "stop"
    assert streamed("auto", family, text) == (text, [])
    (item,) = response_output("auto", family, text)
    assert item["type"] == "message" and item["content"][0]["text"] == text


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("choice", ["required", NAMED])
def test_a_forced_call_with_a_number_past_a_doubles_range_is_refused_never_infinity(family, choice):
    text = WRAP[family] % '{"x":2E0017489145}'
    for answer in (lambda: whole(choice, family, text), lambda: streamed(choice, family, text),
                   lambda: response_output(choice, family, text)):
        with pytest.raises(APIError) as exc:
            answer()
        assert (exc.value.status, exc.value.code, exc.value.param) == (400, "guide_failed", "tools")
        assert "double" in exc.value.message


def test_nan_and_infinity_are_no_json_and_no_call():
    for arguments in ('{"x":NaN}', '{"x":Infinity}', '{"x":-Infinity}'):
        text = WRAP["hermes"] % arguments
        assert FAMILIES["hermes"].parse(text, ["n"]) == (text, [])
        assert "Infinity" not in json.dumps(whole("auto", "hermes", text)["message"].get("tool_calls"))
