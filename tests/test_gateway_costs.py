"""What a hostile body costs the gateway before its refusal, and embeddings' inputs submitted together
(issue 54, item 9). A body over ``--max-body-kb`` is a 413 before it is parsed or tokenized; a prompt that
fits the body limit but not the largest bucket is refused once a bounded prefix of it is tokenized (a
tokenizer wrapped to record what it is given: the check is structural, not a timing); a tool with a
200,000-entry enum likewise; an embeddings request's inputs go in one ``submit_many`` whose enqueues are
in flight together, never one round trip after another."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from batchfleet.producer.bounded_tokens import PREFIX_CHARS_PER_TOKEN, PREFIX_TAIL_CHARS
from tests.conftest import TEST_BUCKETS

pytestmark = pytest.mark.integration


class Recording:
    """A fleet's tokenizer that records the length of every text it is given."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.lengths: list[int] = []

    def encode(self, text: str, **kw: Any) -> Any:
        self.lengths.append(len(text))
        return self.inner.encode(text, **kw)

    def encode_batch(self, texts: list[str], **kw: Any) -> Any:
        self.lengths += [len(t) for t in texts]
        return self.inner.encode_batch(texts, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def recording(gw) -> Recording:
    fleet = gw.run(gw.gateway.client.fleet(30))
    fleet.tokenizer = Recording(fleet.tokenizer)  # kept while the fleet publishes the same tokenizer
    return fleet.tokenizer


def bound(largest: int) -> int:
    """The most characters a refused prompt's text may cost the tokenizer: its first prefix."""
    return (largest + 1) * PREFIX_CHARS_PER_TOKEN + PREFIX_TAIL_CHARS


def test_a_huge_body_is_refused_before_it_is_parsed_or_tokenized(start_worker, start_gateway):
    start_worker(max_wait_ms=5)
    gw = start_gateway(model_alias_any=True)
    tokenizer = recording(gw)
    huge = json.dumps({"model": "m", "prompt": "hello world " * 300_000})  # 3.6 MB
    with httpx.Client(base_url=gw.url, timeout=60) as http:
        for path, body in (("/v1/completions", huge), ("/v1/chat/completions", huge.replace(
                '"prompt": "hello', '"messages": [{"role": "user", "content": "hello').replace('"}', '"}]}'))):
            resp = http.post(path, content=body, headers={"content-type": "application/json"})
            assert resp.status_code == 413 and resp.json()["error"]["code"] == "body_too_large", resp.text
    assert tokenizer.lengths == []


def test_a_long_prompt_under_the_body_limit_is_refused_after_a_bounded_prefix(start_worker, start_gateway):
    start_worker(max_wait_ms=5)
    gw = start_gateway(max_body_kb=8192, model_alias_any=True)
    tokenizer = recording(gw)
    text = "hello world " * 300_000  # 3.6 MB: under the raised body limit, far over the largest bucket
    with httpx.Client(base_url=gw.url, timeout=60) as http:
        for path, body in (("/v1/completions", {"prompt": text}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}),
                           ("/v1/embeddings", {"input": [text]})):
            resp = http.post(path, json={"model": "m", **body})
            assert resp.status_code == 400 and resp.json()["error"]["code"] == "context_length_exceeded", resp.text
        ok = http.post("/v1/completions", json={"model": "m", "prompt": "hello", "max_tokens": 2})
        assert ok.status_code == 200, ok.text
    assert tokenizer.lengths and max(tokenizer.lengths) <= bound(TEST_BUCKETS[-1]) + 200  # + the template's text


def test_a_tool_with_a_200000_entry_enum_is_refused_after_a_bounded_prefix(tool_served):
    client, gw = tool_served
    tokenizer = recording(gw)
    enum = [f"v{i}" for i in range(200_000)]  # 2.0 MB of body: within the default limit
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "enum": enum}}}}}
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [tool]}
    with httpx.Client(base_url=gw.url, timeout=120) as http:
        resp = http.post("/v1/chat/completions", json=body)
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "context_length_exceeded", resp.text
        forced = http.post("/v1/chat/completions", json={**body, "tool_choice": "required"})
        assert forced.status_code == 400 and forced.json()["error"]["param"].startswith("tools"), forced.text
    assert max(tokenizer.lengths) <= bound(2048)  # tool_served's largest bucket


def test_embedding_inputs_are_submitted_together(start_worker, start_gateway):

    start_worker(max_wait_ms=5)
    gw = start_gateway(model_alias_any=True)
    client = gw.gateway.client
    submits, many = [], []
    in_flight, most = 0, 0
    enqueue, submit, submit_many = client.calls.enqueue, client.submit, client.submit_many

    async def counted_enqueue(*args: Any, **kw: Any) -> Any:
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        try:
            await asyncio.sleep(0)  # as any Redis call: the loop runs others meanwhile
            return await enqueue(*args, **kw)
        finally:
            in_flight -= 1

    async def counted_submit(*args: Any, **kw: Any) -> Any:
        submits.append(1)
        return await submit(*args, **kw)

    async def counted_many(prompts: Any, **kw: Any) -> Any:
        many.append(len(prompts))
        return await submit_many(prompts, **kw)

    client.calls.enqueue, client.submit, client.submit_many = counted_enqueue, counted_submit, counted_many
    with httpx.Client(base_url=gw.url, timeout=120) as http:
        resp = http.post("/v1/embeddings", json={"model": "m", "input": [[5]] * 256, "encoding_format": "float"})
        assert resp.status_code == 200, resp.text
        data = resp.json()["data"]
        assert [d["index"] for d in data] == list(range(256)) and len({len(d["embedding"]) for d in data}) == 1
        one = http.post("/v1/chat/completions", json={"model": "m", "n": 2, "max_tokens": 2, "seed": 1,
                                                     "messages": [{"role": "user", "content": "hi"}]})
        assert one.status_code == 200, one.text  # choices of other seeds: submitted one by one, as before
    assert many == [256] and len(submits) == 2 and most > 1, (many, len(submits), most)
