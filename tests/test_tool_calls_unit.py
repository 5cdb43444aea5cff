"""Tool calling without a fleet, pure: each model family's parser reads what models write (and falls back
to text), its grammar of a forced call always yields calls whose arguments validate (walked at random with
llguidance over a byte vocabulary), the request's tools / tool_choice / parallel_tool_calls are validated
into one plan with 400s naming the field, the chat template renders tools, tool calls and tool results as
transformers does, and answers and streams carry OpenAI's tool_calls."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from batchfleet.common.errors import InvalidRequest
from batchfleet.common.wire.guided import PROBE_EOS, _probe_tokenizer, limits
from batchfleet.common.wire.protocol import Result
from batchfleet.gateway.errors import APIError
from batchfleet.gateway.openai.chat.format import Shape
from batchfleet.gateway.openai.chat.request import request_job
from batchfleet.gateway.openai.tools.calling import ToolStream
from batchfleet.gateway.openai.tools.parsers import FAMILIES, Call, pick
from batchfleet.producer.chat import render
from tests.helpers.tools import ADD, HERMES_TEMPLATE, TOOLS, WEATHER

pytestmark = pytest.mark.unit
NAMES = ["get_weather", "add"]
CHAT = {"messages": [{"role": "user", "content": "Weather in Paris?"}]}


@pytest.mark.parametrize(("family", "text", "content", "calls"), [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "Let me check.", [Call("get_weather", '{"city": "Paris"}')]),
    ("hermes", '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n<tool_call>\n'
               '{"name": "add", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}', None,  # the last one unclosed, args as text
     [Call("add", '{"a": 1, "b": 2}'), Call("add", '{"a": 3, "b": 4}')]),
    ("llama3_json", '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "get_weather", '
                    '"parameters": {"city": "Oslo"}}', None,
     [Call("add", '{"a": 1, "b": 2}'), Call("get_weather", '{"city": "Oslo"}')]),
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}]', None,
     [Call("add", '{"a": 1, "b": 2}')]),
    ("mistral", ' [{"name": "get_weather", "arguments": {"city": "Rome"}}]', None,  # [TOOL_CALLS] skipped as special
     [Call("get_weather", '{"city": "Rome"}')]),
])
def test_each_family_parses_what_its_models_write(family, text, content, calls):
    assert FAMILIES[family].parse(text, NAMES) == (content, calls)


@pytest.mark.parametrize(("family", "text"), [
    ("hermes", "Just text, no call."), ("hermes", "<tool_call>\n{not json}\n</tool_call>"),
    ("hermes", '<tool_call>{"name": "unknown_fn", "arguments": {}}</tool_call>'),
    ("hermes", '<tool_call>{"name": "add", "arguments": [1]}</tool_call>'),
    ("llama3_json", "The answer is 4."), ("llama3_json", '{"name": "add", "parameters": {"a": 1}} trailing words'),
    ("llama3_json", '{"no_name": 1}'), ("mistral", "[TOOL_CALLS] oops"), ("mistral", "[1, 2, 3]"),
    ("mistral", "Plain words."),
])
def test_auto_falls_back_to_text_when_no_well_formed_call_of_a_given_function(family, text):
    assert FAMILIES[family].parse(text, NAMES) == (text, [])


def walk(grammar: str, rng: random.Random, steps: int = 4000) -> str:
    """A random output of ``grammar`` (llguidance over bytes: every step a random allowed byte, or the end)."""
    import llguidance

    from batchfleet.common.wire.guided import Guide

    m = llguidance.LLMatcher(_probe_tokenizer(), Guide("grammar", grammar).grammar(), log_level=0, limits=limits())
    out = bytearray()
    for _ in range(steps):
        if m.is_stopped():
            break
        mask = m.compute_bitmask()
        allowed = [b for b in range(PROBE_EOS + 1) if mask[b >> 3] >> (b & 7) & 1]
        token = rng.choice(allowed)
        if token == PROBE_EOS:
            break
        assert m.consume_token(token), m.get_error()
        out.append(token)
    assert m.is_stopped() or m.is_accepting(), bytes(out)
    return out.decode("utf-8", "replace")


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize(("choice", "parallel"), [("required", True), ("required", False),
                                                   ({"type": "function", "function": {"name": "get_weather"}}, True)])
def test_a_forced_call_always_parses_and_its_arguments_validate(family, choice, parallel):
    job = request_job(True, {**CHAT, "tools": TOOLS, "tool_choice": choice, "parallel_tool_calls": parallel}, 60, 16)
    plan = job.tools
    guide = plan.guide(FAMILIES[family])
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    rng = random.Random(7)
    for _ in range(12):
        content, calls = plan.calls(FAMILIES[family], walk(guide.spec, rng))
        assert content is None and calls and (len(calls) == 1 or parallel and plan.forced is None)
        for call in calls:
            assert call["type"] == "function" and call["id"]
            assert plan.forced in (None, call["function"]["name"])
            jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])


def test_mistral_call_ids_are_nine_characters_and_others_look_like_openais():
    assert len(FAMILIES["mistral"].call_id()) == 9 and FAMILIES["mistral"].call_id().isalnum()
    assert FAMILIES["hermes"].call_id().startswith("call_")


def test_the_parser_is_the_option_or_read_from_the_template():
    assert pick("mistral", HERMES_TEMPLATE).name == "mistral"
    assert pick("auto", HERMES_TEMPLATE).name == "hermes"
    assert pick("auto", "{{ '[TOOL_CALLS]' }}").name == "mistral"
    assert pick("auto", "<|python_tag|>").name == "llama3_json" and pick("auto", "").name == "hermes"


@pytest.mark.parametrize(("body", "param"), [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": 1}, "parallel_tool_calls"),
    ({"messages": [{"role": "tool", "content": "sunny"}]}, "messages.0.tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, "messages.0.tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{}"}}]}]}, "messages.0.tool_calls"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": "not json"}}]}]},
     "messages.0.tool_calls.0.function.arguments"),
    ({"messages": [{"role": "assistant", "tool_calls": []}]}, "messages.0.content"),
    ({"max_tokens": 5, "max_completion_tokens": 6}, "max_completion_tokens"),
    ({"tools": [ADD, {"type": "function", "function": {"name": "s", "parameters": {"type": "string"}}}]},
     "tools.1.function.parameters"),
    # no JSON schema at all (its draft's metaschema says so), whatever the choice: OpenAI's 400 too
    ({"tools": [ADD, {"type": "function", "function": {"name": "b", "parameters": {
        "type": "object", "properties": {"a": {"type": "bogus"}}}}}]}, "tools.1.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "b", "parameters": {"$schema": 5}}}],
      "tool_choice": "none"}, "tools.0.function.parameters"),
])
def test_bad_tool_requests_are_400s_naming_the_field(body, param):
    with pytest.raises(APIError) as exc:
        request_job(True, {**CHAT, **body}, 60, 16)
    assert exc.value.status == 400 and exc.value.param == param, exc.value.message


@pytest.mark.parametrize(("schema", "why"), [
    ({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, "Too many items"),
    ({"$ref": "#"}, "no output can match it")])
def test_a_tool_schema_llguidance_cannot_compile_is_a_400_naming_it(schema, why):
    tools = [ADD, {"type": "function", "function": {"name": "bad", "parameters": schema}}]
    job = request_job(True, {**CHAT, "tools": tools, "tool_choice": "required"}, 60, 16)
    with pytest.raises(APIError) as exc:
        job.tools.guide(FAMILIES["hermes"])
    assert exc.value.param == "tools.1.function.parameters" and why in exc.value.message
    add = {"type": "function", "function": {"name": "add"}}
    named = request_job(True, {**CHAT, "tools": tools, "tool_choice": add}, 60, 16)
    assert named.tools.guide(FAMILIES["hermes"]).kind == "grammar"  # only the forced function is compiled


def test_the_template_renders_tools_calls_results_and_names_as_transformers_does():
    job = request_job(True, {"tools": [WEATHER], "messages": [
        {"role": "user", "content": "Weather in Paris?", "name": "ann"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "<b>22</b>"}]}, 60, 16)
    text = render(HERMES_TEMPLATE, job.prompt.messages, tools=job.prompt.tools)
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather", "description"' in text  # no sorting
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' in text
    assert "<tool_response>\n<b>22</b>\n</tool_response>" in text and text.endswith("<|im_start|>assistant\n")
    named = "{% for m in messages %}{{ m.name or '' }}:{{ m.content }};{% endfor %}"
    assert render(named, job.prompt.messages) == "ann:Weather in Paris?;:;:<b>22</b>;"
    with pytest.raises(InvalidRequest, match="tojson"):  # the template's error, not the gateway's
        render("{{ undefined_name | tojson }}", job.prompt.messages)


def result(text: str, reason: str = "stop") -> Result:
    return Result("j", [5], text, reason, 1, 1, 0.0, 0.0, 0.0, "w", 1)


def test_answers_carry_tool_calls_and_openais_finish_reasons():
    hermes = FAMILIES["hermes"]
    call = '<tool_call>\n{"name":"add","arguments":{"a":1,"b":2}}\n</tool_call>'
    for choice, finish in (("auto", "tool_calls"), ("required", "tool_calls"),
                           ({"type": "function", "function": {"name": "add"}}, "stop")):
        job = request_job(True, {**CHAT, "tools": TOOLS, "tool_choice": choice}, 60, 16)
        shape = Shape(chat=True, job_id="x", model="m", created=0, tools=job.tools, family=hermes)
        message = shape.response([result("Sure. " + call)])["choices"][0]
        assert message["finish_reason"] == finish
        # the arguments as the model wrote them (compact here), never re-serialized
        assert message["message"]["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a":1,"b":2}'}
    auto = request_job(True, {**CHAT, "tools": TOOLS}, 60, 16)
    shape = Shape(chat=True, job_id="x", model="m", created=0, tools=auto.tools, family=hermes)
    plain = shape.response([result("no call here", "eos")])["choices"][0]
    assert plain["message"] == {"role": "assistant", "content": "no call here"} and plain["finish_reason"] == "stop"
    none = request_job(True, {**CHAT, "tools": TOOLS, "tool_choice": "none"}, 60, 16)
    shape = Shape(chat=True, job_id="x", model="m", created=0, tools=none.tools, family=hermes)
    assert shape.response([result(call)])["choices"][0]["message"]["content"] == call
    one = request_job(True, {**CHAT, "tools": TOOLS, "parallel_tool_calls": False}, 60, 16)
    shape = Shape(chat=True, job_id="x", model="m", created=0, tools=one.tools, family=hermes)
    assert len(shape.response([result(call + "\n" + call)])["choices"][0]["message"]["tool_calls"]) == 1


def feed_all(reader: ToolStream, pieces: list[str]) -> tuple[str, list[dict]]:
    sent = "".join(reader.feed(p) for p in pieces)
    rest, calls = reader.finish()
    return sent + rest, calls


def test_streams_pass_text_on_and_turn_held_calls_into_openais_deltas():
    auto = request_job(True, {**CHAT, "tools": TOOLS}, 60, 16).tools
    reader = ToolStream(auto, FAMILIES["hermes"])
    assert reader.feed("Let me <tool") == "Let me "  # the marker's first characters are held back
    assert reader.feed('_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>') == ""
    text, calls = reader.finish()
    assert text == "" and [c.get("id") is not None for c in calls] == [True, False]
    assert calls[0]["function"] == {"name": "add", "arguments": ""} and calls[1] == {
        "index": 0, "function": {"arguments": '{"a": 1, "b": 2}'}}
    assert feed_all(ToolStream(auto, FAMILIES["hermes"]), ["a <tool", "box> b"]) == ("a <toolbox> b", [])
    assert feed_all(ToolStream(auto, FAMILIES["hermes"]), ["<tool_call>{broken"]) == ("<tool_call>{broken", [])
    llama = ToolStream(auto, FAMILIES["llama3_json"])
    assert llama.feed("  ") == "" and llama.feed("Hi {") == "  Hi {" and llama.feed("x") == "x"
    text, calls = feed_all(ToolStream(auto, FAMILIES["llama3_json"]), ['{"name": "add", ', '"parameters": {"a": 1, ',
                                                                       '"b": 2}}'])
    assert text == "" and calls[0]["function"]["name"] == "add"
    # a call whose arguments break its schema (b missing) is the text it was, streamed or not
    broken = '{"name": "add", "parameters": {"a": 1}}'
    assert feed_all(ToolStream(auto, FAMILIES["llama3_json"]), [broken]) == (broken, [])


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_forced_answer_cut_short_keeps_its_whole_calls_and_never_a_cut_one(family):
    plan = request_job(True, {**CHAT, "tools": TOOLS, "tool_choice": "required"}, 60, 16).tools
    spec, rng = plan.guide(FAMILIES[family]).spec, random.Random(3)
    texts = [t for t in (walk(spec, rng) for _ in range(40)) if len(plan.calls(FAMILIES[family], t)[1]) >= 2][:3]
    assert texts  # parallel answers of two calls or more, cut at every character
    for text in texts:
        whole = [c["function"] for c in plan.calls(FAMILIES[family], text)[1]]
        seen = []
        for end in range(len(text) + 1):
            content, calls = plan.calls(FAMILIES[family], text[:end], cut=True)
            got = [c["function"] for c in calls]
            assert content is None and got == whole[:len(got)]  # a prefix of the answer's calls, each whole
            seen.append(len(got))
        assert set(seen) == set(range(len(whole) + 1)) and seen[-1] == len(whole)  # each call kept once whole


def test_a_forced_call_cut_before_its_end_is_no_call_and_no_text_with_finish_reason_length():
    job = request_job(True, {**CHAT, "tools": TOOLS, "tool_choice": "required"}, 60, 16)
    shape = Shape(chat=True, job_id="x", model="m", created=0, tools=job.tools, family=FAMILIES["hermes"])
    cut = '<tool_call>\n{"name":"add","arguments":{"a":1'
    choice = shape.response([result(cut, "length")])["choices"][0]
    assert choice == {"index": 0, "message": {"role": "assistant", "content": None}, "logprobs": None,
                      "finish_reason": "length"}  # never a call whose arguments do not validate, never its markup
    reader = ToolStream(job.tools, FAMILIES["hermes"])
    assert reader.feed(cut[:9]) + reader.feed(cut[9:]) == "" and reader.finish(cut=True) == ("", [])


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_long_forced_answer_cut_short_is_read_in_one_pass(family):
    plan = request_job(True, {**CHAT, "tools": TOOLS, "tool_choice": "required"}, 60, 16).tools
    f = FAMILIES[family]
    city = '"' + "}" * 20_000 + '"'  # what a grammar allows inside a string: every "}" a candidate end
    whole = f.call_open + '{"name":"add","arguments":{"a":1,"b":2}}' + f.call_close
    text = f.open + whole + f.sep + f.call_open + '{"name":"get_weather","arguments":{"city":' + city
    content, calls = plan.calls(f, text, cut=True)  # ~20k characters: quadratic, this took seconds
    assert content is None and [c["function"]["name"] for c in calls] == ["add"]


def test_a_forced_answer_not_cut_that_its_parser_misreads_stays_text():
    """A string argument holding ``</tool_call>`` (the grammar allows it) defeats the Hermes reader: not cut,
    the answer is its text as before, never silently empty."""
    job = request_job(True, {**CHAT, "tools": TOOLS, "tool_choice": "required"}, 60, 16)
    shape = Shape(chat=True, job_id="x", model="m", created=0, tools=job.tools, family=FAMILIES["hermes"])
    text = '<tool_call>\n{"name":"get_weather","arguments":{"city":"x</tool_call>y","unit":"celsius"}}\n</tool_call>'
    choice = shape.response([result(text, "eos")])["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": text} and choice["finish_reason"] == "stop"
