"""The Batch API as a script from OpenAI's docs sees it (issue 31): a batch naming ``gpt-4o-mini`` completes
with ``errors`` that say why and how to fix it; ``usage`` and ``model`` are filled; ``expires_after`` on an
upload and ``output_expires_after`` on a batch set ``expires_at``, and the sweeper deletes what expired;
uploaded names never reach ``Content-Disposition`` as given; the runner logs a batch's start, finish,
cancel and expiry; ``--model-alias-any`` answers any model name."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import time

import httpx
import openai
import pytest
import redis.asyncio

from batchfleet.common.keys import Keys
from batchfleet.gateway.batches.expiry import sweep
from batchfleet.gateway.batches.store import BatchStore, FileStore
from tests.helpers.loops import silent_fleet
from tests.test_openai_batches import batch_line, chat, lines_of, wait_until

pytestmark = pytest.mark.integration


def sweep_at(redis_url: str, namespace: str, files_dir: str, now: float) -> int:
    async def run() -> int:
        r = redis.asyncio.Redis.from_url(redis_url)
        try:
            keys = Keys(namespace)
            return await sweep(FileStore(r, keys, files_dir, 1 << 20), BatchStore(r, keys), now)
        finally:
            await r.aclose()
    return asyncio.run(run())


def test_a_batch_naming_openai_models_reports_why_usage_model_and_expires(start_worker, start_gateway, redis_url,
                                                                          namespace, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="batchfleet.gateway")
    start_worker(max_wait_ms=5)
    files_dir = str(tmp_path / "files")
    gw = start_gateway(served_model_names=("tiny",), files_dir=files_dir)
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0, timeout=60)
    text = (batch_line("ok", chat("hello")) + batch_line("o1", chat("x", model="gpt-4o-mini"))
            + batch_line("o2", chat("y", model="gpt-4o-mini")))
    f = client.files.create(file=("../../etc/x", io.BytesIO(text.encode())), purpose="batch",
                            expires_after={"anchor": "created_at", "seconds": 3600})
    assert f.filename == "x" and f.expires_at == f.created_at + 3600
    with httpx.Client() as http:
        disposition = http.get(f"{gw.url}/v1/files/{f.id}/content").headers["content-disposition"]
    assert "etc" not in disposition and 'filename="x"' in disposition
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                                  extra_body={"output_expires_after": {"anchor": "created_at", "seconds": 7200}})
    done = wait_until(client, batch.id, ("completed", "failed"))
    assert done.status == "completed" and done.request_counts.failed == 2, done
    assert done.model == "tiny" and done.usage.input_tokens > 0 and done.usage.output_tokens > 0
    assert done.usage.total_tokens == done.usage.input_tokens + done.usage.output_tokens
    out = lines_of(client, done.output_file_id)
    assert done.usage.output_tokens == sum(o["response"]["body"]["usage"]["completion_tokens"] for o in out)
    (why,) = done.errors.data
    assert why.code == "model_not_found" and "2 request(s)" in why.message and "--served-model-name" in why.message
    output = client.files.retrieve(done.output_file_id)
    assert output.expires_at and output.expires_at - output.created_at == 7200
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith(f"batch {batch.id} started: 3 requests") for m in messages), messages
    assert any(m.startswith(f"batch {batch.id} completed: 1 of 3 requests completed, 2 failed; 2 request(s) "
                            "failed with model_not_found") for m in messages), messages
    assert sweep_at(redis_url, namespace, files_dir, time.time() + 100) == 0  # nothing is due yet
    assert sweep_at(redis_url, namespace, files_dir, time.time() + 8000) == 4  # input, output, errors, batch
    for gone in (lambda: client.files.retrieve(f.id), lambda: client.files.retrieve(done.output_file_id),
                 lambda: client.batches.retrieve(batch.id)):
        with pytest.raises(openai.NotFoundError):
            gone()
    with pytest.raises(openai.BadRequestError, match="expires_after"):
        client.files.create(file=("y.jsonl", io.BytesIO(text.encode())), purpose="batch",
                            expires_after={"anchor": "created_at", "seconds": 5})


def test_cancel_and_expiry_are_logged(start_gateway, redis_url, namespace, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="batchfleet.gateway")
    # a live "worker" that never reads: the batches run until cancelled or expired
    with silent_fleet(redis_url, namespace):
        gw = start_gateway(served_model_names=("tiny",), files_dir=str(tmp_path / "files"))
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0, timeout=60)
        line = batch_line("a", {"model": "tiny", "prompt": "x", "max_tokens": 2}, "/v1/completions")
        f = client.files.create(file=("b.jsonl", io.BytesIO(line.encode())), purpose="batch")
        cancelled = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
        expiring = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="3s")
        wait_until(client, cancelled.id, ("in_progress",))
        client.batches.cancel(cancelled.id)
        assert wait_until(client, cancelled.id, ("cancelled",)).status == "cancelled"
        assert wait_until(client, expiring.id, ("expired",)).status == "expired"
    messages = "\n".join(r.getMessage() for r in caplog.records)
    assert f"batch {cancelled.id}: cancel asked" in messages and f"batch {cancelled.id} cancelled: " in messages
    assert f"batch {expiring.id}: past its completion window" in messages and f"batch {expiring.id} expired: " \
        in messages


def test_the_gateway_alias_answers_any_model_name(start_worker, start_gateway, tmp_path):
    start_worker(max_wait_ms=5)
    strict = start_gateway(served_model_names=("tiny",), files_dir=str(tmp_path / "f1"))
    client = openai.OpenAI(base_url=strict.url + "/v1", api_key="none", max_retries=0, timeout=60)
    with pytest.raises(openai.NotFoundError, match="--model-alias-any"):
        client.chat.completions.create(**chat("hi", model="gpt-4o-mini"))
    alias = start_gateway(served_model_names=("tiny",), model_alias_any=True, files_dir=str(tmp_path / "f2"))
    client = openai.OpenAI(base_url=alias.url + "/v1", api_key="none", max_retries=0, timeout=60)
    answer = client.chat.completions.create(**chat("hi", model="gpt-4o-mini"))
    assert answer.model == "tiny" and json.loads(answer.model_dump_json())["choices"]
