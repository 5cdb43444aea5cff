"""Function tools on the Responses API (/v1/responses) end to end, with the clients users have: the openai
client's ``responses.create(tools=...)`` against a gateway and a worker serving the tiny model with a
Qwen-shaped chat template (tests/helpers/tools.py). The model is random: forced choices (``required``, a
named function) must give ``function_call`` items whose arguments validate against the function's schema,
whole and streamed (OpenAI's event sequence); ``auto`` answers text or calls; function_call_output items,
and previous_response_id chaining, carry the calls and their results back into the conversation; the Batch
API's /v1/responses lines with tools answer the same way; LangChain's ``use_responses_api`` gets tool_calls."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from openai.types.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from batchfleet.gateway.errors import APIError
from batchfleet.gateway.openai.responses.items import (
    answer_message,
    chat_messages,
    check_outputs,
    input_items,
    parse_items,
)
from tests.helpers.batches import bodies_of, run_batch
from tests.helpers.tools import TOOLS

FLAT = [{"type": "function", **t["function"]} for t in TOOLS]  # the Responses API's flat tools
SCHEMAS = {t["name"]: t["parameters"] for t in FLAT}
ASK = "What is the weather in Paris, and what is 2 + 3?"
NAMED = {"type": "function", "name": "add"}


@pytest.mark.unit
def test_items_fold_into_chat_turns_and_list_back():
    call = {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a":1,"b":2}'}
    raw = [{"role": "user", "content": "q"}, {"type": "message", "role": "assistant", "content": "Adding."}, call,
           {**call, "call_id": "call_2"}, {"type": "function_call_output", "call_id": "call_1", "output": "3"},
           {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "3"}]}]
    items = parse_items(raw)
    messages = chat_messages(items)  # the text and both parallel calls: one assistant turn
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool"]
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["call_1", "call_2"] and messages[3]["content"] == "3"
    listed = input_items("resp_r", messages)
    assert [i["type"] for i in listed] == ["message", "message", "function_call", "function_call",
                                           "function_call_output", "function_call_output"]
    assert chat_messages(parse_items([{k: v for k, v in i.items() if k != "id"} for i in listed])) == messages
    assert answer_message([{"type": "function_call", **{k: call[k] for k in ("call_id", "name", "arguments")}}]) == {
        "role": "assistant", "content": None, "tool_calls": [messages[1]["tool_calls"][0]]}
    check_outputs(items, [])
    with pytest.raises(APIError) as info:
        check_outputs(items[4:], [])
    assert info.value.param == "input.0.call_id"


def calls_of(response) -> list:
    """The response's function_call items, each checked: ids, status, arguments valid for its schema."""
    calls = [item for item in response.output if item.type == "function_call"]
    for call in calls:
        assert call.id.startswith("fc_") and call.call_id.startswith("call_") and call.status == "completed"
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    return calls


def test_required_and_named_choices_give_valid_function_calls(tool_served):
    client, gw = tool_served
    for seed in range(2):
        out = client.responses.create(model="m", input=ASK, tools=FLAT, tool_choice="required", temperature=1.0,
                                      parallel_tool_calls=False, max_output_tokens=300, extra_body={"seed": seed})
        assert out.status == "completed" and [i.type for i in out.output] == ["function_call"]
        assert len(calls_of(out)) == 1 and out.output_text == "" and out.usage.output_tokens > 0
    body = {"model": "m", "input": ASK, "tools": FLAT, "tool_choice": NAMED, "max_output_tokens": 300}
    with httpx.Client(base_url=gw.url, timeout=120) as http:  # every field OpenAI's type requires, checked
        named = Response.model_validate(http.post("/v1/responses", json=body).raise_for_status().json())
    assert [c.name for c in calls_of(named)] == ["add"] and named.tool_choice.name == "add"
    assert [t.name for t in named.tools] == ["get_weather", "add"] and named.tools[1].parameters == SCHEMAS["add"]
    for choice in ("auto", "none"):  # auto: text or calls (a random model); none: text
        out = client.responses.create(model="m", input=ASK, tools=FLAT, tool_choice=choice, max_output_tokens=24)
        assert out.status in ("completed", "incomplete") and out.output
        if choice == "none" or not calls_of(out):
            assert [i.type for i in out.output] == ["message"]


def test_streamed_function_calls_follow_openais_events(tool_served):
    client, _ = tool_served
    # (choice, max_output_tokens): the last cuts the named call short (its call alone is ~65 tokens)
    for choice, most in ((NAMED, 300), ("required", 300), ("auto", 24), (NAMED, 30)):
        events = list(client.responses.create(model="m", input=ASK, tools=FLAT, tool_choice=choice, stream=True,
                                              max_output_tokens=most, extra_body={"seed": 0}))
        assert [e.sequence_number for e in events] == list(range(len(events)))
        done = events[-1].response
        assert events[0].type == "response.created" and events[1].type == "response.in_progress"
        assert events[-1].type in ("response.completed", "response.incomplete")
        expected = []
        for index, item in enumerate(done.output):
            if item.type == "message":
                text = item.content[0].text
                deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
                assert "".join(deltas) == text
                expected += ["response.output_item.added", "response.content_part.added"]
                expected += ["response.output_text.delta"] * len(deltas)
                expected += ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
                continue
            added, delta, args_done, item_done = [e for e in events if getattr(e, "output_index", None) == index]
            assert added.item.type == "function_call" and added.item.arguments == "" and added.item.id == item.id
            assert delta.item_id == item.id and delta.delta == item.arguments == args_done.arguments
            assert item_done.item == item and added.item.call_id == item.call_id
            expected += ["response.output_item.added", "response.function_call_arguments.delta",
                         "response.function_call_arguments.done", "response.output_item.done"]
        assert [e.type for e in events[2:-1]] == expected
        if choice != "auto":  # calls alone, each whole: a cut one is left out (a parallel answer keeps the rest)
            assert {i.type for i in done.output} <= {"function_call"} and len(calls_of(done)) == len(done.output)
            if most == 30:  # cut inside its only call: nothing whole to answer
                assert (done.status, done.output) == ("incomplete", [])
            else:
                assert done.output
        assert client.responses.retrieve(done.id).output == done.output  # stored as it was streamed


def test_function_call_outputs_and_chaining_continue_the_conversation(tool_served):
    client, _ = tool_served
    first = client.responses.create(model="m", input=ASK, tools=FLAT, tool_choice="required",
                                    parallel_tool_calls=False, max_output_tokens=300)
    (call,) = calls_of(first)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"result": "sunny"})}
    # sent back whole: the question, the call (the output item as it came), its result
    explicit = client.responses.create(model="m", input=[{"role": "user", "content": ASK},
                                                         call.model_dump(exclude_none=True), result],
                                       tools=FLAT, max_output_tokens=8, temperature=0)
    assert explicit.status in ("completed", "incomplete")
    assert explicit.usage.input_tokens > first.usage.input_tokens  # the call and its result were rendered
    # chained: the stored response's output is the conversation's last turn, the result answers its call
    chained = client.responses.create(model="m", previous_response_id=first.id, input=[result], tools=FLAT,
                                      max_output_tokens=8, temperature=0)
    assert chained.usage.input_tokens == explicit.usage.input_tokens  # the same conversation, token for token
    assert [(i.type, i.model_dump().get("name")) for i in chained.output] == [
        (i.type, i.model_dump().get("name")) for i in explicit.output]
    items = client.responses.input_items.list(chained.id, order="asc").data
    assert [i.type for i in items] == ["message", "function_call", "function_call_output"]
    assert (items[1].call_id, items[1].name, items[1].arguments) == (call.call_id, call.name, call.arguments)
    assert items[2].call_id == call.call_id and items[2].output == result["output"]
    streamed = list(client.responses.create(model="m", previous_response_id=first.id, input=[result], tools=FLAT,
                                            max_output_tokens=8, temperature=0, stream=True))
    assert streamed[-1].response.usage.input_tokens == explicit.usage.input_tokens


def test_tool_refusals_name_this_apis_fields(tool_served):
    client, gw = tool_served
    loop = {"type": "function", "name": "loop", "parameters": {"$ref": "#"}}
    refused = [({"tools": [{"type": "web_search"}]}, "tools.0.type"),
               ({"tools": [FLAT[0], {"type": "file_search", "vector_store_ids": ["v"]}]}, "tools.1.type"),
               ({"tools": FLAT, "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
               ({"tools": FLAT, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
               ({"tool_choice": "required"}, "tool_choice"),
               ({"tools": [{"type": "function", "name": "a", "parameters": {}, "bogus": 1}]}, "tools.0.bogus"),
               ({"tools": [FLAT[1], loop], "tool_choice": "required"}, "tools.1.parameters"),
               ({"tools": FLAT, "tool_choice": "required", "text": {"format": {"type": "json_object"}}},
                "tool_choice"),
               ({"input": [{"type": "function_call", "call_id": "c", "name": "add", "arguments": "[1]"}]},
                "input.0.arguments"),
               ({"input": [{"type": "function_call_output", "output": "1"}]}, "input.0.call_id"),
               ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]}, "input.0.call_id"),
               ({"input": [{"type": "reasoning", "summary": []}]}, "input.0.type")]
    with httpx.Client(base_url=gw.url, timeout=60) as http:
        for extra, param in refused:
            resp = http.post("/v1/responses", json={"model": "m", "input": "hi", "max_output_tokens": 4, **extra})
            assert resp.status_code == 400, (extra, resp.text)
            assert resp.json()["error"]["param"] == param, (extra, resp.json())


def test_batch_lines_with_tools_answer_with_function_calls(tool_served):
    client, _ = tool_served
    body = {"model": "m", "input": ASK, "tools": FLAT, "max_output_tokens": 300, "parallel_tool_calls": False}
    batch = run_batch(client, "/v1/responses", {c: {**body, "tool_choice": t} for c, t in
                                                  (("required", "required"), ("named", NAMED))})
    assert batch.status == "completed" and batch.request_counts.completed == 2, batch
    answers = {c: Response.model_validate(b) for c, b in bodies_of(client, batch.output_file_id).items()}
    assert [len(calls_of(a)) for a in answers.values()] == [1, 1]
    assert calls_of(answers["named"])[0].name == "add" and answers["named"].store is False


class Sum(BaseModel):
    """Add two integers."""

    model_config = ConfigDict(extra="forbid")
    a: int = Field(ge=0, le=99)
    b: int = Field(ge=0, le=99)


class Weather(BaseModel):
    """The weather in a city."""

    model_config = ConfigDict(extra="forbid")
    city: str = Field(max_length=8)


def test_langchain_responses_api_bind_tools(tool_served):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    _, gw = tool_served
    llm = ChatOpenAI(base_url=gw.url + "/v1", api_key="unused", model="m", max_tokens=300, max_retries=0,
                     timeout=120, use_responses_api=True)
    message = llm.bind_tools([Weather, Sum], tool_choice="any", parallel_tool_calls=False).invoke("Weather?")
    (call,) = message.tool_calls
    {"Weather": Weather, "Sum": Sum}[call["name"]].model_validate(call["args"])
    forced = llm.bind_tools([Weather, Sum], tool_choice="Sum").invoke("2 + 3?")
    assert [c["name"] for c in forced.tool_calls] == ["Sum"] and Sum.model_validate(forced.tool_calls[0]["args"])
    # the call and its result back in the conversation (function_call and function_call_output items)
    history = [HumanMessage("2 + 3?"), forced, ToolMessage("5", tool_call_id=forced.tool_calls[0]["id"])]
    answer = llm.bind_tools([Sum]).invoke(history)
    assert answer.tool_calls or isinstance(answer.text, str)
    merged = None
    for chunk in llm.bind_tools([Sum], tool_choice="Sum").stream("1 + 1?"):
        merged = chunk if merged is None else merged + chunk
    assert [c["name"] for c in merged.tool_calls] == ["Sum"] and Sum.model_validate(merged.tool_calls[0]["args"])
