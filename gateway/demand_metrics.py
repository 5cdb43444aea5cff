"""The fleet's demand (producer/ops/demand.py) as Prometheus gauges on the gateway's ``--metrics-port``, read
from Redis at scrape time; what KEDA scales the workers on (deploy/k8s/keda.yaml):

    batchfleet_demand_requests{priority}   requests to answer: interactive; background, with the lines bulk
                                           runs and batch jobs have not sent yet (whatever their priority:
                                           what KEDA's cap applies to)
    batchfleet_demand_unsent_lines         of those, the lines not sent yet

Every gateway of a fleet exports the same fleet-wide figure: in PromQL use ``max`` across gateways, not
``sum``. Like the work gauges (gateway/work_metrics.py) the reads use a small pool of their own with a short
timeout, and a scrape still answers without these gauges when Redis does not: KEDA's trigger then reads no
value (``ignoreNullValues: "false"``: an error, so the fleet keeps its size rather than scaling to zero blind).
"""

from __future__ import annotations

from prometheus_client.core import GaugeMetricFamily

from batchfleet.common.wire.priority import BACKGROUND, INTERACTIVE
from batchfleet.gateway.scraped import ScrapedCollector
from batchfleet.producer.ops.demand import Demand, read_demand


def demand_families(demand: Demand) -> list[GaugeMetricFamily]:
    """The two gauges of ``demand`` (pure)."""
    requests = GaugeMetricFamily("batchfleet_demand_requests", "Requests the fleet has to answer, by priority: "
                                 "every request stream's entries (queued, read ahead or running; every bucket and "
                                 "shard); background also counts the lines bulk runs and batch jobs have not sent "
                                 "yet. What KEDA scales the workers on.", labels=["priority"])
    requests.add_metric([INTERACTIVE], demand.interactive)
    requests.add_metric([BACKGROUND], demand.capped)
    lines = GaugeMetricFamily("batchfleet_demand_unsent_lines", "Lines bulk runs and OpenAI batch jobs have not "
                              "sent yet (beyond their window in flight); counted in the background demand.")
    lines.add_metric([], demand.unsent)
    return [requests, lines]


class DemandCollector(ScrapedCollector):
    """The gauges of ``demand_families``, read from Redis per scrape (the fleet of ``conn``'s namespace)."""

    what = "demand gauges"

    def read(self) -> list[GaugeMetricFamily]:
        return demand_families(read_demand(self.r, self.keys))
