"""The fleet's usage per tenant, as Prometheus gauges on the gateway's ``/metrics`` and ``--metrics-port``, read
from Redis at scrape time (``Keys.usage``, ``Keys.tenants``: common/tenants.py), and the gateway's own refusals:

    batchfleet_fleet_tenant_requests{tenant}        requests the fleet finished for the tenant (the workers count)
    batchfleet_fleet_tenant_tokens{tenant, kind}    their tokens: prompt, cached (of the prompt), generated
    batchfleet_fleet_tenant_limit{tenant, limit}    the configured weight and limits (a limit absent: not exported)
    batchfleet_rate_limited_requests_total{tenant, limit}   requests this gateway refused with a 429, by limit

``tenant``: the configured tenants' labels, ``default`` (requests naming none) and ``other`` (every tenant not
configured, added up): a bounded label set whatever clients send. The usage gauges are the fleet's totals, the
same on every gateway (in PromQL: ``max`` across gateways, ``rate()`` works on them as on counters: they only
grow); the workers export their own per-tenant counters of what each worker ran.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily

from batchfleet.common.tenants import DEFAULT_LABEL, LIMITS, OTHER_LABEL, Tenant, metric_label, read_usage
from batchfleet.gateway.scraped import ScrapedCollector

TOKEN_KINDS = ("prompt", "cached", "generated")


def tenant_families(tenants: dict[str, Tenant], total: dict[str, dict[str, int]]) -> list[GaugeMetricFamily]:
    """The three gauges from the configured tenants and the fleet's usage (pure)."""
    labels = [DEFAULT_LABEL, *sorted(tenants), OTHER_LABEL]
    requests = dict.fromkeys(labels, 0)
    tokens = {(label, kind): 0 for label in labels for kind in TOKEN_KINDS}
    for tenant, used in total.items():
        label = metric_label(tenant, tenants)
        requests[label] += used.get("requests", 0)
        for kind in TOKEN_KINDS:
            tokens[label, kind] += used.get(f"{kind}_tokens", 0)
    req = GaugeMetricFamily("batchfleet_fleet_tenant_requests", "Requests the fleet finished per tenant (configured "
                            "tenants, default, other), counted by the workers; only grows.", labels=["tenant"])
    for label, n in requests.items():
        req.add_metric([label], n)
    tok = GaugeMetricFamily("batchfleet_fleet_tenant_tokens", "Tokens of the requests the fleet finished per "
                            "tenant, by kind: prompt, cached (of the prompt), generated; only grows.",
                            labels=["tenant", "kind"])
    for (label, kind), n in tokens.items():
        tok.add_metric([label, kind], n)
    lim = GaugeMetricFamily("batchfleet_fleet_tenant_limit", "A configured tenant's weight and limits "
                            "(requests_per_minute, tokens_per_minute, tokens_per_day; absent: no limit).",
                            labels=["tenant", "limit"])
    for label, t in sorted(tenants.items()):
        lim.add_metric([label, "weight"], t.weight)
        for name in LIMITS:
            if getattr(t, name) is not None:
                lim.add_metric([label, name], getattr(t, name))
    return [req, tok, lim]


class TenantCollector(ScrapedCollector):
    """``tenant_families`` read from Redis per scrape."""

    what = "tenant gauges"
    # Redis down or refusing: the usage reads raise redis-py's own errors (no sync redis import in the gateway)
    unavailable = (Exception,)

    def read(self) -> list[GaugeMetricFamily]:
        tenants, total, _ = read_usage(self.r, self.keys)
        return tenant_families(tenants, total)


def refusals_counter(registry: CollectorRegistry) -> Counter:
    return Counter("batchfleet_rate_limited_requests", "Requests this gateway refused with a 429 because their "
                   "tenant was over a limit, by tenant and limit.", ["tenant", "limit"], registry=registry)
