"""Tool calling end to end, with the clients users have: the openai client's chat tools against a gateway
and a worker serving the tiny model with a Qwen-shaped chat template (tools rendered by it). The model is
random, so its free answers are noise: the forced paths (``required``, a named function) must still give
calls whose arguments validate against the function's schema, whole and streamed; ``auto`` answers 200 with
text or calls; tool results go back in the conversation; a schema llguidance cannot compile is a 400 naming
it. LangChain's ``bind_tools`` and ``with_structured_output(method="function_calling")`` work unchanged."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from tests.helpers.batches import bodies_of, run_batch
from tests.helpers.tools import ADD, TOOLS, WEATHER

SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]


def valid(call) -> dict:
    """The call's arguments, checked against its function's schema."""
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


def test_required_and_named_choices_always_give_valid_calls(tool_served):
    client, _ = tool_served
    for seed in range(3):
        answer = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="required",
                                                parallel_tool_calls=False, max_tokens=300, temperature=1.0,
                                                seed=seed)
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        assert choice.message.content is None and choice.message.tool_calls[0].id.startswith("call_")
        valid(choice.message.tool_calls[0])
    named = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=300,
                                           tool_choice={"type": "function", "function": {"name": "add"}})
    choice = named.choices[0]
    assert choice.finish_reason == "stop"  # as OpenAI answers a named choice
    assert [c.function.name for c in choice.message.tool_calls] == ["add"]
    assert set(valid(choice.message.tool_calls[0])) == {"a", "b"}


def test_streamed_tool_calls_arrive_as_openais_deltas(tool_served):
    client, _ = tool_served
    stream = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=300, stream=True,
                                            tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                            stream_options={"include_usage": True})
    calls: dict[int, dict] = {}
    finish, content, usage = None, "", None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or ():
                call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = delta.id or call["id"]
                if delta.function is not None:
                    call["name"] += delta.function.name or ""
                    call["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "stop" and content == "" and list(calls) == [0] and usage.completion_tokens > 0
    assert calls[0]["id"].startswith("call_") and calls[0]["name"] == "get_weather"
    jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMAS["get_weather"])


def test_auto_answers_text_or_calls_and_tool_results_go_back(tool_served):
    client, _ = tool_served
    for choice in ("auto", "none"):
        answer = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice=choice,
                                                max_tokens=24)
        message = answer.choices[0].message
        assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
        assert message.tool_calls or isinstance(message.content, str)
        if choice == "none":
            assert message.tool_calls is None
    first = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=300)
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"result": "sunny, 22 C"})}]
    again = client.chat.completions.create(model="m", messages=history, tools=TOOLS, max_tokens=8)
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert again.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result were rendered


def test_a_schema_llguidance_cannot_compile_is_a_400_naming_it(tool_served):
    client, _ = tool_served
    bad = {"type": "function", "function": {"name": "loop", "parameters": {"$ref": "#"}}}
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="m", messages=ASK, tools=[ADD, bad], tool_choice="required")
    assert exc.value.body["param"] == "tools.1.function.parameters"
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER],
                                       tool_choice={"type": "function", "function": {"name": "add"}})
    assert exc.value.body["param"] == "tool_choice"


def test_batch_lines_with_tools_answer_with_tool_calls(tool_served):
    client, _ = tool_served
    body = {"model": "m", "messages": ASK, "tools": TOOLS, "max_tokens": 300, "parallel_tool_calls": False}
    choices = {"required": "required", "named": {"type": "function", "function": {"name": "add"}}}
    batch = run_batch(client, "/v1/chat/completions", {c: {**body, "tool_choice": t} for c, t in choices.items()})
    assert batch.status == "completed" and batch.request_counts.completed == 2, batch
    answers = {c: b["choices"][0] for c, b in bodies_of(client, batch.output_file_id).items()}
    assert answers["required"]["finish_reason"] == "tool_calls" and answers["named"]["finish_reason"] == "stop"
    for answer in answers.values():
        (call,) = answer["message"]["tool_calls"]
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    assert answers["named"]["message"]["tool_calls"][0]["function"]["name"] == "add"


class Weather(BaseModel):
    """The weather in a city."""

    model_config = ConfigDict(extra="forbid")
    city: str = Field(max_length=8, description="the city")
    unit: Literal["celsius", "fahrenheit"]


class Sum(BaseModel):
    """Add two integers."""

    model_config = ConfigDict(extra="forbid")
    a: int = Field(ge=0, le=99)
    b: int = Field(ge=0, le=99)


def test_langchain_bind_tools_and_structured_output(tool_served):
    from langchain_openai import ChatOpenAI

    _, gw = tool_served
    llm = ChatOpenAI(base_url=gw.url + "/v1", api_key="unused", model="m", max_tokens=300, max_retries=0,
                     timeout=120)
    message = llm.bind_tools([Weather, Sum], tool_choice="any", parallel_tool_calls=False).invoke(
        "Weather in Paris?")
    assert len(message.tool_calls) == 1 and message.tool_calls[0]["name"] in ("Weather", "Sum")
    {"Weather": Weather, "Sum": Sum}[message.tool_calls[0]["name"]].model_validate(message.tool_calls[0]["args"])
    forced = llm.bind_tools([Weather, Sum], tool_choice="Sum").invoke("2 + 3?")
    assert [c["name"] for c in forced.tool_calls] == ["Sum"]
    weather = llm.with_structured_output(Weather, method="function_calling").invoke("Weather in Oslo?")
    assert isinstance(weather, Weather) and len(weather.city) <= 8
    chunks = list(llm.bind_tools([Sum], tool_choice="Sum").stream("1 + 1?"))
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged += chunk
    assert [c["name"] for c in merged.tool_calls] == ["Sum"] and Sum.model_validate(merged.tool_calls[0]["args"])


def test_a_forced_call_cut_short_answers_no_call_and_no_text(tool_served):
    client, _ = tool_served
    for stream in (False, True):
        answer = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=30, stream=stream,
                                                tool_choice={"type": "function", "function": {"name": "add"}})
        chunks = list(answer) if stream else []
        if stream:
            assert not any(c.choices and (c.choices[0].delta.content or c.choices[0].delta.tool_calls) for c in chunks)
            assert chunks[-1].choices[0].finish_reason == "length"
        else:  # the call alone is ~65 tokens: cut, it is left out (its arguments would not validate)
            assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 30
            assert answer.choices[0].message.content is None and answer.choices[0].message.tool_calls is None
