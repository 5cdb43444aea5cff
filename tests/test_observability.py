"""The Grafana dashboard and the Prometheus alert rules shipped under deploy/ query metrics that exist: every
PromQL expression parses (promql-parser), and every metric name (and label matcher) it uses is exported by a
live worker or a live gateway, scraped over HTTP. The Kubernetes PrometheusRule holds the same rules."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import httpx
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
GRAFANA = ROOT / "deploy" / "grafana" / "batchfleet-dashboard.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")

promql_parser = pytest.importorskip("promql_parser", reason="promql-parser (the dev extra) parses the queries")


def grafana_exprs() -> list[str]:
    dash = json.loads(GRAFANA.read_text())
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


def alert_rules() -> list[dict]:
    return [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]


TARGET_LABELS = {"instance", "job"}  # added by Prometheus to every scraped sample, never exported


def selectors(expr: str) -> list[tuple[str, set[str]]]:
    """(metric name, label names matched or grouped by) of every vector selector in ``expr`` (raises on a
    parse error): a ``sum by (priority)`` over a metric without ``priority`` silently merges what it should split."""
    found: list[tuple[str, set[str]]] = []

    def walk(node, grouped: frozenset[str]) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            labels = {m.name for m in node.matchers.matchers} if node.matchers else set()
            found.append((node.name, (labels | grouped) - TARGET_LABELS))  # job, instance: Prometheus' own
            return
        if isinstance(node, promql_parser.MatrixSelector):
            walk(node.vector_selector, grouped)
            return
        modifier = getattr(node, "modifier", None) if isinstance(node, promql_parser.AggregateExpr) else None
        if modifier is not None and str(modifier).startswith("by"):
            grouped = grouped | set(modifier.labels)
        for attr in ("lhs", "rhs", "expr", "param"):
            child = getattr(node, attr, None)
            if child is not None and not isinstance(child, (str, int, float)):
                walk(child, grouped)
        for arg in getattr(node, "args", None) or []:
            walk(arg, grouped)

    walk(promql_parser.parse(expr), frozenset())
    return found


@pytest.mark.unit
def test_dashboard_and_rules_parse_and_cover_the_issue():
    exprs = grafana_exprs()
    assert len(exprs) >= 15
    for e in exprs:
        assert selectors(e), e
    names = {r["alert"] for r in alert_rules()}
    assert names == {"BatchfleetNoLiveWorkers", "BatchfleetInteractiveQueueTooOld", "BatchfleetBackgroundQueueTooOld",
                     "BatchfleetWorkerStuck", "BatchfleetDeadLettersGrowing", "BatchfleetKVCacheSaturated",
                     "BatchfleetGateway5xx"}
    for r in alert_rules():
        assert selectors(r["expr"]) and r["labels"]["severity"] in ("warning", "critical")
        assert r["annotations"]["summary"] and r["annotations"]["description"]
    dash = json.loads(GRAFANA.read_text())
    assert dash["uid"] == "batchfleet" and dash["templating"]["list"][0]["type"] == "datasource"


BY_PRIORITY = ("batchfleet_queue_depth", "batchfleet_queue_pending", "batchfleet_queue_oldest_age_seconds",
            "batchfleet_time_to_first_token_seconds_bucket", "batchfleet_e2e_request_latency_seconds_bucket",
            "batchfleet_request_queue_time_seconds_bucket")


@pytest.mark.unit
def test_grafana_splits_queues_and_latency_by_priority_and_kv_full_means_capacity():
    """Issue 32: a background backlog merged into the interactive queue, or bulk latency into interactive latency,
    hides what an operator looks for; "preempted (KV full)" counted priority preemptions too."""
    dash = json.loads(GRAFANA.read_text())
    targets = [t for p in dash["panels"] for t in p.get("targets", [])]
    seen = set()
    for t in targets:
        for name, labels in selectors(t["expr"]):
            if name in BY_PRIORITY:
                seen.add(name)
                assert "priority" in labels and "{{priority}}" in t["legendFormat"], t
        if "KV full" in t.get("legendFormat", ""):
            assert selectors(t["expr"]) == [("batchfleet_preemptions_total", {"reason"})]
            assert 'reason="capacity"' in t["expr"], t
    assert seen == set(BY_PRIORITY)
    for r in alert_rules():  # the alerts too: an age per priority, saturation on capacity preemptions only
        for name, labels in selectors(r["expr"]):
            if name == "batchfleet_queue_oldest_age_seconds":
                assert "priority" in labels, r["alert"]
            if name == "batchfleet_preemptions_total":
                assert 'reason="capacity"' in r["expr"], r["alert"]


@pytest.mark.unit
def test_kubernetes_rule_is_the_same_as_the_rule_file():
    docs = [d for d in yaml.safe_load_all((ROOT / "deploy" / "k8s" / "monitoring.yaml").read_text()) if d]
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    assert rule["spec"]["groups"] == yaml.safe_load(ALERTS.read_text())["groups"]


def documented(prefix: str) -> dict[str, set[str]]:
    """metric -> label names, from docs/OPERATIONS.md's metric tables (rows like | `name{a,b}` | type | ...)."""
    import re

    out: dict[str, set[str]] = {}
    for name, labels in re.findall(rf"^\| `({prefix}[a-z_]*)(?:\{{([a-z_,]*)\}})?` \|",
                                   (ROOT / "docs" / "OPERATIONS.md").read_text(), re.M):
        assert name not in out, f"{name} is documented twice"
        out[name] = set(filter(None, labels.split(",")))
    return out


def scrape(url: str) -> dict[str, set[str]]:
    """sample name -> label names seen, from a live /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, set()).update(s.labels)
    return out


def test_every_metric_used_is_exported(start_worker, redis_url: str, namespace: str):
    from batchfleet.gateway.metrics import serve_gateway_metrics
    from batchfleet.worker.devtools import free_port
    from tests.helpers.gateway import GatewayThread

    port = free_port()
    start_worker(metrics_port=port, metrics_host="127.0.0.1", max_wait_ms=20)
    gw = GatewayThread(redis_url, namespace)
    server = serve_gateway_metrics(gw.app.state.metrics, 0, "127.0.0.1")
    try:
        with httpx.Client(base_url=gw.url, timeout=60) as http:
            resp = http.post("/v1/completions", json={"prompt": "hello there", "max_tokens": 4})
            assert resp.status_code == 200, resp.text
            assert http.get("/v1/nothing-here").status_code == 404
        worker, gateway = scrape(f"http://127.0.0.1:{port}/metrics"), scrape(f"http://127.0.0.1:{server.port}/metrics")
    finally:
        server.close()
        gw.stop()
    exported = {**worker}
    for name, labels in gateway.items():
        exported.setdefault(name, set()).update(labels)
    assert "batchfleet_gateway_requests_total" in gateway and "batchfleet_workers_live" in gateway
    assert {"route", "status"} <= gateway["batchfleet_gateway_requests_total"]
    # OPERATIONS.md's gateway table names the labels this gateway exports, no more, no fewer (issue 32)
    docs = documented("batchfleet_gateway_")
    families = {n.removesuffix("_bucket").removesuffix("_count").removesuffix("_sum") for n in gateway
                if n.startswith("batchfleet_gateway_") and not n.endswith("_created")}
    assert set(docs) == families
    for name, labels in docs.items():
        sample = next(n for n in (name, name + "_count") if n in gateway)
        assert gateway[sample] - {"le"} == labels, f"OPERATIONS.md documents {name}{{{','.join(sorted(labels))}}}"
    # the work gauges and the standard process metrics (issue 58): OPERATIONS.md's work table names exactly the
    # families and labels the gateway exports; every process serves process_*
    for prefix in ("batchfleet_batch_job", "batchfleet_bulk_", "batchfleet_demand_"):  # demand: issue 56
        docs = documented(prefix)
        assert docs and set(docs) == {n for n in gateway if n.startswith(prefix)}, prefix
        for name, labels in docs.items():
            assert gateway[name] == labels, f"OPERATIONS.md documents {name}{{{','.join(sorted(labels))}}}"
    for scraped in (worker, gateway):
        assert {"process_resident_memory_bytes", "process_cpu_seconds_total", "process_open_fds"} <= set(scraped)
    used = [(where, name, labels) for where, exprs in (("grafana", grafana_exprs()),
                                                       ("alerts", [r["expr"] for r in alert_rules()]))
            for e in exprs for name, labels in selectors(e)]
    for where, name, labels in used:
        assert name in exported, f"{where} uses {name}, which no worker or gateway exports"
        assert labels <= exported[name], f"{where} matches {labels - exported[name]} on {name}"
    histograms = {n for _, n, _ in used if n.endswith(HISTOGRAM_SUFFIXES)}
    assert any(n.startswith("batchfleet_gateway_") for n in histograms)
    for name in ("batchfleet_time_to_first_token_seconds_bucket", "batchfleet_e2e_request_latency_seconds_bucket",
                 "batchfleet_request_queue_time_seconds_bucket"):  # bulk vs interactive latency, split in Grafana
        assert {"priority", "class"} <= worker[name], name  # "class": the deprecated label, kept one release
    assert "reason" in worker["batchfleet_preemptions_total"]
