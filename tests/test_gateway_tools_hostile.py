"""Forced tool calls over many schemas, and hostile tool requests, against a gateway and a worker serving the
random tiny model (with the openai client and raw httpx). ``required`` and a named function give arguments
that validate (jsonschema, formats checked) for every llguidance-supported feature: enums, consts, nested
objects, arrays with item bounds, prefixItems, string patterns and formats, numbers with (exclusive) bounds
and multiples, anyOf / oneOf / allOf, $ref, patternProperties; the features llguidance lacks are a 400
naming the schema, never a 200 that breaks it. A model's call that breaks its schema under ``auto`` is text;
streams with tools, n > 1 and logprobs end once per request; the worker serves on afterwards."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import jsonschema
import openai
import pytest

pytestmark = pytest.mark.integration


def obj(props: dict, required: list | None = None, **kw) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False, **kw}


DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}
SCHEMAS = [
    obj({"u": {"type": "string", "enum": ["c", "f", "k"]}}),
    obj({"n": {"type": "integer", "minimum": -5, "maximum": 5}}),
    obj({"n": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 3}}),
    obj({"x": {"type": "number", "minimum": 0.5, "maximum": 1.5}}), obj({"s": {"type": "string", "minLength": 2,
                                                                          "maxLength": 4}}),
    obj({"s": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"}}),
    obj({"s": {"type": "string", "pattern": "^(yes|no)$"}}),
    obj({"a": {"type": "array", "items": DIGIT, "minItems": 2, "maxItems": 3}}),
    obj({"a": {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 1, "maxItems": 2}}),
    obj({"o": obj({"p": obj({"q": {"type": "boolean"}})})}), obj({"c": {"const": "fixed"}}),
    obj({"b": {"type": "boolean"}, "z": {"type": "null"}}),
    obj({"v": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 3}, {"type": "string", "maxLength": 3}]}}),
    obj({"v": {"type": ["integer", "null"], "minimum": 0, "maximum": 3}}),
    obj({"t": {"type": "array", "prefixItems": [DIGIT, {"type": "string", "maxLength": 2}], "items": False}}),
    obj({"d": {"type": "string", "format": "date"}}), obj({"u": {"type": "string", "format": "uuid"}}),
    obj({"r": {"$ref": "#/$defs/pt"}}, **{"$defs": {"pt": obj({"x": DIGIT, "y": DIGIT})}}),
    obj({"opt": DIGIT, "req": {"type": "string", "maxLength": 3}}, ["req"]),
    obj({"m": {"type": "number", "multipleOf": 0.5, "minimum": 0, "maximum": 3}}),
    obj({"i": {"type": "integer", "multipleOf": 3, "minimum": 0, "maximum": 30}}),
    obj({"n": {"enum": [1, "two", None, True]}}),
    obj({"l": {"type": "array", "items": obj({"k": {"enum": ["a", "b"]}}), "minItems": 1, "maxItems": 2}}),
    obj({"all": {"allOf": [{"type": "integer", "minimum": 0}, {"maximum": 5}]}}),
    obj({"one": {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 3}, {"type": "boolean"}]}}),
    obj({"s": {"type": "string", "maxLength": 5, "pattern": "^[a-z]*$"}, "n": {"type": "number", "minimum": -1,
                                                                               "maximum": 1}}),
    obj({}), obj({"neg": {"type": "integer", "minimum": -12, "maximum": -10}}),
    obj({"pp": {"type": "object", "patternProperties": {"^k[0-9]$": {"type": "integer", "minimum": 0, "maximum": 1}},
                "additionalProperties": False, "maxProperties": 2}}),
    obj({"w": {"enum": ["é", "日本", "a\u0000b"]}}),
]
UNSUPPORTED = [obj({"x": {"type": "array", "items": DIGIT, "uniqueItems": True}}),
               obj({"x": {"not": {"type": "string"}}}), {"type": "object", "if": {"required": ["a"]}, "then": {}},
               obj({"x": {"type": "integer", "minimum": 5, "maximum": 1}})]
ASK = [{"role": "user", "content": "Call it."}]


def tool(name: str, schema: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": schema}}


def test_forced_calls_validate_over_many_schemas_and_unsupported_ones_are_400s(tool_served):
    client, _ = tool_served

    def ask(i: int) -> str:
        schema = SCHEMAS[i]
        choice = "required" if i % 2 else {"type": "function", "function": {"name": f"t{i}"}}
        answer = client.chat.completions.create(model="m", messages=ASK, tools=[tool(f"t{i}", schema)], seed=i,
                                                tool_choice=choice, parallel_tool_calls=False, max_tokens=300)
        (call,) = answer.choices[0].message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), schema, format_checker=jsonschema.FormatChecker())
        return call.function.name

    assert len(SCHEMAS) >= 30
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        assert list(pool.map(ask, range(len(SCHEMAS)))) == [f"t{i}" for i in range(len(SCHEMAS))]
    for schema in UNSUPPORTED:
        with pytest.raises(openai.BadRequestError) as exc:
            client.chat.completions.create(model="m", messages=ASK, tools=[tool("u", schema)], tool_choice="required")
        assert exc.value.body["param"] == "tools.0.function.parameters"


def test_hostile_tool_requests_answer_once_and_the_worker_serves_on(tool_served):
    client, gw = tool_served
    add = tool("add", obj({"a": DIGIT, "b": DIGIT}))
    with httpx.Client(base_url=gw.url, timeout=120) as http:
        # the model "writes" a call that breaks its schema (a guide makes it): text, never a tool call
        bad = '<tool_call>\n{"name": "add", "arguments": {"a": "x", "b": 2}}\n</tool_call>'
        resp = http.post("/v1/chat/completions", json={"messages": ASK, "tools": [add], "guided_choice": [bad],
                                                       "max_tokens": 200})
        assert resp.status_code == 200 and resp.json()["choices"][0]["message"].get("tool_calls") is None
        for body, param in (({"tool_choice": "required", "stop": ["}"]}, "stop"),
                            ({"messages": [*ASK, {"role": "tool", "tool_call_id": "nope", "content": "1"}]},
                             "messages.1.tool_call_id"),
                            ({"tools": [tool("x", {"type": "object", "properties": {"a": {"type": "bogus"}}})]},
                             "tools.0.function.parameters")):
            resp = http.post("/v1/chat/completions", json={"messages": ASK, "tools": [add], "max_tokens": 4, **body})
            assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
        # streamed: required, three choices, logprobs; each choice's call validates, one [DONE]
        body = {"messages": ASK, "tools": [add], "tool_choice": "required", "n": 3, "logprobs": True,
                "top_logprobs": 2, "stream": True, "max_tokens": 200, "parallel_tool_calls": False}
        with http.stream("POST", "/v1/chat/completions", json=body) as resp:
            lines = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines.count("[DONE]") == 1 and lines[-1] == "[DONE]"
    args: dict[int, str] = {}
    finish: dict[int, str] = {}
    for chunk in map(json.loads, lines[:-1]):
        for choice in chunk["choices"]:
            for delta in choice["delta"].get("tool_calls") or ():
                args[choice["index"]] = args.get(choice["index"], "") + delta["function"].get("arguments", "")
            finish[choice["index"]] = choice["finish_reason"] or finish.get(choice["index"])
    assert finish == {0: "tool_calls", 1: "tool_calls", 2: "tool_calls"}
    for text in args.values():
        jsonschema.validate(json.loads(text), add["function"]["parameters"])
    after = client.chat.completions.create(model="m", messages=ASK, max_tokens=3)
    assert after.choices[0].finish_reason in ("stop", "length")
