"""Every Redis key batchfleet uses, derived from one namespace (default ``bf``).

Keeping names in one place lets ACL rules (``~bf:*``) and tenant isolation follow from the namespace.

On a Redis Cluster (``hashtag``) the namespace is written as a hash tag, ``{bf}:stream:128``: every key of
a fleet then hashes to one slot, so each Lua script, function and transaction touches one node, as Redis
Cluster requires.

A sharded cluster fleet (``shards`` > 1, the workers' ``--shards``) spreads its request traffic over that many
tags: shard 0 is ``{bf}`` (every key of the fleet as a whole lives there: fleet description, files,
batches, status), shards 1..n-1 are ``{bf:<k>}`` with ``k`` picked so that the n tags fall into n different
n-ths of the slot space: on a cluster of n masters made by ``redis-cli --cluster create`` (equal slot
ranges), one shard per master. Each shard holds its own request streams, inboxes, done and cancel markers,
cancels stream and live-worker set, so every script still touches one slot.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass, replace
from functools import lru_cache

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from batchfleet.common.wire.priority import BACKGROUND, INTERACTIVE, PRIORITIES

DEFAULT_NAMESPACE = "bf"
# The key suffix of background streams (``<ns>:stream:<bucket>:batch``): "batch" is the priority's old name,
# kept in the key so work queued before the rename to "background" is still read after an upgrade (and the
# KEDA manifests keep naming these streams). Nothing else says "batch" for the priority.
BACKGROUND_STREAM_SUFFIX = "batch"
# A named tenant's request streams end in ``:t:<tenant>`` (``Keys.stream``); the default tenant's have no suffix.
TENANT_STREAM_SUFFIX = ":t:"
# fullmatch everywhere: "$" would accept a trailing newline ("abc\n")
_NAMESPACE_RE = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
JOB_ID_RE = re.compile(r"[A-Za-z0-9_.\-]{1,128}")
INBOX_RE = re.compile(r"[A-Za-z0-9_\-]{16,64}")  # a client's inbox token: unguessable (128 random bits)
# A tenant's label (Request.tenant): a name an operator gives a customer or team, safe in keys and metric labels.
# "" is the default tenant (requests that name none).
TENANT_MAX_CHARS = 32
TENANT_RE = re.compile(rf"[a-z0-9_\-]{{1,{TENANT_MAX_CHARS}}}")


def valid_job_id(job_id: object) -> bool:
    return isinstance(job_id, str) and bool(JOB_ID_RE.fullmatch(job_id))


def valid_tenant(label: object) -> bool:
    return isinstance(label, str) and bool(TENANT_RE.fullmatch(label))


def valid_inbox(token: object) -> bool:
    return isinstance(token, str) and bool(INBOX_RE.fullmatch(token))


MAX_SHARDS = 64


@lru_cache(maxsize=256)
def shard_tags(namespace: str, shards: int) -> tuple[str, ...]:
    """The hash tags of a fleet's shards (module docstring): the namespace itself, then ``<ns>:<k>`` with the
    smallest ``k`` landing in each n-th of the slot space that the ones before left free."""
    if shards == 1:
        return (namespace,)
    part = REDIS_CLUSTER_HASH_SLOTS / shards

    def nth(tag: str) -> int:
        return int(key_slot(tag.encode()) // part)

    tags, taken, k = [namespace], {nth(namespace)}, 0
    for want in (i for i in range(shards) if i not in taken):
        while nth(f"{namespace}:{k}") != want:
            k += 1
        tags.append(f"{namespace}:{k}")
        k += 1
    return tuple(tags)


@dataclass(frozen=True)
class Keys:
    """Key names under one namespace (of one shard of it: ``shard``, of ``shards``)."""

    namespace: str = DEFAULT_NAMESPACE
    hashtag: bool = False  # a Redis Cluster fleet: every key under the tag {namespace} (or its shard's tag)
    shards: int = 1
    shard: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.namespace, str) or not _NAMESPACE_RE.fullmatch(self.namespace):
            raise ValueError(f"invalid namespace {self.namespace!r}: use 1-64 chars of [A-Za-z0-9_.-]")
        if not 1 <= self.shards <= MAX_SHARDS or not 0 <= self.shard < self.shards:
            raise ValueError(f"invalid shard {self.shard} of {self.shards} (1-{MAX_SHARDS} shards)")
        if self.shards > 1 and not self.hashtag:
            raise ValueError("shards need a Redis Cluster (hash tags)")

    @property
    def prefix(self) -> str:
        """What every key starts with (then ``:``): the namespace, as a hash tag (its shard's) on a cluster."""
        return f"{{{shard_tags(self.namespace, self.shards)[self.shard]}}}" if self.hashtag else self.namespace

    def of_shard(self, shard: int) -> Keys:
        """The same fleet's keys on another shard."""
        return replace(self, shard=shard)

    def with_shards(self, shards: int) -> Keys:
        """Shard 0 of this fleet laid out over ``shards`` shards (what the fleet description says)."""
        return replace(self, shards=shards, shard=0)

    @property
    def every_shard(self) -> tuple[Keys, ...]:
        return tuple(self.of_shard(s) for s in range(self.shards))

    def shard_of(self, key: str) -> int | None:
        """The shard a key of this fleet lives on (by its prefix), or None when it is not one of its keys."""
        for s in range(self.shards):
            if key.startswith(self.of_shard(s).prefix + ":"):
                return s
        return None

    def home_shard(self, token: str) -> int:
        """The shard of a client's inbox (and its cancel and done markers): fixed by its token, so a client
        that reuses its token after a restart reads the same inbox."""
        return zlib.crc32(token.encode()) % self.shards

    @property
    def group(self) -> str:
        """Consumer group shared by every worker of the fleet."""
        return "workers"

    def stream(self, bucket: int, priority: str = INTERACTIVE, tenant: str = "") -> str:
        """The request stream of one prompt-length bucket, priority and tenant: ``<ns>:stream:<bucket>`` for
        interactive work, ``<ns>:stream:<bucket>:batch`` (``BACKGROUND_STREAM_SUFFIX``) for background work, so
        a worker finds interactive work without reading past a background backlog; a named tenant's (``tenant``
        not "") end in ``:t:<tenant>``, so a worker reads each tenant's work apart and shares a class between them
        (worker/transport/fair_share.py) without reading past another tenant's backlog."""
        if priority == INTERACTIVE:
            base = f"{self.prefix}:stream:{bucket}"
        elif priority == BACKGROUND:
            base = f"{self.prefix}:stream:{bucket}:{BACKGROUND_STREAM_SUFFIX}"
        else:
            raise ValueError(f"unknown priority {priority!r}")
        if not tenant:
            return base
        if not valid_tenant(tenant):
            raise ValueError(f"invalid tenant {tenant!r}")
        return f"{base}{TENANT_STREAM_SUFFIX}{tenant}"

    def streams(self, buckets: tuple[int, ...] | list[int], tenants: tuple[str, ...] | list[str] | set[str] = (),
                ) -> list[tuple[str, int, str]]:
        """(stream, bucket, priority) of every request stream: the default tenant's and those of ``tenants``
        (the named tenants with streams here: ``SMEMBERS`` of ``queued_tenants``, as common/redis/fleetstate.py
        ``request_streams`` reads it), interactive ones first. The one enumeration of
        request streams: whoever counts or scans them all passes the tenants."""
        named = sorted(t for t in set(tenants) if t)
        return [(self.stream(b, priority, t), b, priority) for priority in PRIORITIES for t in ("", *named)
                for b in buckets]

    @property
    def queued_tenants(self) -> str:
        """Set of the named tenants that have queued work on this shard (the enqueue function adds the tenant
        when it creates its stream): workers read these tenants' streams (``streams``). A tenant whose streams
        stayed empty for a while is retired: removed with its streams (worker/transport/tenant_gc.py); its next
        enqueue adds it again."""
        return f"{self.prefix}:queued-tenants"

    @property
    def tenant_bell(self) -> str:
        """Stream rung (an entry ``t`` = the tenant) when a tenant joins ``queued_tenants``: every worker's read
        includes it, so the worker it wakes reads the new tenant's streams at once (common/redis/functions.py)."""
        return f"{self.prefix}:tenant-bell"

    @property
    def idle_tenants(self) -> str:
        """Hash of the queued tenants whose streams were all empty when last looked at: field = tenant, value =
        Redis time (ms) they were first seen so (worker/transport/tenant_gc.py); a tenant leaves it when work
        comes or when it is retired."""
        return f"{self.prefix}:idle-tenants"

    @property
    def tenant_sweep(self) -> str:
        """Who looks for idle tenants on this shard now: a worker's name under ``SET NX PX`` (one sweep per period
        for the whole fleet, worker/transport/tenant_gc.py)."""
        return f"{self.prefix}:tenant-sweep"

    def inbox(self, token: str) -> str:
        """One client's reply stream: workers XADD every reply (and stream delta) of the client's jobs here;
        the client reads it with one connection and deletes what it consumed (expires after the reply TTL)."""
        return f"{self.prefix}:inbox:{token}"

    def inbox_token(self, reply_key: object) -> str | None:
        """The token of a reply key of this namespace (``<ns>:inbox:<token>``, on any of its shards), else
        None."""
        shard = self.shard_of(reply_key) if isinstance(reply_key, str) else None
        if shard is None or not isinstance(reply_key, str):
            return None
        prefix = f"{self.of_shard(shard).prefix}:inbox:"
        if reply_key.startswith(prefix) and valid_inbox(reply_key[len(prefix):]):
            return reply_key[len(prefix):]
        return None

    def cancel(self, job_id: str) -> str:
        """Cancel marker of a job (value: its reply key; expires after the reply TTL): a worker that reads the
        job later skips it."""
        return f"{self.prefix}:cancel:{job_id}"

    @property
    def cancels(self) -> str:
        """Capped stream of cancel requests (id, reply key) every worker follows, for jobs it already holds."""
        return f"{self.prefix}:cancels"

    @property
    def workers(self) -> str:
        """Sorted set of live workers: member = worker name, score = Redis time (ms) of its last heartbeat."""
        return f"{self.prefix}:workers"

    @staticmethod
    def done(job_id: str, reply_key: str) -> str:
        """A job's answer: its final reply, stored by the first writer (``SET NX``; a re-run cannot answer twice)
        and emptied by the client once it has taken it; expires after the reply TTL. Under the reply key (the
        inbox, on its shard and slot): only whoever knows the inbox token can read it, and a reply pipeline
        writes it before the inbox entry that rings for it on the same node."""
        return f"{reply_key}:done:{job_id}"

    @property
    def fleet(self) -> str:
        """Fleet description published by workers: tokenizer, buckets, limits (expires unless a live worker
        refreshes it with its heartbeat)."""
        return f"{self.prefix}:fleet"

    def worker(self, name: str) -> str:
        """Heartbeat/status of one worker (expires when the worker stops refreshing it)."""
        return f"{self.prefix}:worker:{name}"

    def kernel_choices(self, fingerprint: str) -> str:
        """JSON of the weight matmuls' kernel choices measured on one CPU kind (worker/engine/native/kernel_cache.py):
        written by the first worker of that kind, read by every later one instead of measuring (30-day TTL)."""
        return f"{self.prefix}:kernels:{fingerprint}"

    @property
    def batches(self) -> str:
        """Capped stream of batch records (bucket, ids, size) written by workers, for audit and tests."""
        return f"{self.prefix}:batches"

    @property
    def released(self) -> str:
        """Counter a worker bumps when it releases leases (worker/transport/pending.py ``release``): a peer with room
        reads it about once a second and scans the pending lists at once when it moved, instead of
        scanning every stream every second (worker/transport/pending.py ``reclaim``)."""
        return f"{self.prefix}:released"

    @property
    def flush(self) -> str:
        """Counter a load generator bumps to close partial static batches ("static N" ends its load).

        Only static-batching workers act on it: their transport polls it (``transport.flush.requested``
        in worker/transport/base.py, at most every 50 ms while a partial batch waits) and a change since the
        last value seen closes the partial batches."""
        return f"{self.prefix}:flush"

    @property
    def dead(self) -> str:
        """Capped dead-letter stream."""
        return f"{self.prefix}:dead"

    def file(self, file_id: str) -> str:
        """An uploaded or produced file's metadata (JSON; the bytes live in the gateway's files directory)."""
        return f"{self.prefix}:file:{file_id}"

    def files(self, owner: str) -> str:
        """Sorted set of one API key's files (score: creation time)."""
        return f"{self.prefix}:files:{owner}"

    def response(self, response_id: str) -> str:
        """A stored Responses API response (JSON: the response object, its owner and the conversation it
        ends, for ``previous_response_id``); expires after the gateway's --response-ttl."""
        return f"{self.prefix}:response:{response_id}"

    def openai_batch(self, batch_id: str) -> str:
        """An OpenAI batch: hash of ``doc`` (the batch object, written by whoever runs it), ``run`` (its
        output names) and ``cancel`` (when a cancel was asked, written by the API)."""
        return f"{self.prefix}:obatch:{batch_id}"

    def openai_batches(self, owner: str) -> str:
        """Sorted set of one API key's batches (score: creation time)."""
        return f"{self.prefix}:obatches:{owner}"

    @property
    def openai_batches_due(self) -> str:
        """Sorted set of the batches not yet finished: any batch runner may take one (under its lease)."""
        return f"{self.prefix}:obatches-due"

    def batch_lease(self, batch_id: str) -> str:
        """Who runs a batch now (a random token; expires unless renewed)."""
        return f"{self.prefix}:obatch-lease:{batch_id}"

    @property
    def openai_batches_finished(self) -> str:
        """Sorted set of the last few finished batches (score: when they finished; capped by the batch store),
        so the dashboard shows them without knowing the owners."""
        return f"{self.prefix}:obatches-finished"

    @property
    def bulk_runs(self) -> str:
        """Sorted set of the bulk runs (``batchfleet bulk``) heard from lately: member = run id, score = Redis
        time (ms) of its last report; entries older than a run's TTL are pruned by whoever writes."""
        return f"{self.prefix}:bulk-runs"

    def bulk_run(self, run_id: str) -> str:
        """One bulk run's last report (JSON): a running run's expires a few minutes after it, so a killed run
        disappears; a finished (or stopped) run's stays while ``bulk_runs_finished`` lists it."""
        return f"{self.prefix}:bulk-run:{run_id}"

    @property
    def bulk_runs_finished(self) -> str:
        """Sorted set of the last few finished (or stopped) bulk runs (score: when they ended, ms; capped by
        the runs that write it, which delete the reports of the runs it drops), as ``openai_batches_finished``."""
        return f"{self.prefix}:bulk-runs-finished"

    @property
    def tenants(self) -> str:
        """Hash of the configured tenants: field = tenant label (``valid_tenant``), value = JSON of its settings
        (``{"weight": 1, "requests_per_minute": ..., "tokens_per_minute": ..., "tokens_per_day": ...}``; absent
        means unlimited). Written by operators (``batchfleet tenants``); read by workers (weights) and by every
        gateway and client that admits requests (limits). Never holds an API key."""
        return f"{self.prefix}:tenants"

    def limit_window(self, tenant: str) -> str:
        """A limited tenant's sliding minute (zset of its admissions, common/redis/functions.py ``ADMIT``); with
        ``:tokens`` appended, the tokens those admissions were counted at. Both expire a minute after the last."""
        return f"{self.prefix}:limit:{tenant}"

    def usage(self, day: str = "") -> str:
        """Hash of token and request counts per tenant, field ``<tenant>|<what>`` (``requests``, ``prompt_tokens``,
        ``cached_tokens``, ``generated_tokens``; tenant "" is the default tenant): the fleet's total, or with
        ``day`` (UTC ``YYYY-MM-DD``) that day's, which expires two days later (daily quotas read it)."""
        return f"{self.prefix}:usage:{day}" if day else f"{self.prefix}:usage"

    @property
    def history(self) -> str:
        """Capped stream of fleet samples (queue depth per priority, throughput, TTFT) for the dashboard's charts;
        an entry's id is its sample slot (ms), so of several gateways sampling one slot only the first adds it."""
        return f"{self.prefix}:history"

    @property
    def expiring(self) -> str:
        """Sorted set of the files and batches that expire (``file:<id>`` / ``batch:<id>``, score: when), swept
        by the batch runners (gateway/batches/expiry.py)."""
        return f"{self.prefix}:expiring"

    @property
    def pattern(self) -> str:
        return f"{self.prefix}:*"
