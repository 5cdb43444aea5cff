"""A worker's presence in its fleet: the fleet description it joined and keeps alive, its place in the
live-worker set, its status heartbeat, and the offset between this host's clock and Redis'.

The stream consumer's ``presence`` part (worker/transport/consumer.py owns the connection; callers reach it as
``transport.presence``); joining and leaving are worker/transport/fleet.py's scripts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import msgpack
import redis

from batchfleet.common.keys import Keys
from batchfleet.common.redis.fleetstate import live_workers
from batchfleet.common.wire.protocol import FleetInfo
from batchfleet.worker.transport import fleet
from batchfleet.worker.transport.base import Membership
from batchfleet.worker.transport.refused import refused
from batchfleet.worker.transport.scripts import WorkerScripts

log = logging.getLogger("batchfleet.worker.transport.consumer")

FLEET_TTL_S = fleet.FLEET_TTL_MS // 1000  # the fleet description outlives its last heartbeat by this much
STATUS_TTL_S = 15  # three idle heartbeats (worker/loop.py IDLE_HEARTBEAT_S)
PRUNE_EVERY = 30  # beats between two prunes of day-old names from the live-worker set (it grows by restarts only)
# the lease keeper's alive() (every 2.5 s) beats only when no heartbeat went out for this long: the loop's
# own (every 2-5 s, a tick late at most) makes it a no-op unless a long engine step holds the loop; a beat is
# then never older than 9.5 s (worker/health.py reads 10 s as not ready)
ALIVE_WITHIN_S = 7.0


class Presence(Membership):
    """One worker's fleet membership and heartbeat (thread-safe: the lease keeper calls ``beat`` too)."""

    def __init__(self, r: redis.Redis, scripts: WorkerScripts, keys: Keys, name: str) -> None:
        self.r = r
        self.keys = keys
        self.name = name
        self.info: FleetInfo | None = None  # the description joined (published again when it vanishes)
        self.offset = 0.0  # Redis time - time.time(), refreshed by each heartbeat
        self.scripts = scripts
        self.last_beat = -1e9  # time.monotonic() of the last beat
        self._beats = 0
        # what else the lease keeper's thread does each time it calls ``alive`` (every few seconds), off the loop's
        # thread: the stream consumer's idle-tenant sweep (worker/transport/tenant_gc.py); each must not raise
        self.chores: list[Callable[[], None]] = []

    @refused
    def join(self, info: FleetInfo, replace: bool = False) -> None:
        """Publish the fleet description with a TTL (FleetConflict when live workers serve another fingerprint,
        unless ``replace``) and mark this worker live; kept for ``rejoin``. A status left by an earlier process of
        this name is dropped: this one is ready (worker/health.py) only once its loop publishes its own."""
        fleet.join(self.r, self.scripts, self.keys, info, self.name, replace)
        self.info = info
        self.r.delete(self.keys.worker(self.name))
        self.beat(b"")

    def rejoin(self) -> None:
        """Publish the joined description again (Redis lost it); a conflicting fleet is logged, not raised."""
        if self.info is not None:
            try:
                fleet.join(self.r, self.scripts, self.keys, self.info, self.name)
            except fleet.FleetConflict as exc:  # another fleet took the namespace while Redis was away
                log.error("%s", exc)
        self.beat(b"")

    def fleet_ttl_s(self) -> int:
        """The description's TTL each heartbeat renews; 0 (none) for a fleet that scales to zero."""
        return 0 if self.info is not None and self.info.scale_to_zero else FLEET_TTL_S

    def leave(self) -> bool:
        """Out of the live set now; the description goes too when this was the last live worker (unless
        the fleet scales to zero). Returns whether it was deleted."""
        keep = self.info is not None and self.info.scale_to_zero
        return fleet.leave(self.scripts, self.keys, self.name, keep=keep)

    @refused
    def heartbeat(self, status: dict) -> None:
        """The status, msgpack-encoded, under this worker's key for STATUS_TTL_S; marks the worker live and
        renews the fleet description's TTL."""
        self.beat(msgpack.packb(status, use_bin_type=True))

    @refused
    def alive(self) -> None:
        """Beat unless a beat (the loop's heartbeat) went out within ALIVE_WITHIN_S: the lease keeper's call
        (from its thread), which only matters while the loop is inside a long engine step; then the ``chores``."""
        if time.monotonic() - self.last_beat >= ALIVE_WITHIN_S:
            self.beat(b"")
        for chore in self.chores:
            chore()

    def clock_offset(self) -> float:
        """Redis time minus this host's time (s), as measured by the last beat."""
        return self.offset

    @refused
    def live_peers(self) -> int:
        """Live workers (the one live-workers query, common/redis/fleetstate.py), ourselves excluded."""
        return sum(w != self.name for w in live_workers(self.r, self.keys))

    def beat(self, status: bytes) -> None:
        """Mark this worker live, renew the fleet description's TTL and (non-empty ``status``) publish the
        status for STATUS_TTL_S; measures the clock offset on the way."""
        before = time.time()
        prune = self._beats % PRUNE_EVERY == 0
        self._beats += 1
        t = self.scripts.heartbeat(keys=[self.keys.workers, self.keys.worker(self.name), self.keys.fleet],
                                   args=[self.name, status, STATUS_TTL_S, self.fleet_ttl_s(), int(prune)])
        after = time.time()
        self.last_beat = time.monotonic()
        self.offset = int(t[0]) + int(t[1]) / 1e6 - (before + after) / 2
        if int(t[2]) == 0 and self.info is not None:  # the description is gone (deleted, or expired)
            log.warning("the fleet description was missing: publishing it again")
            self.rejoin()
