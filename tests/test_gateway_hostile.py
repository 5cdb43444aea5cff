"""Hostile requests never get a 5xx: a few hundred malformed, mistyped, oversized, deeply nested and
invalid-Unicode bodies against a gateway with a live worker, each answered 4xx (or 200 when it happens to be
valid), and no ERROR logged; among them the cases with one expected answer (``exact``: guides llguidance
gives up on, at once or while generating; integers past 64 bits; chat messages without content; bodies not
sent as JSON). A client that disconnects before sending its body is not an error either."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import socket
import time

import httpx
import pytest

from batchfleet.producer import Client, InvalidRequest
from tests.test_guide_checks import FAILS_LATER, GIVEN_UP

FIELDS = ["prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
          "seed", "stop", "n", "stream", "stream_options", "timeout", "logprobs", "top_logprobs", "logit_bias",
          "repetition_penalty", "min_tokens", "ignore_eos", "user", "model", "tools", "response_format", "echo",
          "priority", "guided_regex", "guided_grammar", "guided_json", "presence_penalty", "frequency_penalty",
          "tool_choice", "parallel_tool_calls"]
VALUES = [None, True, False, 0, -1, 1, 2**63, 2**64, 10**30, -2**64, 1.5, -0.0, 1e308, 1e-320, "", "x", "\ud800",
          "\udfff\ud800", "0.5", "true", [], {}, [1, 2], [2**64], [-1], ["a", 3], {"a": [1]}, [[1]], [[]],
          {"type": "json_schema"}, {"include_usage": "yes"}, "a" * 5000, 2.0, -2.0, 2.5, "required", "none",
          {"1": 100}, {"1": 101}, {"99999": 1}, {"-1": 1}, {str(i): 1 for i in range(301)},
          {"type": "function", "function": {"name": "f"}}, [{"type": "function", "function": {"name": "f"}}],
          [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#"}}}],
          [{"type": "function", "function": {"name": "f", "parameters": []}}], [{"type": "function"}]]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"], "additionalProperties": False}}}
LOOP = {"type": "function", "function": {"name": "loop", "parameters": {"$ref": "#"}}}


def nested(depth: int, leaf: object = 1) -> str:
    return "[" * depth + json.dumps(leaf) + "]" * depth


def hostile_bodies(rng: random.Random) -> list[tuple[str, bytes]]:
    """(path, raw body): handcrafted cases first, then random field/value mixtures."""
    base = {"prompt": "Hi", "max_tokens": 2}
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    raw: list[tuple[str, bytes]] = [
        ("/v1/completions", nested(1000).encode()),
        ("/v1/completions", ('{"prompt": ' + nested(1000, "a") + "}").encode()),
        ("/v1/completions", ('{"prompt": "a", "logit_bias": ' + '{"a":' * 900 + "1" + "}" * 900 + "}").encode()),
        ("/v1/chat/completions", ('{"messages": ' + nested(5000) + "}").encode()),
        ("/v1/completions", b'{"prompt": "\\ud800", "max_tokens": 2}'),
        ("/v1/completions", b'{"prompt": ["\\udc00abc"], "max_tokens": 2}'),
        ("/v1/completions", b'{"prompt": "a", "stop": ["\\ud800"], "max_tokens": 2}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x\\ud83d"}], "max_tokens": 2}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}'),
        ("/v1/completions", json.dumps({**base, "top_k": 2**64}).encode()),
        ("/v1/completions", json.dumps({**base, "top_k": 2**100, "seed": 2**64}).encode()),
        ("/v1/completions", json.dumps({**base, "max_tokens": 2**64}).encode()),
        ("/v1/completions", json.dumps({**base, "prompt": [2**64, 1]}).encode()),
        ("/v1/completions", json.dumps({**base, "prompt": [[2**70]]}).encode()),
        ("/v1/completions", json.dumps({**base, "timeout": 1e308}).encode()),
        ("/v1/chat/completions", json.dumps({**chat, "messages": [{"role": "user", "content": "x"}] * 2000}).encode()),
        ("/v1/chat/completions", json.dumps({**chat, "messages": [{"role": "user"}]}).encode()),
        ("/v1/chat/completions", json.dumps({**chat, "messages": [{"content": "x"}]}).encode()),
        ("/v1/completions", b""), ("/v1/completions", b"null"), ("/v1/completions", b"[]"), ("/v1/completions", b'"x"'),
        ("/v1/completions", b"\xff\xfe\x00garbage"), ("/v1/completions", b'{"prompt": "a"'),
        ("/v1/completions", b'{"prompt": "a", "temperature": NaN}'), ("/v1/completions", b'{"prompt": "a",}'),
        ("/v1/completions", b'{"prompt": "a", "prompt": 3}'), ("/v1/completions", b"1" * 10_000),
        ("/v1/completions", json.dumps({**base, "model": "m" * 100_000}).encode()),
        ("/v1/chat/completions", json.dumps({**chat, "tools": [TOOL] * 129}).encode()),
        ("/v1/chat/completions", json.dumps({**chat, "tools": [TOOL], "tool_choice": "required", "max_tokens": 40,
                                             "parallel_tool_calls": False}).encode()),
        ("/v1/chat/completions", json.dumps({**chat, "tools": [TOOL], "tool_choice": "required", "stream": True,
                                             "max_tokens": 40}).encode()),
        ("/v1/chat/completions", json.dumps({**chat, "tools": [TOOL], "tool_choice": {"type": "function"}}).encode()),
        ("/v1/chat/completions", json.dumps({**chat, "tools": [{**TOOL, "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": "string", "pattern": "a{99999}"}}, "required": ["a"]}}}],
            "tool_choice": "required", "max_tokens": 30}).encode()),
        ("/v1/chat/completions", json.dumps({**chat, "messages": [
            {"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
            {"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": "1"}]}]}).encode()),
        ("/v1/chat/completions", json.dumps({**chat, "messages": [{"role": "tool", "tool_call_id": 5, "content": "x"}]
                                             }).encode()),
        ("/v1/chat/completions", json.dumps({**chat, "messages": [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": nested(900)}}]}]}).encode()),
    ]
    raw += hostile_new_routes(rng)
    for _ in range(300):
        body: dict = dict(rng.choice([base, chat]))
        for _ in range(rng.randint(1, 3)):
            body[rng.choice(FIELDS + ["x-unknown", "", "__proto__"])] = rng.choice(VALUES)
        raw.append(("/v1/chat/completions" if "messages" in body else "/v1/completions", json.dumps(body).encode()))
    return raw


# the Responses API and embeddings (issue 33): their own fields, mixed with the values above
NEW_ROUTES = {
    "/v1/responses": ({"input": "Hi", "max_output_tokens": 2},
                      ["input", "instructions", "max_output_tokens", "temperature", "top_p", "text", "stream", "store",
                       "previous_response_id", "metadata", "tools", "tool_choice", "truncation", "include",
                       "reasoning", "background", "stream_options", "parallel_tool_calls", "seed", "model"]),
    "/v1/embeddings": ({"input": "Hi"}, ["input", "encoding_format", "dimensions", "user", "timeout", "model",
                                         "service_tier", "priority"]),
}
VLLM_ROUTES = {  # vLLM's tokenizer routes (issue 58): bodies from a generator of their own (the others' unchanged)
    "/tokenize": ({"prompt": "Hi"}, ["prompt", "messages", "add_special_tokens", "add_generation_prompt", "tools",
                                     "return_token_strs", "continue_final_message", "chat_template", "model"]),
    "/detokenize": ({"tokens": [1, 2]}, ["tokens", "model"]),
}
NEW_VALUES = [[{"role": "user", "content": [{"type": "input_image"}]}], [{"type": "function_call"}], [{"role": "x"}],
              {"format": {"type": "json_schema", "schema": {"type": 3}}}, {"format": {"type": "json_schema"}},
              "resp_" + "0" * 32, "resp_../../x", [[2**64]], [[1] * 5000], ["a"] * 3000, {"k": "v" * 600},
              # function tools (flat), their choices, calls and results as input items
              [{"type": "function", "name": "f", "parameters": {"$ref": "#"}}], [{"type": "web_search"}], [[]],
              {"type": "function", "name": "f"}, {"type": "mcp"}, "required",
              [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
               {"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image"}]}],
              [{"type": "function_call", "call_id": "", "name": 5, "arguments": "{"}]]


def hostile_new_routes(rng: random.Random) -> list[tuple[str, bytes]]:
    out = [("/v1/responses", b'{"input": "\\ud800"}'), ("/v1/embeddings", b'{"input": ["\\udc00"]}'),
           ("/tokenize", b'{"prompt": "\\ud800"}'), ("/detokenize", b'{"tokens": [4294967296, -1]}'),
           ("/tokenize", b'{"messages": [{"role": "user", "content": "x\\ud83d"}], "return_token_strs": true}'),
           ("/v1/responses", nested(3000).encode()), ("/v1/embeddings", ('{"input": ' + nested(3000) + "}").encode())]
    for routes, count, draw in ((NEW_ROUTES, 120, rng), (VLLM_ROUTES, 120, random.Random(58))):
        for _ in range(count):
            path = draw.choice(list(routes))
            base, fields = routes[path]
            body = dict(base)
            for _ in range(draw.randint(1, 3)):
                body[draw.choice(fields + ["x-unknown"])] = draw.choice(VALUES + NEW_VALUES)
            out.append((path, json.dumps(body).encode()))
    return out


def exact() -> list[tuple[str, bytes, str | None, int, str | None]]:
    """(path, body, Content-Type, status, param or code) of the cases with one right answer."""
    base = {"prompt": "Hi", "max_tokens": 2}
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    out: list[tuple[str, bytes, str | None, int, str | None]] = []
    for option, value, _ in GIVEN_UP:
        out += [(path, json.dumps({**body, option: value}).encode(), "application/json", 400, option)
                for path, body in (("/v1/completions", base), ("/v1/chat/completions", chat))]
    late = json.dumps({**base, "max_tokens": 40, "guided_grammar": FAILS_LATER}).encode()
    out += [("/v1/completions", late, "application/json", 400, "guide_failed"),
            ("/v1/completions", json.dumps({**base, "priority": 2**64}).encode(), "application/json", 400, "priority"),
            ("/v1/chat/completions", json.dumps({**chat, "priority": -(2**63) - 1}).encode(), "application/json", 400,
             "priority")]
    tools = {**chat, "tools": [TOOL, LOOP]}
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[]"}}
    not_an_object = {"role": "assistant", "content": None, "tool_calls": [call]}
    out += [("/v1/chat/completions", json.dumps({**tools, "tool_choice": "required"}).encode(), "application/json", 400,
             "tools.1.function.parameters"),
            ("/v1/chat/completions", json.dumps({**tools, "tool_choice": {"type": "function", "function": {
                "name": "g"}}}).encode(), "application/json", 400, "tool_choice"),
            ("/v1/chat/completions", json.dumps({**chat, "tool_choice": "required"}).encode(), "application/json", 400,
             "tool_choice"),
            ("/v1/chat/completions", json.dumps({**chat, "logit_bias": {"320": 1}}).encode(), "application/json", 400,
             "logit_bias"),
            ("/v1/completions", json.dumps({**base, "presence_penalty": -2.5}).encode(), "application/json", 400,
             "presence_penalty"),
            ("/v1/chat/completions", json.dumps({**chat, "max_completion_tokens": 3}).encode(), "application/json", 400,
             "max_completion_tokens"),
            ("/v1/chat/completions", json.dumps({**chat, "messages": [not_an_object]}).encode(), "application/json",
             400, "messages.0.tool_calls.0.function.arguments"),
            ("/v1/chat/completions", json.dumps({**chat, "tools": [TOOL], "tool_choice": "required", "stop": "}"}
                                                ).encode(), "application/json", 400, "stop"),
            ("/v1/chat/completions", json.dumps({**chat, "messages": [{**not_an_object, "tool_calls": [
                {**call, "function": {"name": "f", "arguments": '{"a": NaN}'}}]}, {"role": "tool", "tool_call_id": "d",
                                                                                    "content": "1"}]}).encode(),
             "application/json", 400, "messages.0.tool_calls.0.function.arguments"),
            ("/v1/chat/completions", json.dumps({**chat, "messages": [
                {"role": "tool", "tool_call_id": "c", "content": "1"}]}).encode(), "application/json", 400,
             "messages.0.tool_call_id"),
            ("/v1/chat/completions", json.dumps({**chat, "tools": [{"type": "function", "function": {"name": "g",
             "parameters": {"type": "object", "properties": {"a": {"type": "bogus"}}}}}]}).encode(), "application/json",
             400, "tools.0.function.parameters")]
    for message in ({"role": "user"}, {"role": "system", "content": None}, {"role": "assistant", "tool_calls": []}):
        out.append(("/v1/chat/completions", json.dumps({**chat, "messages": [message]}).encode(), "application/json",
                    400, "messages.0.content"))
    for media in (None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        out.append(("/v1/completions", json.dumps(base).encode(), media, 415, "unsupported_media_type"))
    return out


def test_hostile_requests_never_get_a_5xx(start_worker, start_gateway, caplog):
    start_worker(max_wait_ms=5)
    gw = start_gateway(request_timeout_s=20)
    bodies = [(p, b, "application/json") for p, b in hostile_bodies(random.Random(22))]
    known = exact()
    caplog.set_level(logging.WARNING)

    async def fire() -> list[tuple[int, str, bytes, dict]]:
        limit = asyncio.Semaphore(32)
        async with httpx.AsyncClient(base_url=gw.url, timeout=60) as http:
            async def one(path: str, body: bytes, media: str | None) -> tuple[int, str, bytes, dict]:
                async with limit:
                    resp = await http.post(path, content=body, headers={"content-type": media} if media else {})
                    error = {}
                    if resp.status_code != 200:  # an error body in OpenAI's shape
                        error = resp.json()["error"]
                        assert set(error) == {"message", "type", "param", "code"}, resp.text
                    return resp.status_code, path, body[:200], error
            return await asyncio.gather(*(one(p, b, m) for p, b, m in bodies + [k[:3] for k in known]))

    answers = asyncio.run(fire())
    bad = [a for a in answers if a[0] >= 500]
    assert not bad, bad[:5]
    assert len(answers) >= 420 and {s for s, *_ in answers} <= {200, 400, 404, 413, 415}, {s for s, *_ in answers}
    for (status, _, body, error), (*_, want, name) in zip(answers[len(bodies):], known):
        assert status == want and name in (error["param"], error["code"]), (body, status, error)
    assert sum(s == 400 for s, *_ in answers) > 250
    # a client that sends headers announcing a body, then leaves: nothing logged as an error
    for sent in (b"", b'{"prompt": "a'):
        with socket.create_connection(("127.0.0.1", gw.port)) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n" + sent)
            time.sleep(0.2)
    time.sleep(0.5)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors][:3]


def test_the_python_client_refuses_invalid_unicode_before_sending(start_worker, redis_url, namespace):
    start_worker(max_wait_ms=5)
    with Client(redis_url, namespace) as client:
        for bad in ("a\ud800", [{"role": "user", "content": "\udc00"}]):
            with pytest.raises(InvalidRequest, match="Unicode"):
                client.generate(bad, max_new_tokens=2, timeout=30)
        with pytest.raises(InvalidRequest, match="stop"):
            client.generate("a", max_new_tokens=2, stop=["\ud800"], timeout=30)
        with pytest.raises(InvalidRequest, match="top_k"):
            client.generate("a", max_new_tokens=2, top_k=2**64, timeout=30)
