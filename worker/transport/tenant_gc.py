"""A named tenant's streams on one shard, made and retired: the set of queued tenants (``Keys.queued_tenants``)
stays bounded by the tenants that had work lately, however many labels clients use.

Making: the enqueue function makes the stream it adds to (with the workers' group) and adds the tenant to the
set. A worker reads every stream of every queued tenant (each bucket, both classes), so before it reads a
tenant it first sees, it makes the tenant's other streams (``ensure``: the ENSURE_TENANT script, only while the
tenant is in the set, so a retired tenant's streams are never made again by a worker).

Retiring: once per ``sweep_s`` one worker of the fleet (whoever takes ``Keys.tenant_sweep``, ``SET NX PX``; on its
lease keeper's thread, never the loop's) asks, per queued tenant, the RETIRE_TENANT script
(worker/transport/scripts.py): a tenant whose streams were empty (XLEN 0: answered entries are deleted, so nothing
queued or running) at two looks ``idle_s`` apart with no entry added in between loses its streams and its place
in the set, in that one call. An enqueue is then either
before it (the tenant has work: kept) or after it (the enqueue makes the stream and group again and adds the
tenant, as a first enqueue does; workers pick it up within ``TENANTS_CHECK_S``, worker/transport/consumer.py).

A worker that still reads a retired tenant's streams gets NOGROUP (or UNBLOCKED, when they go while it blocks on
them): ``gone`` tells that apart from Redis losing its data (a default stream's NOGROUP); the consumer then
reads the set again and goes on without error.
"""

from __future__ import annotations

import logging
import re
import time

import redis

from batchfleet.common.keys import TENANT_STREAM_SUFFIX, Keys
from batchfleet.common.redis.clients import create_groups
from batchfleet.common.wire.priority import PRIORITIES
from batchfleet.worker.transport.scripts import WorkerScripts

log = logging.getLogger("batchfleet.worker.transport.consumer")

# How often the fleet looks for idle tenants (per shard, one worker each time): at most this much after the idle
# time a tenant is retired. A look is one SET NX per worker, and for the one that takes it one script call per
# queued tenant in one round trip, on its lease keeper's thread: 66-72 ms for 1000 idle tenants of 8 streams each
# (Redis 7.0 on this project's 2-core test machine), hence the cap per look.
SWEEP_S = 30.0
SWEEP_MAX_TENANTS = 500  # tenants one look asks about (the next look goes on after them): bounds its round trip
RETIRED, IDLE = 3, 2  # RETIRE_TENANT's answers (worker/transport/scripts.py)
_NO_SUCH_KEY = re.compile(r"No such key '([^']*)'")


def gone(exc: BaseException) -> bool:
    """Whether a refused read names a named tenant's stream that is no longer there (retired): NOGROUP of a
    ``:t:`` stream, or UNBLOCKED (a stream deleted under a blocking read). NOGROUP of a default stream (Redis lost
    its data) is not."""
    if not isinstance(exc, redis.ResponseError):
        return False
    msg = str(exc)
    if msg.startswith("UNBLOCKED") or "UNBLOCKED the stream key no longer exists" in msg:
        return True
    key = _NO_SUCH_KEY.search(msg) if "NOGROUP" in msg else None
    return key is not None and TENANT_STREAM_SUFFIX in key.group(1)


def bell_gone(exc: BaseException, bell: str) -> bool:
    """Whether a refused read names the tenant bell (``Keys.tenant_bell``) as having no group: the bell alone went (an
    operator deleted it). Redis names the first key of a read without the group and the bell comes last, so every
    request stream it read still had its group: not Redis losing its data (the reader makes the bell again)."""
    if not isinstance(exc, redis.ResponseError) or "NOGROUP" not in str(exc):
        return False
    key = _NO_SUCH_KEY.search(str(exc))
    return key is not None and key.group(1) == bell


def refusal(exc: BaseException) -> bool:
    """An ACL refusal, of a command or of one inside a script."""
    msg = str(exc)
    return "NOPERM" in msg or "no permissions" in msg


class TenantStreams:
    """Makes (``ensure``) and retires (``sweep``) the named tenants' streams of one shard (module docstring)."""

    def __init__(self, r: redis.Redis, scripts: WorkerScripts, keys: Keys, buckets: tuple[int, ...], name: str,
                 idle_s: float, sweep_s: float | None = None) -> None:
        self.r = r
        self.scripts = scripts
        self.keys = keys
        self.buckets = buckets
        self.name = name
        self.idle_s = idle_s
        # a short idle time (tests) is looked at often enough to be kept
        self.sweep_s = sweep_s if sweep_s is not None else min(SWEEP_S, max(0.2, idle_s / 3))
        self._next_sweep = time.monotonic() + self.sweep_s
        self._after = ""  # the last tenant a look cut by SWEEP_MAX_TENANTS asked about
        self._refused = False  # the ACL lacks what retiring needs (docs/SECURITY.md): logged once, not retried
        self.retired = 0  # tenants this worker retired (tests, logs)

    def streams(self, tenant: str) -> list[str]:
        return [self.keys.stream(b, priority, tenant) for priority in PRIORITIES for b in self.buckets]

    def ensure(self, tenants: list[str] | set[str]) -> list[str]:
        """Of ``tenants``, those still queued, each with every stream made (one round trip for them all)."""
        tenants = sorted(t for t in set(tenants) if t)
        if not tenants:
            return []
        if not self._refused:
            pipe = self.r.pipeline(transaction=False)
            for t in tenants:
                WorkerScripts.queue(pipe, self.scripts.ensure_tenant, [self.keys.queued_tenants, *self.streams(t)],
                                    [t, self.keys.group])
            try:
                answers = WorkerScripts.run_pipeline(pipe, self.scripts.ensure_tenant)
                return [t for t, ok in zip(tenants, answers) if int(ok)]
            except redis.ResponseError as exc:
                if not refusal(exc):
                    raise
                self._refuse(exc)
        # an older ACL: made as before tenants were retired (none is, then)
        create_groups(self.r, self.keys.group, [s for t in tenants for s in self.streams(t)])
        return tenants

    def _refuse(self, exc: BaseException) -> None:
        self._refused = True
        log.warning("idle tenants are not retired: this worker's ACL user lacks what it needs "
                    "(docs/SECURITY.md): %s", exc)

    def sweep(self, tenants: tuple[str, ...] | list[str]) -> list[str]:
        """When due and this worker takes the shard's sweep: ask about each queued tenant (``tenants``), retiring
        the idle ones; the tenants retired. Never raises for a refusal (an older ACL): logged once, then off."""
        now = time.monotonic()
        named = sorted(t for t in tenants if t)
        if self._refused or now < self._next_sweep or not named:
            return []
        self._next_sweep = now + self.sweep_s
        try:
            if not self.r.set(self.keys.tenant_sweep, self.name, nx=True, px=max(1, int(self.sweep_s * 1000) - 50)):
                return []  # another worker looks this time
            batch = [t for t in named if t > self._after][:SWEEP_MAX_TENANTS] or named[:SWEEP_MAX_TENANTS]
            self._after = batch[-1] if len(batch) == SWEEP_MAX_TENANTS else ""
            pipe = self.r.pipeline(transaction=False)
            for t in batch:
                WorkerScripts.queue(pipe, self.scripts.retire_tenant,
                                    [self.keys.queued_tenants, self.keys.idle_tenants, *self.streams(t)],
                                    [t, int(self.idle_s * 1000)])
            answers = WorkerScripts.run_pipeline(pipe, self.scripts.retire_tenant)
        except redis.ResponseError as exc:
            if not refusal(exc):
                raise
            self._refuse(exc)
            return []
        retired = [t for t, a in zip(batch, answers) if int(a) == RETIRED]
        if retired:
            self.retired += len(retired)
            log.info("retired %d idle tenant(s) of %s: %s", len(retired), self.keys.prefix,
                     ", ".join(retired[:10]) + (" ..." if len(retired) > 10 else ""))
        return retired
