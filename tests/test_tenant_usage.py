"""The operator's view of tenants (issue 57): ``batchfleet tenants`` and ``batchfleet usage`` on a real Redis, and
the dashboard's table per tenant in headless Chromium. The usage counts are written as the workers write them
(``Keys.usage``: ``<tenant>|<what>``)."""

from __future__ import annotations

import json

import redis
from click.testing import CliRunner

from batchfleet.common.cli import main
from batchfleet.common.config import ConnectionConfig, DashboardConfig
from batchfleet.common.keys import Keys
from batchfleet.common.tenants import utc_day
from batchfleet.producer.ops.dashboard import DashboardServer
from tests.helpers.browser import Dom, chromium, needs_chromium

USAGE = {"acme|requests": 3, "acme|prompt_tokens": 30, "acme|cached_tokens": 8, "acme|generated_tokens": 60,
         "|requests": 1, "|generated_tokens": 20}


def cli(redis_url: str, namespace: str, *args: str) -> str:
    res = CliRunner().invoke(main, ["--redis-url", redis_url, "--namespace", namespace, *args])
    assert res.exit_code == 0, res.output
    return res.output


def test_tenants_and_usage_commands(redis_url: str, namespace: str, tmp_path):
    keys = Keys(namespace)
    path = tmp_path / "tenants.yaml"
    path.write_text("acme: {weight: 3, requests_per_minute: 60}\nbeta: {tokens_per_day: 1000}\n")
    assert "applied 2 tenant(s)" in cli(redis_url, namespace, "tenants", "apply", str(path))
    cli(redis_url, namespace, "tenants", "set", "beta", "--weight", "2", "--tokens-per-day", "0")
    assert json.loads(cli(redis_url, namespace, "tenants", "list", "--json")) == {
        "acme": {"weight": 3.0, "requests_per_minute": 60}, "beta": {"weight": 2.0}}
    bad = CliRunner().invoke(main, ["--redis-url", redis_url, "--namespace", namespace, "tenants", "set", "Bad"])
    assert bad.exit_code == 2 and "tenant label must be" in bad.output
    huge = CliRunner().invoke(main, ["--redis-url", redis_url, "--namespace", namespace, "tenants", "set", "beta",
                                     "--requests-per-minute", str(2**64)])
    assert huge.exit_code == 2 and "requests_per_minute must be a whole number in [1, " in huge.output
    with redis.Redis.from_url(redis_url) as r:  # hand-written entries that do not decode: shown, never hidden
        r.hset(keys.tenants, mapping={"broken": "{not json", b"\xff": "{}"})
    listed = CliRunner().invoke(main, ["--redis-url", redis_url, "--namespace", namespace, "tenants", "list"])
    assert listed.exit_code == 0 and "tenant 'broken': stored settings do not decode" in listed.output
    fix = CliRunner().invoke(main, ["--redis-url", redis_url, "--namespace", namespace, "tenants", "set", "broken"])
    assert fix.exit_code == 2 and "`batchfleet tenants remove broken`" in fix.output
    cli(redis_url, namespace, "tenants", "remove", "broken")
    with redis.Redis.from_url(redis_url) as r:
        r.hset(keys.usage(), mapping=USAGE)
        r.hset(keys.usage(utc_day()), mapping={"acme|prompt_tokens": 10, "acme|generated_tokens": 20})
    table = cli(redis_url, namespace, "usage").splitlines()
    assert table[0].split() == ["tenant", "requests", "prompt", "cached", "generated", "share", "today", "weight",
                                "rpm", "tpm", "tpd"]
    assert table[2].split() == ["acme", "3", "30", "8", "60", "75.0%", "30", "3", "60", "-", "-"]
    rows = {r["tenant"]: r for r in json.loads(cli(redis_url, namespace, "usage", "--json"))}
    assert set(rows) == {"default", "acme", "beta"} and rows["default"]["share"] == 0.25
    assert "removed 1 of 1" in cli(redis_url, namespace, "tenants", "remove", "beta")


@needs_chromium
def test_chromium_shows_a_table_per_tenant(redis_url: str, namespace: str):
    keys = Keys(namespace)
    with redis.Redis.from_url(redis_url) as r:
        cli(redis_url, namespace, "tenants", "set", "acme", "--weight", "3", "--requests-per-minute", "60")
        r.hset(keys.usage(), mapping=USAGE)
    server = DashboardServer(DashboardConfig(port=0), ConnectionConfig(redis_url, namespace)).start()
    try:
        dom = Dom(chromium(f"http://127.0.0.1:{server.port}/dashboard?refresh=1"))
    finally:
        server.close()
    rows = {row["data-tenant"]: row["cells"] for row in dom.rows if "data-tenant" in row}
    assert set(rows) == {"default", "acme"}
    acme = rows["acme"]
    assert acme[0] == "acme" and acme[1] == "3" and "75%" in acme[2] and acme[9] == "0 / 60"
