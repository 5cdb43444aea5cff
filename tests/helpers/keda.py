"""KEDA's arithmetic over a ScaledObject's redis-streams triggers (redis-cluster-streams: the same over a
cluster client), read from a live Redis (tests only).

As KEDA's redis-streams scaler (pkg/scalers/redis_streams_scaler.go) and the HPA compute it: a trigger
without ``consumerGroup`` reads XLEN against ``streamLength``; with one, the group's lag against
``lagCount`` (Redis 7) or its pending count against ``pendingEntriesCount``. A trigger is active when its
metric exceeds ``activationLagCount``. The HPA's AverageValue target asks ceil(metric / target) replicas
per trigger and takes the largest; KEDA scales to ``minReplicaCount`` (0) only when no trigger is active,
and to at least 1 when one is; the result is capped by ``maxReplicaCount``.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import redis

from batchfleet.common.keys import BACKGROUND_STREAM_SUFFIX, Keys

SCALERS = ("redis-streams", "redis-cluster-streams")  # the types read here (the same XLEN / group arithmetic)


@dataclass(frozen=True)
class TriggerReading:
    stream: str
    metric: int
    target: int
    active: bool

    @property
    def replicas(self) -> int:
        return math.ceil(self.metric / self.target)


def _group_row(r: redis.Redis, stream: str, group: str) -> dict | None:
    try:
        rows = r.xinfo_groups(stream)
    except redis.ResponseError:  # no such stream: nothing waits
        return None
    return next((row for row in rows if row["name"] in (group, group.encode())), None)


def read_trigger(r: redis.Redis, metadata: dict) -> TriggerReading:
    """One trigger's metric and target, as the scaler reads them."""
    stream, group = metadata["stream"], metadata.get("consumerGroup")
    if not group:
        metric, target = r.xlen(stream), int(metadata.get("streamLength", 5))
    else:
        row = _group_row(r, stream, group)
        if "lagCount" in metadata:
            metric, target = int((row or {}).get("lag") or 0), int(metadata["lagCount"])
        else:
            metric, target = int((row or {}).get("pending") or 0), int(metadata.get("pendingEntriesCount", 5))
    return TriggerReading(stream, metric, target, metric > int(metadata.get("activationLagCount", 0)))


def desired_replicas(r: redis.Redis, scaled_object: dict) -> tuple[int, list[TriggerReading]]:
    """The replica count KEDA and the HPA would set now, and each trigger's reading."""
    spec = scaled_object["spec"]
    readings = [read_trigger(r, t["metadata"]) for t in spec["triggers"] if t["type"] in SCALERS]
    lo, hi = int(spec.get("minReplicaCount", 0)), int(spec.get("maxReplicaCount", 100))
    if not any(t.active for t in readings):
        return lo, readings
    return min(hi, max(lo, 1, *(t.replicas for t in readings))), readings


def for_fleet(scaled_object: dict, keys: Keys, buckets: tuple[int, ...], max_replicas: int = 100) -> dict:
    """The shipped ScaledObject re-aimed at a test fleet: one trigger per stream of ``keys`` (its namespace;
    a hash tag on a cluster; every shard of a sharded one) and ``buckets``, each a copy of the shipped trigger
    of the same priority (its type, mode, target and activation)."""
    shipped = scaled_object["spec"]["triggers"]
    background = f":{BACKGROUND_STREAM_SUFFIX}"
    by_priority = {"background": next(t for t in shipped if t["metadata"]["stream"].endswith(background)),
                   "interactive": next(t for t in shipped if not t["metadata"]["stream"].endswith(background))}
    out = copy.deepcopy(scaled_object)
    triggers = []
    for stream, _bucket, priority in (x for k in keys.every_shard for x in k.streams(buckets)):
        t = copy.deepcopy(by_priority[priority])
        t["metadata"]["stream"] = stream
        triggers.append(t)
    out["spec"]["triggers"] = triggers
    out["spec"]["maxReplicaCount"] = max_replicas
    return out
