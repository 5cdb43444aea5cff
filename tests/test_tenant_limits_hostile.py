"""Hostile input against tenants' limits (issue 57) on a real Redis, gateway and worker: every endpoint that
enqueues answers a tenant over its limit with OpenAI's 429 before anything is queued (a stream too: a 429, not an
event stream), with well-formed ``x-ratelimit-*`` and ``Retry-After`` headers, read by the official client; each
of ``n`` choices counts, however they are sent; the metrics keep a bounded tenant label set whatever clients name,
answer through a queued-tenants set holding garbage and through a Redis outage, and show no secret."""

from __future__ import annotations

import asyncio
import logging
import re
import time

import httpx
import openai
import pytest
import redis

from batchfleet.common.keys import Keys
from batchfleet.common.tenants import Tenant, usage_rows, write_tenants
from batchfleet.producer import AsyncClient, limits

DURATION = re.compile(r"^(\d+ms|\d+(\.\d+)?s|(\d+h)?\d+m\d+s)$")  # OpenAI's reset format: 20ms, 1.5s, 6m0s, 1h2m3s
ENDPOINTS = ("chat", "chat-stream", "completions", "completions-stream", "responses", "responses-stream",
             "embeddings")


def key_of(label: str) -> str:
    return f"sk-{label}-0123456789abcdef"


def call(client: openai.OpenAI, endpoint: str) -> httpx.Response:
    """One request of ``endpoint`` (a stream read to its end); its HTTP response."""
    if endpoint.startswith("chat"):
        made = client.chat.completions.with_raw_response.create(
            model="x", messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=endpoint.endswith("stream"))
    elif endpoint.startswith("completions"):
        made = client.completions.with_raw_response.create(model="x", prompt="hi", max_tokens=2,
                                                           stream=endpoint.endswith("stream"))
    elif endpoint.startswith("responses"):
        made = client.responses.with_raw_response.create(model="x", input="hi", max_output_tokens=2,
                                                         stream=endpoint.endswith("stream"))
    else:
        made = client.embeddings.with_raw_response.create(model="x", input=["hi", "there"])
    parsed = made.parse()
    if endpoint.endswith("stream"):
        list(parsed)
    return made.http_response


def test_every_enqueuing_endpoint_refuses_a_tenant_over_its_limit_before_queueing(
        start_worker, start_gateway, redis_url: str, namespace: str):
    keys = Keys(namespace)
    with redis.Redis.from_url(redis_url) as r:
        write_tenants(r, keys, [Tenant(e, requests_per_minute=1) for e in ENDPOINTS]
                      + [Tenant("tokens", tokens_per_minute=40)])
    start_worker(max_wait_ms=5)
    gw = start_gateway(tenant_keys=",".join(f"{e}:{key_of(e)}" for e in (*ENDPOINTS, "tokens")),
                       model_alias_any=True)
    for endpoint in ENDPOINTS:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key_of(endpoint), max_retries=0, timeout=60)
        ok = call(client, endpoint)
        assert ok.status_code == 200, endpoint
        assert ok.headers["x-ratelimit-limit-requests"] == "1" and ok.headers["x-ratelimit-remaining-requests"] == "0"
        assert DURATION.match(ok.headers["x-ratelimit-reset-requests"]), ok.headers
        with pytest.raises(openai.RateLimitError) as err:
            call(client, endpoint)
        refused = err.value.response
        assert refused.headers["content-type"].startswith("application/json"), endpoint  # no event stream
        assert re.fullmatch(r"[1-9]\d*", refused.headers["retry-after"]) and int(refused.headers["retry-after"]) <= 60
        assert refused.headers["x-ratelimit-remaining-requests"] == "0", endpoint
        assert DURATION.match(refused.headers["x-ratelimit-reset-requests"]), refused.headers
        assert err.value.body["type"] == "requests" and err.value.code == "rate_limit_exceeded", err.value.body
        assert key_of(endpoint) not in refused.text
    # tokens: 2 prompt + 16 max_tokens fit twice in 40, not thrice; the 429 says so in the token headers
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key_of("tokens"), max_retries=0, timeout=60)
    for _ in range(2):
        client.completions.create(model="x", prompt="hi", max_tokens=16)
    with pytest.raises(openai.RateLimitError) as err:
        client.completions.create(model="x", prompt="hi", max_tokens=16)
    headers = err.value.response.headers
    assert err.value.body["type"] == "tokens" and int(headers["x-ratelimit-limit-tokens"]) == 40
    assert DURATION.match(headers["x-ratelimit-reset-tokens"]) and int(headers["retry-after"]) >= 1
    with pytest.raises(openai.BadRequestError, match="request too large"):  # never fits: a 400, not a 429
        client.completions.create(model="x", prompt="hi", max_tokens=64)
    # each tenant's one admitted request ran (an embeddings request: one job per input), the refused ones never
    # reached a worker (the workers count what they finish, maybe just after the answer: wait, then a little more)
    with redis.Redis.from_url(redis_url) as r:
        deadline = time.monotonic() + 10
        while sum(usage_rows(r.hgetall(keys.usage())).get(e, {}).get("requests", 0) for e in ENDPOINTS) < 8:
            assert time.monotonic() < deadline, usage_rows(r.hgetall(keys.usage()))
            time.sleep(0.1)
        time.sleep(0.5)
        usage = usage_rows(r.hgetall(keys.usage()))
        assert {e: usage[e]["requests"] for e in ENDPOINTS} == {**dict.fromkeys(ENDPOINTS, 1), "embeddings": 2}
        assert usage["tokens"]["requests"] == 2
        # clients naming many tenants of their own, a queued-tenants set holding what is no label (a producer
        # calling the enqueue function by hand), a tenants hash too: the scrape answers, its tenant labels stay
        # the configured ones, default and other, and the worker still reads its streams
        r.sadd(keys.queued_tenants, "Bad Label!", b"\xff")
        r.hset(keys.tenants, b"\xff", "{}")  # an operator's hand-written HSET: no label, not even UTF-8

    async def visitors() -> None:
        async with AsyncClient(redis_url, namespace) as client:
            await asyncio.gather(*(client.generate("hi", max_new_tokens=1, timeout=60, tenant=f"visitor-{i}")
                                   for i in range(4)))

    asyncio.run(visitors())
    scraped = httpx.get(gw.url + "/metrics", headers={"Authorization": f"Bearer {key_of('chat')}"}, timeout=30)
    assert scraped.status_code == 200 and 'batchfleet_demand_requests{priority="interactive"}' in scraped.text
    shown = set(re.findall(r'tenant="([^"]*)"', scraped.text))
    assert "other" in shown and shown <= {*ENDPOINTS, "tokens", "default", "other"}, shown


def test_each_choice_counts_as_a_request_streamed_or_not_seeded_or_not(start_worker, start_gateway, redis_url: str,
                                                                       namespace: str, monkeypatch):
    keys = Keys(namespace)
    kinds = ("plain", "seeded", "stream")
    with redis.Redis.from_url(redis_url) as r:
        write_tenants(r, keys, [Tenant(k, requests_per_minute=4) for k in kinds])
    start_worker(max_wait_ms=5)
    gw = start_gateway(tenant_keys=",".join(f"{k}:{key_of(k)}" for k in kinds), model_alias_any=True)
    counted = {}
    for kind in kinds:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key_of(kind), max_retries=0, timeout=60)
        extra = {"seed": 7} if kind == "seeded" else {}
        made = client.completions.with_raw_response.create(model="x", prompt="hi", max_tokens=2, n=3,
                                                           stream=kind == "stream", **extra)
        if kind == "stream":
            list(made.parse())
        with redis.Redis.from_url(redis_url) as r:
            counted[kind] = (r.zcard(keys.limit_window(kind)), made.headers["x-ratelimit-remaining-requests"])
    assert counted == dict.fromkeys(kinds, (3, "1")), counted
    # its limit removed, a tenant's answers carry no x-ratelimit-* headers (not the last ones it had)
    monkeypatch.setattr(limits, "SETTINGS_TRUST_S", 0.0)
    with redis.Redis.from_url(redis_url) as r:
        write_tenants(r, keys, [Tenant("plain")])
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key_of("plain"), max_retries=0, timeout=60)
    made = client.completions.with_raw_response.create(model="x", prompt="hi", max_tokens=2)
    assert not [h for h in made.headers if h.startswith("x-ratelimit")], made.headers


def test_a_scrape_through_a_redis_outage_answers_and_shows_no_secret(caplog):
    """Redis (with a password) gone: /metrics still answers (without the fleet's gauges), the dashboard's data is a
    503; neither the password nor a tenant's key is in an answer or a log line (debug ones included)."""
    from batchfleet.worker.devtools import PrivateRedis, free_port
    from tests.helpers.gateway import GatewayThread

    caplog.set_level(logging.DEBUG)
    password, key = "redis-password-0123456789", key_of("acme")
    server = PrivateRedis(port=free_port()).start()
    gw = None
    try:
        with redis.Redis(port=server.port) as r:
            r.config_set("requirepass", password)
        url = f"redis://:{password}@127.0.0.1:{server.port}/0"
        with redis.Redis.from_url(url) as r:
            write_tenants(r, Keys("outage"), [Tenant("acme", requests_per_minute=5)])
        gw = GatewayThread(url, "outage", tenant_keys=f"acme:{key}", model_alias_any=True)
        auth = {"Authorization": f"Bearer {key}"}
        assert "batchfleet_demand_requests" in httpx.get(gw.url + "/metrics", headers=auth, timeout=30).text
        server.kill()
        scraped = httpx.get(gw.url + "/metrics", headers=auth, timeout=30)
        assert scraped.status_code == 200 and "batchfleet_demand_requests{" not in scraped.text
        dashboard = httpx.get(gw.url + "/dashboard/data", headers=auth, timeout=30)
        assert dashboard.status_code == 503
        for text in (scraped.text, dashboard.text, caplog.text):
            assert password not in text and key not in text
    finally:
        if gw is not None:
            gw.stop()
        server.stop()
