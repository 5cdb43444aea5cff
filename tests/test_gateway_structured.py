"""Structured outputs, logprobs and n > 1 end to end: the official ``openai`` client and raw HTTP against
the gateway, the Python clients, and raw wire entries, over a real Redis and a real (random-weight)
worker. Every schema-constrained output parses and validates against its schema."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import msgpack
import openai
import pytest
import redis

from batchfleet.common.keys import Keys
from batchfleet.producer import Client, InvalidRequest, JobFailed
from tests.helpers.gateway import gateways

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999},
        "kind": {"enum": ["town", "city", "village"]},
        "districts": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["city", "population", "kind", "districts"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "Describe a place as JSON."}]


@pytest.fixture
def fleet(start_worker, redis_url, namespace):
    """A continuous-mode native worker and a gateway: (openai client, httpx client, gateway url)."""
    start_worker(engine="native", mode="continuous", max_wait_ms=5, kv_cache_gb=0.02)
    with gateways(redis_url, namespace) as start:
        gw = start()
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        with httpx.Client(base_url=gw.url, timeout=120) as http:
            yield client, http


def valid(text: str) -> dict:
    obj = json.loads(text)
    jsonschema.validate(obj, SCHEMA)
    return obj


def test_json_schema_chat_and_completions_streamed_and_not(fleet):
    client, http = fleet
    model = client.models.list().data[0].id
    for seed in range(3):  # sampled (temperature 1) and greedy, on random weights: always valid, always closed
        chat = client.chat.completions.create(messages=MESSAGES, model=model, response_format=RESPONSE_FORMAT,
                                              max_tokens=120, temperature=1.0, seed=seed)
        assert chat.choices[0].finish_reason == "stop"
        valid(chat.choices[0].message.content)
    chunks = list(client.chat.completions.create(messages=MESSAGES, model=model, response_format=RESPONSE_FORMAT,
                                                 max_tokens=120, temperature=0, stream=True))
    valid("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
    # completions take response_format too (as vLLM's), through the client's extra_body
    comp = client.completions.create(prompt="JSON:", model=model, max_tokens=120, temperature=0.7, seed=1,
                                     extra_body={"response_format": RESPONSE_FORMAT})
    valid(comp.choices[0].text)
    streamed = list(client.completions.create(prompt="JSON:", model=model, max_tokens=120, temperature=0.7, seed=1,
                                              stream=True, extra_body={"response_format": RESPONSE_FORMAT}))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == comp.choices[0].text
    # n choices, each valid, each its own sample
    many = client.chat.completions.create(messages=MESSAGES, model=model, response_format=RESPONSE_FORMAT,
                                          max_tokens=120, temperature=1.0, seed=7, n=3)
    assert [c.index for c in many.choices] == [0, 1, 2]
    texts = [valid(c.message.content) and c.message.content for c in many.choices]
    assert len(set(texts)) > 1
    # any JSON object: when it closes, it is an object
    obj = client.chat.completions.create(messages=MESSAGES, model=model, response_format={"type": "json_object"},
                                         max_tokens=60, temperature=0)
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)


def test_vllm_extensions_regex_choice_grammar(fleet):
    client, http = fleet
    model = client.models.list().data[0].id
    regex = r"[A-Z][a-z]{2,5}-[0-9]{2}"
    for body in ({"guided_regex": regex}, {"structured_outputs": {"regex": regex}}):
        r = http.post("/v1/completions", json={"prompt": "Code:", "max_tokens": 20, "temperature": 1, **body})
        assert r.status_code == 200, r.text
        assert re.fullmatch(regex, r.json()["choices"][0]["text"])
    choices = ["positive", "negative", "neutral"]
    for body in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
        out = client.chat.completions.create(messages=MESSAGES, model=model, max_tokens=20, temperature=1,
                                             extra_body=body)
        assert out.choices[0].message.content in choices
    out = client.completions.create(prompt="x", model=model, max_tokens=30, temperature=1,
                                    extra_body={"guided_json": {"type": "array", "items": {"type": "boolean"},
                                                                "maxItems": 3}})
    assert all(isinstance(x, bool) for x in json.loads(out.choices[0].text))
    out = client.completions.create(prompt="x", model=model, max_tokens=30,
                                    extra_body={"guided_grammar": 'start: "ab" ("c" | "d")'})
    assert out.choices[0].text in ("abc", "abd")


def test_bad_structured_requests_are_400s_naming_the_field(fleet):
    client, http = fleet
    model = client.models.list().data[0].id
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(messages=MESSAGES, model=model, response_format=bad_schema)
    assert exc.value.body["param"] == "response_format"
    cases = [
        ({"response_format": bad_schema}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "string", "minLength": 5,
                                                                                 "maxLength": 2}}}}, "response_format"),
        ({"guided_regex": "[a-"}, "guided_regex"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_choice": "yes"}, "guided_choice"),
        ({"guided_grammar": "start: ("}, "guided_grammar"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, None),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"xml": "a"}}, "structured_outputs.xml"),  # strict: the unknown field's path
        ({"logprobs": 21}, "logprobs"), ({"logprobs": "2"}, "logprobs"), ({"n": 0}, "n"), ({"n": 1000}, "n"),
    ]
    for extra, param in cases:
        r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, **extra})
        assert r.status_code == 400, (extra, r.text)
        assert param is None or r.json()["error"]["param"] == param, (extra, r.json())
    chat = {"messages": MESSAGES, "max_tokens": 4}
    for extra, param in [({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": 1}, "logprobs"),
                         ({"logprobs": True, "top_logprobs": 21}, "top_logprobs")]:
        r = http.post("/v1/chat/completions", json={**chat, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)


def test_logprobs_and_n_in_openai_shapes(fleet):
    client, _ = fleet
    model = client.models.list().data[0].id
    whole = client.completions.create(prompt="Once", model=model, max_tokens=8, temperature=0.8, seed=3, logprobs=3)
    lp = whole.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == whole.usage.completion_tokens
    # ids whose text is alike (bytes of one character: U+FFFD) share a key
    assert all(x <= 0 for x in lp.token_logprobs) and all(1 <= len(t) <= 4 for t in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for tok, x, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert tok in top and (tok == "\ufffd" or top[tok] == pytest.approx(x))  # bytes of a character: alike
    chunks = list(client.completions.create(prompt="Once", model=model, max_tokens=8, temperature=0.8, seed=3,
                                            logprobs=3, stream=True))
    streamed = [x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs)

    chat = client.chat.completions.create(messages=MESSAGES, model=model, max_tokens=8, temperature=0, logprobs=True,
                                          top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)  # greedy: the best token
    chat_chunks = list(client.chat.completions.create(messages=MESSAGES, model=model, max_tokens=8, temperature=0,
                                                      logprobs=True, top_logprobs=2, stream=True))
    got = [x.logprob for c in chat_chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.content]
    assert got == pytest.approx([c.logprob for c in content])
    plain = client.chat.completions.create(messages=MESSAGES, model=model, max_tokens=4)
    assert plain.choices[0].logprobs is None

    # n: choice i is sampled as one request seeded seed + i; usage counts the prompt once
    many = client.completions.create(prompt="Once", model=model, max_tokens=6, temperature=1.0, seed=40, n=3,
                                     stream_options=None)
    singles = [client.completions.create(prompt="Once", model=model, max_tokens=6, temperature=1.0, seed=40 + i)
               for i in range(3)]
    assert [c.text for c in many.choices] == [s.choices[0].text for s in singles]
    assert many.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert many.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    assert len(many.model_extra["batchfleet"]["choices"]) == 3
    chunks = list(client.completions.create(prompt="Once", model=model, max_tokens=6, temperature=1.0, seed=40, n=3,
                                            stream=True, stream_options={"include_usage": True}))
    for i in range(3):
        text = "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i)
        assert text == many.choices[i].text
    assert chunks[-1].usage == many.usage
    finishes = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(finishes) == [0, 1, 2]


def test_python_clients_take_the_same_options(start_worker, redis_url, namespace):
    start_worker(engine="hf", mode="dynamic", max_wait_ms=5)
    with Client(redis_url, namespace) as client:
        res = client.generate("JSON:", response_format=RESPONSE_FORMAT, max_new_tokens=120, temperature=1.0, seed=2,
                              logprobs=2)
        valid(res.text)
        assert res.finish_reason == "stop" and len(res.logprobs) == len(res.token_ids)
        assert all(len(ids) == 2 and lp <= 0 for lp, ids, _ in res.logprobs)
        stream = client.stream("Pick:", guided_choice=["alpha", "beta"], max_new_tokens=10, logprobs=0)
        deltas = list(stream)
        assert "".join(d.text for d in deltas) == stream.result.text in ("alpha", "beta")
        assert [e for d in deltas for e in d.logprobs] == stream.result.logprobs
        for bad in ({"guided_json": {"type": "foo"}}, {"guided_regex": "("}, {"logprobs": 21},
                    {"response_format": {"type": "json_schema"}}, {"guided_choice": ["a"], "guided_regex": "a"}):
            with pytest.raises(InvalidRequest):
                client.generate("x", max_new_tokens=2, **bad)
        # the worker checks too: a guide that slips past a client is answered invalid_request, once
        keys = Keys(namespace)
        payload = {"v": 5, "id": "badguide", "prompt": [5, 6], "max_new_tokens": 2, "reply_key": client.reply_key,
                   "guide": {"kind": "json_schema", "spec": '{"type": "foo"}'}}
        redis.Redis.from_url(redis_url).xadd(keys.stream(32), {"id": "badguide", "r": client.reply_key,
                                                                "p": msgpack.packb(payload)})
        with pytest.raises(JobFailed) as exc:
            client.result("badguide", timeout=30)
        assert exc.value.code == "invalid_request" and "foo" in str(exc.value)
        assert client.generate("still serving?", max_new_tokens=2).completion_tokens == 2
