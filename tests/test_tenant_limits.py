"""Rate limits per tenant (issue 57), on a real Redis: the admit function's sliding minute, two gateways sharing
one limit (every refused request a 429 with OpenAI's headers, read by the openai client; none enqueued then
dropped), the Python client's typed error, ``batchfleet bulk`` waiting under a limit, and an API key that never
reaches Redis or the metrics (only its tenant's label does)."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import redis

from batchfleet.common import tenants as tenant_settings
from batchfleet.common.errors import RateLimited
from batchfleet.common.keys import Keys
from batchfleet.common.redis.functions import ADMIT
from batchfleet.common.tenants import Tenant, write_tenants
from batchfleet.producer import Client
from batchfleet.producer.bulk.file_run import bulk_file

HEADERS = ("x-ratelimit-limit-requests", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests")


def admit(r, keys: Keys, tenant: str, limits: tuple[int, int, int], tokens: int, window_ms: int = 60_000) -> list:
    window = keys.limit_window(tenant)
    return r.eval(ADMIT, 3, window, f"{window}:tokens", keys.usage("2000-01-01"), *limits, tenant, "job", tokens,
                  window_ms)


def test_the_admit_function_keeps_a_sliding_minute_per_tenant(redis_url: str, namespace: str):
    r, keys = redis.Redis.from_url(redis_url), Keys(namespace)
    answers = [admit(r, keys, "a", (3, 0, 0), 10) for _ in range(4)]
    assert [a[0] for a in answers] == [1, 1, 1, 0] and [a[3] for a in answers] == [1, 2, 3, 3]
    refused = answers[-1]
    assert refused[1] == 1 and 0 < refused[2] <= 60_000 and refused[5] == refused[2]  # wait = reset of requests
    # tokens per minute: 60 fit, 50 more do not (and are not counted)
    assert admit(r, keys, "b", (0, 100, 0), 60)[:2] == [1, 0]
    no = admit(r, keys, "b", (0, 100, 0), 50)
    assert no[:2] == [0, 2] and no[4] == 60 and 0 < no[6] <= 60_000
    # a day's quota: the workers' count of the day (80) + this request's estimate (30) > 100
    r.hset(keys.usage("2000-01-01"), mapping={"c|prompt_tokens": 50, "c|generated_tokens": 30})
    assert admit(r, keys, "c", (0, 0, 100), 30)[:2] == [0, 3] and admit(r, keys, "c", (0, 0, 100), 20)[0] == 1
    # the window slides: a short one admits again once its oldest entry left it
    assert admit(r, keys, "d", (1, 0, 0), 1, 300)[0] == 1
    deadline = time.monotonic() + 30
    while admit(r, keys, "d", (1, 0, 0), 1, 300)[0] != 1:
        assert time.monotonic() < deadline, "the window never slid"
        time.sleep(0.05)


def test_two_gateways_share_a_tenants_requests_per_minute(start_worker, start_gateway, redis_url: str,
                                                          namespace: str):
    limit, sent = 20, 40
    key = "sk-tenant-acme-0123456789abcdef"
    with redis.Redis.from_url(redis_url) as r:
        write_tenants(r, Keys(namespace), [Tenant("acme", requests_per_minute=limit)])
    start_worker()
    gws = [start_gateway(tenant_keys=f"acme:{key}", model_alias_any=True) for _ in range(2)]
    clients = [openai.OpenAI(base_url=g.url + "/v1", api_key=key, max_retries=0, timeout=120) for g in gws]

    def one(i: int):
        try:
            raw = clients[i % 2].completions.with_raw_response.create(model="x", prompt=f"hello {i}", max_tokens=1)
        except openai.RateLimitError as exc:
            return 429, exc.response.headers, exc.body
        return raw.http_response.status_code, raw.headers, raw.parse()

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(one, range(sent)))
    ok = [a for a in answers if a[0] == 200]
    refused = [a for a in answers if a[0] == 429]
    assert len(ok) == limit and len(refused) == sent - limit, [a[0] for a in answers]
    for _, headers, body in refused:
        assert all(h in headers for h in HEADERS) and headers["x-ratelimit-remaining-requests"] == "0"
        assert int(headers["retry-after"]) >= 1 and body["code"] == "rate_limit_exceeded"
    for _, headers, completion in ok:  # answered, with the headers of a successful answer
        assert headers["x-ratelimit-limit-requests"] == str(limit) and completion.choices[0].finish_reason
    with redis.Redis.from_url(redis_url) as r:
        keys = Keys(namespace)
        assert r.zcard(keys.limit_window("acme")) == limit  # admitted = answered: none enqueued then dropped
        # the label travels, the key never: not in a key name, nor in any value of the namespace, nor in metrics
        for name in r.scan_iter(f"{namespace}:*"):
            assert key.encode() not in name and key.encode() not in (r.dump(name) or b""), name
    metrics = httpx.get(gws[0].url + "/metrics", headers={"Authorization": f"Bearer {key}"}).text
    assert key not in metrics
    assert 'batchfleet_rate_limited_requests_total{limit="requests_per_minute",tenant="acme"}' in metrics
    assert 'batchfleet_fleet_tenant_limit{limit="requests_per_minute",tenant="acme"} 20.0' in metrics


def test_the_client_raises_rate_limited_and_bulk_waits_it_out(start_worker, redis_url: str, namespace: str,
                                                             tmp_path, monkeypatch):
    keys = Keys(namespace)
    with redis.Redis.from_url(redis_url) as r:
        write_tenants(r, keys, [Tenant("acme", requests_per_minute=2), Tenant("bulk", requests_per_minute=2)])
    start_worker()
    client = Client(redis_url, namespace, tenant="acme")
    try:
        for _ in range(2):
            client.generate("hi", max_new_tokens=1, timeout=120)
        with pytest.raises(RateLimited) as err:
            client.generate("hi", max_new_tokens=1, timeout=120)
        assert err.value.limit == "requests_per_minute" and 0 < err.value.retry_after_s <= 60
        assert err.value.window.remaining_requests == 0 and "try again in" in str(err.value)
        assert client.generate("hi", max_new_tokens=1, timeout=120, tenant="beta").text is not None  # unlimited
    finally:
        client.close()
    # bulk under 2 requests per (shortened) 2 s window: waits, never fails a line
    monkeypatch.setattr(tenant_settings, "WINDOW_MS", 2000)
    prompts = tmp_path / "in.jsonl"
    prompts.write_text("".join(f'{{"prompt": "line {i}", "max_new_tokens": 1}}\n' for i in range(5)))
    started = time.monotonic()
    summary = asyncio.run(bulk_file(str(prompts), str(tmp_path / "out.jsonl"), redis_url=redis_url,
                                    namespace=namespace, timeout=120, tenant="bulk"))
    assert summary.done == 5 and summary.failed_lines == 0
    assert time.monotonic() - started >= 3.5  # 5 admissions at 2 per 2 s need two more windows at least


def test_a_batch_runs_on_its_keys_tenant(start_worker, start_gateway, redis_url: str, namespace: str, tmp_path):
    """The lines of a batch count against the limits of the key that created it (a line over one waits: the bulk
    runner's, tested above), in the same window as the key's own requests."""
    from tests.helpers.batches import run_batch

    key = "sk-tenant-batch-0123456789abcdef"
    keys = Keys(namespace)
    with redis.Redis.from_url(redis_url) as r:
        write_tenants(r, keys, [Tenant("nightly", requests_per_minute=5)])
    start_worker()
    gw = start_gateway(tenant_keys=f"nightly:{key}", model_alias_any=True, files_dir=str(tmp_path / "files"))
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=120)
    batch = run_batch(client, "/v1/completions", {f"l{i}": {"model": "x", "prompt": f"hi {i}", "max_tokens": 1}
                                                  for i in range(5)})
    assert batch.status == "completed" and batch.request_counts.completed == 5 and batch.request_counts.failed == 0
    with redis.Redis.from_url(redis_url) as r:
        assert r.zcard(keys.limit_window("nightly")) == 5
    with pytest.raises(openai.RateLimitError):  # the batch used the key's minute
        client.completions.create(model="x", prompt="one more", max_tokens=1)
