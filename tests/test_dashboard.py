"""The live dashboard: its data read from a real fleet (a real worker answering real requests, a dead
letter), the key check on the gateway and on `batchfleet dashboard`, and the page itself loaded in a real
headless Chromium (Debian's `chromium`) against that fleet: what it shows is checked in the rendered DOM."""

from __future__ import annotations

import re

import httpx
import pytest
import redis

from batchfleet.common.config import ConnectionConfig, DashboardConfig
from batchfleet.common.keys import Keys
from batchfleet.common.redis.fleetstate import worker_stats
from batchfleet.producer import Client
from batchfleet.producer.ops.dashboard import DashboardServer, dashboard_data
from batchfleet.producer.ops.status import prefix_cache_hit_rate
from tests.conftest import TEST_BUCKETS
from tests.helpers.browser import Dom, chromium, needs_chromium
from tests.helpers.loops import wait_until

KEY = "sk-dash-0123456789"
HOSTILE = "<img src=x onerror=alert(1)>"  # a dead letter's fields are whatever a producer sent


def make_traffic(redis_url: str, namespace: str) -> None:
    """Requests of two buckets answered, and one dead letter whose reason quotes hostile text."""
    with Client(redis_url, namespace) as client:
        client.generate_many([[5] * 10, [6] * 50, [7] * 12], max_new_tokens=3, timeout=60)
    r = redis.Redis.from_url(redis_url)
    r.xadd(Keys(namespace).stream(TEST_BUCKETS[0]), {"id": "dead-1", "r": HOSTILE, "p": b"x"})
    wait_until(lambda: r.xlen(Keys(namespace).dead) == 1, 30, "the dead letter")
    # the worker's status is its heartbeat's (every 2 s): wait for the one that counts all three
    wait_until(lambda: [w.get("completed") for w in worker_stats(r, Keys(namespace))] == [3], 30, "a heartbeat")
    r.close()


@pytest.mark.unit
def test_prefix_cache_hit_rate_from_the_heartbeat():
    assert prefix_cache_hit_rate({}) is None
    assert prefix_cache_hit_rate({"engine_prefix_cache_queries": 0, "engine_prefix_cache_hits": 0}) is None
    assert prefix_cache_hit_rate({"engine_prefix_cache_queries": 8, "engine_prefix_cache_hits": 6}) == 0.75
    assert prefix_cache_hit_rate({"prefix_cache_queries": 4, "prefix_cache_hits": 1}) == 0.25


def test_data_and_key_on_the_gateway_and_the_standalone_server(start_worker, redis_url: str, namespace: str):
    w = start_worker(max_wait_ms=10)
    make_traffic(redis_url, namespace)
    keys = Keys(namespace)
    r = redis.Redis.from_url(redis_url)
    data = dashboard_data(r, keys)
    r.close()
    assert [(q["bucket"], q["priority"]) for q in data["queues"]] == [
        (b, priority) for priority in ("interactive", "background") for b in TEST_BUCKETS]  # a row each
    (worker,) = data["workers"]
    assert worker["name"] == w.loop.transport.name and worker["alive"] and worker["completed"] == 3
    assert {b["bucket"] for b in data["batches"]} == {TEST_BUCKETS[0], TEST_BUCKETS[1]}
    assert sum(b["requests"] for b in data["batches"]) == 3 and all(b["worker"] == worker["name"]
                                                                    for b in data["batches"])
    (dead,) = data["dead_letter_entries"]
    assert dead["id"] == "dead-1" and dead["bucket"] == str(TEST_BUCKETS[0]) and "p" not in dead
    assert data["dead_letters"] == 1 and data["batch_jobs"] == [] and data["bulk_runs"] == []
    from tests.helpers.gateway import gateways  # fastapi: imported only where a gateway runs

    with gateways(redis_url, namespace) as start_gateway:
        gw = start_gateway(api_keys=KEY)
        with httpx.Client(base_url=gw.url, timeout=30) as http:
            page = http.get("/dashboard")
            assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
            assert worker["name"] not in page.text  # the page holds no data: served without a key
            assert http.get("/dashboard/data").status_code == 401
            assert http.get("/dashboard/data", headers={"Authorization": "Bearer wrong-key-123"}).status_code == 401
            got = http.get("/dashboard/data", headers={"Authorization": f"Bearer {KEY}"})
            assert got.status_code == 200 and got.json()["workers"][0]["name"] == worker["name"]
    server = DashboardServer(DashboardConfig(port=0, api_keys=KEY), ConnectionConfig(redis_url, namespace)).start()
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{server.port}", timeout=30) as http:
            assert http.get("/", follow_redirects=True).text == page.text
            assert http.get("/dashboard/data").status_code == 401
            got = http.get("/dashboard/data", headers={"Authorization": f"Bearer {KEY}"})
            assert got.status_code == 200 and got.json()["dead_letter_entries"][0]["id"] == "dead-1"
            assert http.get("/elsewhere").status_code == 404
    finally:
        server.close()


@needs_chromium
def test_chromium_shows_the_running_fleet(start_worker, redis_url: str, namespace: str):
    w = start_worker(max_wait_ms=10)
    make_traffic(redis_url, namespace)
    name = w.loop.transport.name
    from tests.helpers.gateway import gateways  # fastapi: imported only where a gateway runs

    with gateways(redis_url, namespace) as start_gateway:
        gw = start_gateway(api_keys=KEY)
        dom = Dom(chromium(f"{gw.url}/dashboard#key={KEY}"))
        locked = Dom(chromium(f"{gw.url}/dashboard"))  # no key: the page asks for one, shows no data
    assert "tiny" in dom.text["fleet"] and f"namespace {namespace}" in dom.text["fleet"]
    assert dom.text["live"] == "1 live worker" and not dom.text["error"].strip()
    queues = [(int(row["data-bucket"]), row["data-priority"]) for row in dom.rows if "data-bucket" in row]
    assert queues == [(b, priority) for priority in ("interactive", "background") for b in TEST_BUCKETS]
    (row,) = [row for row in dom.rows if "data-worker" in row]
    assert row["data-worker"] == name and row["data-alive"] == "true"
    workers = dom.text["workers"]
    for header in ("running", "waiting", "KV", "tok/s (1m)", "last prefill batches", "prefix hits"):
        assert header in workers
    assert re.search(r"hf/dynamic", workers)
    cells = [c.strip() for c in row["cells"]]
    assert cells[:5] == [name, "alive", "hf/dynamic", "0", "0"] and cells[9] == "3"  # running, waiting, done
    assert sum(map(int, cells[7].split(","))) == 3  # last batch sizes: the 3 requests, in 2 or 3 batches
    assert name in dom.text["batches"] and str(TEST_BUCKETS[1]) in dom.text["batches"]
    assert "dead-1" in dom.text["dead"] and "(1 kept)" in dom.text["dead-total"]
    assert "img" not in dom.tags, "a dead letter's text must never become markup"
    assert "none" in dom.text["jobs"] and "none" in dom.text["runs"]
    assert "display: block" in locked.style["auth"] and "needs an operator key" in locked.text["error"]
    assert name not in "".join(locked.text.values())


@needs_chromium
def test_chromium_on_the_standalone_dashboard_without_workers(redis_url: str, namespace: str):
    server = DashboardServer(DashboardConfig(port=0), ConnectionConfig(redis_url, namespace)).start()
    try:
        dom = Dom(chromium(f"http://127.0.0.1:{server.port}/dashboard?refresh=1"))
    finally:
        server.close()
    assert "no fleet published" in dom.text["fleet"] and dom.text["live"] == "0 live workers"
    assert "no workers" in dom.text["workers"] and "no prefill batches yet" in dom.text["batches"]


@pytest.mark.unit
def test_ci_installs_chromium_then_runs_the_readme_test_command():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    ci = (root / ".ci" / "run").read_text().strip().splitlines()
    readme = (root / "README.md").read_text()
    (command,) = re.findall(r"Run the tests .*?\n\n```bash\n(.*?)\n```", readme, flags=re.S)
    assert ci[-1] == command
    install = next(i for i, line in enumerate(ci) if "apt-get install" in line and "chromium" in line)
    assert install < len(ci) - 1


def history_sample(**fields: float) -> dict[str, float]:
    base = {"live": 1, "tok_s": 40.0, "results_1m": 0, **{f"{k}_{p}": 0 for p in ("interactive", "background")
                                                          for k in ("queued", "running", "results_1m")}}
    return {**base, **fields}


@needs_chromium
def test_chromium_charts_time_to_first_token_per_priority(redis_url: str, namespace: str):
    """Issue 58, item 3c: during a background backlog, background work waits ~45 s by design while interactive
    requests answer in ~120 ms; the chart shows one line per priority, not their mean (which read 30 s)."""
    from batchfleet.common.redis.fleetstate import redis_now_ms

    keys, r = Keys(namespace), redis.Redis.from_url(redis_url)
    slot = redis_now_ms(r) // 10_000 * 10_000
    for i in range(6, 0, -1):  # a minute of samples as the gateways' samplers write them (producer/ops/history.py)
        r.xadd(keys.history, history_sample(results_1m=30, ttft_ms=30_000 + i, results_1m_interactive=20,
                                            ttft_ms_interactive=120 + i, results_1m_background=10,
                                            ttft_ms_background=45_000 + i, queued_background=5_000),
               id=f"{slot - i * 10_000}-0")
    r.close()
    server = DashboardServer(DashboardConfig(port=0), ConnectionConfig(redis_url, namespace)).start()
    try:
        dom = Dom(chromium(f"http://127.0.0.1:{server.port}/dashboard?span=15"))
    finally:
        server.close()
    ttft = dom.charts["time to first token"]
    assert ttft["data-series"] == "interactive,background" and int(ttft["data-points"]) == 6
    assert dom.text["caption-time-to-first-token"] == ("time to first token (ms, 1-min mean per priority): "
                                                       "interactive 121, background 45001")


@needs_chromium
def test_the_pages_have_an_icon_and_load_without_a_404(redis_url: str, namespace: str):
    """Issue 58, item 3e: the page inlines its icon (no request), /favicon.ico answers 200 (what a browser asks
    for on a page without one), and a page load makes no request that ends in 404, on the gateway (whose HTTP
    metrics count none) and on `batchfleet dashboard`."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from batchfleet.producer.ops.dashboard import FAVICON
    from tests.helpers.browser import chromium_requests
    from tests.helpers.gateway import gateways

    server = DashboardServer(DashboardConfig(port=0), ConnectionConfig(redis_url, namespace)).start()
    try:
        with gateways(redis_url, namespace) as start_gateway:
            gw = start_gateway()
            for base in (gw.url, f"http://127.0.0.1:{server.port}"):
                dom, requests = chromium_requests(f"{base}/dashboard")
                assert re.search(r'<link rel="icon" type="image/svg\+xml" href="data:image/svg\+xml,%3Csvg', dom)
                ours = [(url.removeprefix(base), status) for url, status in requests if url.startswith(base)]
                assert ("/dashboard", 200) in ours and ("/dashboard/data", 200) in ours, ours
                assert all(status < 400 for _, status in ours), ours
                _, plain = chromium_requests(f"{base}/health" if base == gw.url else f"{base}/dashboard/data")
                assert (f"{base}/favicon.ico", 200) in plain  # a page without an icon: the browser asks there
                with httpx.Client(base_url=base, timeout=30) as http:
                    icon = http.get("/favicon.ico")
                assert icon.status_code == 200 and icon.headers["content-type"] == "image/svg+xml"
                assert icon.content == FAVICON and icon.content.startswith(b"<svg")
            text = generate_latest(gw.app.state.metrics.registry).decode()
    finally:
        server.close()
    statuses = {s.labels["status"] for fam in text_string_to_metric_families(text) for s in fam.samples
                if s.name == "batchfleet_gateway_requests_total"}
    assert "200" in statuses and not {"404"} & statuses, statuses
