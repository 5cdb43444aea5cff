"""What the engine did, reported (issue 30 item 3): a prompt whose prefix the native engine's cache holds
comes back with ``usage.prompt_tokens_details.cached_tokens`` > 0 on completions, chat, streamed usage
chunks and the Batch API's output lines, and the worker's metrics count cached prompt tokens and
preemptions per priority."""

from __future__ import annotations

import asyncio
import io
import json

import httpx
import openai
import pytest

from batchfleet.common.wire.protocol import Result
from batchfleet.gateway.openai.chat.format import Shape, usage
from batchfleet.worker.devtools import free_port
from tests.helpers.gateway import stream_events
from tests.test_metrics import one, scrape
from tests.test_openai_batches import batch_line, lines_of, wait_until

# long enough for several KV blocks; every request below shares it
SHARED = "You are a careful assistant. Answer in one short sentence, plainly and without lists. " * 2


def result(prompt_tokens: int, **extra: int) -> Result:
    return Result(id="j", token_ids=[1], text="x", finish_reason="length", prompt_tokens=prompt_tokens,
                  completion_tokens=1, queue_ms=0, ttft_ms=0, total_ms=0, worker="w", batch_size=1, extra=extra)


@pytest.mark.unit
def test_usage_carries_cached_tokens_and_the_fleet_view_preemptions():
    assert usage([result(40, cached_tokens=32)])["prompt_tokens_details"] == {"cached_tokens": 32}
    assert usage([result(40)])["prompt_tokens_details"] == {"cached_tokens": 0}  # an older worker: none known
    assert usage([result(40, cached_tokens=16), result(40, cached_tokens=32)])["prompt_tokens_details"] == {
        "cached_tokens": 16}  # the prompt is counted once: the first choice's
    shape = Shape(chat=True, job_id="j", model="m", created=0, include_usage=True)
    whole = shape.response([result(40, cached_tokens=32, preemptions=2)])
    assert whole["usage"]["prompt_tokens_details"]["cached_tokens"] == 32 and whole["batchfleet"]["preemptions"] == 2
    assert shape.usage_chunk([result(40, cached_tokens=32)])["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}


def test_cached_tokens_on_every_surface_and_per_priority_metrics(start_worker, start_gateway, tmp_path):
    port = free_port()
    w = start_worker(engine="native", mode="continuous", max_wait_ms=5, kv_cache_gb=0.02, metrics_port=port)
    gw = start_gateway(files_dir=str(tmp_path / "files"), served_model_names=("m",))
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0, timeout=60)
    first = client.completions.create(prompt=SHARED + "Q1", max_tokens=2, temperature=0, model="m")
    again = client.completions.create(prompt=SHARED + "Q2", max_tokens=2, temperature=0, model="m")
    assert again.usage.prompt_tokens == first.usage.prompt_tokens
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < again.usage.prompt_tokens, again.usage  # the shared blocks, not the question's
    assert again.model_extra["batchfleet"]["preemptions"] == 0

    messages = [{"role": "system", "content": SHARED}, {"role": "user", "content": "Hello"}]
    client.chat.completions.create(messages=messages, max_tokens=2, temperature=0, model="m")
    chat = client.chat.completions.create(messages=messages, max_tokens=2, temperature=0, model="m")
    assert 0 < chat.usage.prompt_tokens_details.cached_tokens <= chat.usage.prompt_tokens
    chunks = list(client.chat.completions.create(messages=messages, max_tokens=2, temperature=0, model="m",
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == chat.usage.prompt_tokens_details.cached_tokens

    async def streamed_completion() -> list:
        async with httpx.AsyncClient(base_url=gw.url, timeout=60) as http:
            return await stream_events(http, "/v1/completions", {"prompt": SHARED + "Q3", "max_tokens": 2,
                                                                 "stream_options": {"include_usage": True}})

    events = asyncio.run(streamed_completion())
    assert events[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] == cached, events[-2]

    # the Batch API's output lines (background priority): the same completion objects
    text = "".join(batch_line(f"r{i}", {"model": "m", "messages": messages, "max_tokens": 2, "temperature": 0})
                   for i in range(3))
    uploaded = client.files.create(file=("b.jsonl", io.BytesIO(text.encode())), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    done = wait_until(client, batch.id, ("completed", "failed"))
    lines = lines_of(client, done.output_file_id)
    assert len(lines) == 3 and all(ln["response"]["status_code"] == 200 for ln in lines), lines
    for ln in lines:
        body = ln["response"]["body"]
        assert 0 < body["usage"]["prompt_tokens_details"]["cached_tokens"] <= body["usage"]["prompt_tokens"], body

    m = scrape(port)
    interactive, batched = (one(m, "batchfleet_prompt_tokens_cached_total", priority=p, **{"class": c})
                            for p, c in (("interactive", "interactive"), ("background", "batch")))
    assert interactive >= cached * 2 and batched > 0, (interactive, batched)
    assert interactive + batched == sum(w.loop.ledger.cached_tokens.values())
    assert {(dict(k)["priority"], dict(k)["class"]) for k in m["batchfleet_request_preemptions_total"]} == {
        ("interactive", "interactive"), ("background", "batch")}  # "class": the deprecated label, one release
    assert json.dumps(w.loop.ledger.preemptions)  # plain counts (none expected in this light load)
