"""The Responses API (/v1/responses) end to end: the official ``openai`` client (plain, streamed, chained by
previous_response_id, retrieve, delete, structured output, refusals) and LangChain's ``use_responses_api``,
over a real Redis and a real native worker. A response is the chat completion of the same conversation."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.helpers.batches import bodies_of, run_batch
from tests.helpers.gateway import gateways

KEYS = ("sk-resp-key-one-0001", "sk-resp-key-two-0002")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}},
          "required": ["name"], "additionalProperties": False}
STREAM_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
                 "response.content_part.added"]
CLOSING_EVENTS = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


@pytest.fixture
def fleet(start_worker, redis_url, namespace):
    """A continuous-mode native worker and a gateway with two API keys: (openai client, model, gateway)."""
    start_worker(engine="native", mode="continuous", max_wait_ms=5, kv_cache_gb=0.02)
    with gateways(redis_url, namespace) as start:
        gw = start(api_keys=KEYS)
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key=KEYS[0], max_retries=0, timeout=120)
        yield client, client.models.list().data[0].id, gw


def chat_text(client: openai.OpenAI, model: str, messages: list[dict], max_tokens: int) -> str:
    out = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0)
    return out.choices[0].message.content


def test_create_stream_chain_retrieve_delete(fleet):
    client, model, gw = fleet
    first = client.responses.create(model=model, input="Hello there", instructions="Be brief.",
                                    max_output_tokens=12, temperature=0, metadata={"run": "t1"})
    assert first.object == "response" and first.id.startswith("resp_") and first.status in ("completed", "incomplete")
    (message,) = first.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    assert first.output_text == message.content[0].text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    assert first.output_text == chat_text(client, model, messages, 12)  # the chat route's answer
    usage = first.usage
    assert usage.input_tokens > 0 and 0 < usage.output_tokens <= 12
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens >= 0 and first.metadata == {"run": "t1"}
    assert first.instructions == "Be brief." and first.max_output_tokens == 12 and first.store is True
    if first.status == "incomplete":
        assert first.incomplete_details.reason == "max_output_tokens" and usage.output_tokens == 12

    # streamed: OpenAI's event sequence, numbered; the deltas are the whole answer
    events = list(client.responses.create(model=model, input="Hello there", instructions="Be brief.",
                                          max_output_tokens=12, temperature=0, stream=True))
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert kinds == STREAM_EVENTS + ["response.output_text.delta"] * len(deltas) + CLOSING_EVENTS + [
        "response.incomplete" if first.status == "incomplete" else "response.completed"], kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    done = events[-1].response
    assert "".join(deltas) == first.output_text == done.output_text == events[-4].text
    assert done.usage.output_tokens == usage.output_tokens and done.id != first.id

    # chained: the stored conversation, then the new turn (instructions are not carried over)
    second = client.responses.create(model=model, input="And then?", previous_response_id=first.id,
                                     max_output_tokens=8, temperature=0)
    assert second.previous_response_id == first.id
    history = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "And then?"}]
    assert second.output_text == chat_text(client, model, history, 8)
    assert second.usage.input_tokens > usage.input_tokens
    # its input items: the whole conversation it was asked, newest first (instructions are no item)
    items = client.responses.input_items.list(second.id)
    assert [(i.role, i.content[0].text) for i in items.data] == [(m["role"], m["content"]) for m in history[::-1]]
    assert items.data[1].content[0].type == "output_text" and items.data[0].content[0].type == "input_text"
    page = client.responses.input_items.list(second.id, order="asc", limit=2)
    assert [i.content[0].text for i in page.data] == ["Hello there", first.output_text] and page.has_more
    rest = client.responses.input_items.list(second.id, order="asc", after=page.data[-1].id)
    assert [i.content[0].text for i in rest.data] == ["And then?"] and not rest.has_more
    streamed_chain = list(client.responses.create(model=model, input="And then?", previous_response_id=done.id,
                                                  max_output_tokens=8, temperature=0, stream=True))
    assert streamed_chain[-1].response.output_text == second.output_text  # the streamed one was stored too

    # retrieve, per API key; delete; store: false is never stored
    again = client.responses.retrieve(first.id)
    assert again.model_dump() == first.model_dump()
    other = openai.OpenAI(base_url=gw.url + "/v1", api_key=KEYS[1], max_retries=0, timeout=60)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as info:
        other.responses.create(model=model, input="x", previous_response_id=first.id, max_output_tokens=2)
    assert info.value.body["param"] == "previous_response_id"
    client.responses.delete(first.id)
    for call in (lambda: client.responses.retrieve(first.id), lambda: client.responses.delete(first.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    unstored = client.responses.create(model=model, input="Hi", max_output_tokens=2, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_structured_output_and_refusals(fleet):
    client, model, gw = fleet
    fmt = {"type": "json_schema", "name": "person", "schema": SCHEMA, "strict": True}
    for stream in (False, True):
        out = client.responses.create(model=model, input=[{"role": "user", "content": [
            {"type": "input_text", "text": "Name someone as JSON."}]}], text={"format": fmt}, max_output_tokens=40,
            stream=stream)
        text = list(out)[-1].response.output_text if stream else out.output_text
        jsonschema.validate(json.loads(text), SCHEMA)
    refused = [({"tools": [{"type": "web_search"}]}, "tools.0.type"),  # function tools: tests/test_responses_tools.py
               ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type"),
               ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
                "input.0.content.0.type"),
               ({"max_output_tokens": 600}, "max_output_tokens"), ({"temperature": "1"}, "temperature"),
               ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 3}}}}, "text.format"),
               ({"truncation": "auto"}, "truncation"), ({"frobnicate": 1}, "frobnicate"), ({"input": ""}, "input")]
    with httpx.Client(base_url=gw.url, timeout=60, headers={"authorization": f"Bearer {KEYS[0]}"}) as http:
        for extra, param in refused:
            resp = http.post("/v1/responses", json={"model": model, "input": "hi", **extra})
            assert resp.status_code == 400, (extra, resp.text)
            assert resp.json()["error"]["param"] == param, (extra, resp.json())
        assert http.get("/v1/responses/resp_nope").status_code == 404
        assert http.get("/v1/responses/../../x").status_code == 404


def test_langchain_use_responses_api(fleet):
    from langchain_openai import ChatOpenAI

    client, model, gw = fleet
    llm = ChatOpenAI(model=model, base_url=gw.url + "/v1", api_key=KEYS[0], use_responses_api=True,
                     temperature=0, max_tokens=10, max_retries=0)
    messages = [("system", "Be brief."), ("human", "Hello there")]
    answer = llm.invoke(messages)
    expected = chat_text(client, model, [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "Hello there"}], 10)
    assert answer.text == expected and answer.usage_metadata["output_tokens"] > 0
    assert "".join(chunk.text for chunk in llm.stream(messages)) == expected
    # a conversation holding the model's earlier answer (sent back as an output message item)
    follow = llm.invoke([*messages, answer, ("human", "And then?")])
    assert isinstance(follow.text, str)


def test_batch_of_responses_lines(start_worker, start_gateway, tmp_path):
    start_worker(max_wait_ms=5)
    gw = start_gateway(api_keys=KEYS, files_dir=str(tmp_path / "files"))
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=KEYS[0], max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    bodies = {f"r{i}": {"model": model, "input": f"question {i}", "max_output_tokens": 4, "temperature": 0}
              for i in range(3)}
    bodies["chained"] = {**bodies["r0"], "previous_response_id": "resp_x"}
    batch = run_batch(client, "/v1/responses", bodies)
    assert batch.status == "completed" and batch.request_counts.completed == 3, batch
    out = bodies_of(client, batch.output_file_id)
    (error,) = bodies_of(client, batch.error_file_id).items()
    assert error[0] == "chained" and error[1]["error"]["param"] == "previous_response_id"
    assert batch.usage.output_tokens == sum(b["usage"]["output_tokens"] for b in out.values()) > 0
    for key, body in out.items():
        assert body["object"] == "response" and body["store"] is False
        direct = client.responses.create(**bodies[key], store=False)
        assert body["output"][0]["content"][0]["text"] == direct.output_text
