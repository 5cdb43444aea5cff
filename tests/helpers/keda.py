"""KEDA's arithmetic over the shipped ScaledObject (deploy/k8s/keda.yaml): its prometheus triggers' queries, its
``advanced.scalingModifiers`` formula, target and activation, and the HPA's replica count (tests only).

As KEDA and the HPA compute it: each prometheus trigger's metric is its query's single value (an empty answer is an
error with ``ignoreNullValues: "false"``); with scalingModifiers the formula composes the triggers' metrics (by
trigger name) into one metric, active when it exceeds ``activationTarget``; the HPA's AverageValue target asks
ceil(metric / target) replicas; KEDA scales to ``minReplicaCount`` (0) only when inactive and to at least 1 when
active; ``maxReplicaCount`` caps it.

A query is answered either by a real Prometheus over HTTP (``PrometheusQuery``) or, where a test samples faster
than any scrape interval, by evaluating it on one exposition text (``scraped``) with prometheus_client's parser:
that evaluator knows the shipped queries' one form, ``max(name{label="value", ...})``, and adds the labels the
scrape would (the ServiceMonitor's ``namespace``). The formula is evaluated as Python: the shipped formula uses
``+``, ``*`` and ``min``, which mean the same in expr-lang (KEDA's formula language).
"""

from __future__ import annotations

import copy
import json
import math
import re
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

QUERY_RE = re.compile(r'max\((?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)\{(?P<labels>[^}]*)\}\)')
LABEL_RE = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"([^"]*)"\s*,?')

Query = Callable[[str], float]  # a PromQL query -> its single value (raises when there is none)


@dataclass(frozen=True)
class Reading:
    metrics: dict[str, float]  # trigger name -> its query's value
    composed: float  # the formula's value
    active: bool
    desired: int


def scrape_labels(scaled_object: dict) -> dict[str, str]:
    """The labels Prometheus adds to what it scrapes from the gateways: the ServiceMonitor's ``namespace``
    (the ScaledObject's own, as the gateways')."""
    return {"namespace": scaled_object["metadata"]["namespace"]}


def scraped(text: str, labels: dict[str, str]) -> Query:
    """A query evaluated on one scrape's exposition ``text`` (the form of QUERY_RE only), each sample carrying
    ``labels`` too."""
    samples = [(s.name, {**s.labels, **labels}, s.value)
               for fam in text_string_to_metric_families(text) for s in fam.samples]

    def query(q: str) -> float:
        m = QUERY_RE.fullmatch(q.strip())
        assert m, f"not a query this evaluator knows: {q!r}"
        want = dict(LABEL_RE.findall(m["labels"]))
        values = [v for name, got, v in samples if name == m["name"] and all(got.get(k) == x for k, x in want.items())]
        if not values:
            raise LookupError(f"{q}: no series (KEDA's prometheus scaler errors: ignoreNullValues false)")
        return max(values)
    return query


class PrometheusQuery:
    """Queries a real Prometheus over its HTTP API (/api/v1/query), as KEDA's prometheus scaler does."""

    def __init__(self, url: str) -> None:
        self.url = url

    def __call__(self, q: str) -> float:
        with urllib.request.urlopen(f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': q})}",
                                    timeout=10) as resp:
            body = json.loads(resp.read())
        result = body["data"]["result"]
        if not result:
            raise LookupError(f"{q}: no series")
        assert len(result) == 1, result  # KEDA: the query must return a single element
        return float(result[0]["value"][1])


def desired_replicas(query: Query, scaled_object: dict) -> Reading:
    """The replica count KEDA and the HPA would set now, with the values it came from."""
    spec = scaled_object["spec"]
    mod = spec["advanced"]["scalingModifiers"]
    assert mod.get("metricType", "AverageValue") == "AverageValue"
    metrics = {t["name"]: query(t["metadata"]["query"]) for t in spec["triggers"]}
    composed = float(eval(mod["formula"], {"__builtins__": {}}, {"min": min, "max": max, **metrics}))  # noqa: S307
    active = composed > float(mod.get("activationTarget", 0))
    lo, hi = int(spec.get("minReplicaCount", 0)), int(spec.get("maxReplicaCount", 100))
    desired = min(hi, max(lo, 1, math.ceil(composed / float(mod["target"])))) if active else lo
    return Reading(metrics, composed, active, desired)


def for_fleet(scaled_object: dict, max_replicas: int = 100) -> dict:
    """The shipped ScaledObject with room to ask for more workers than a small cluster's maxReplicaCount: what
    the tests check is the ask."""
    out = copy.deepcopy(scaled_object)
    out["spec"]["maxReplicaCount"] = max_replicas
    return out
