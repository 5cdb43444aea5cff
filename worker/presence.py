"""A worker's presence in its fleet: the fleet description it joined and keeps alive, its place in the
live-worker set, its status heartbeat, and the offset between this host's clock and Redis'.

Owned by the stream consumer (worker/consumer.py, which delegates ``publish_fleet``, ``recover``,
``heartbeat``, ``alive`` and ``clock_offset`` here); joining and leaving are worker/fleet.py's scripts.
"""

from __future__ import annotations

import logging
import time

import redis

from batchfleet.common.keys import Keys
from batchfleet.common.protocol import FleetInfo
from batchfleet.worker import fleet

log = logging.getLogger("batchfleet.worker.consumer")

FLEET_TTL_S = fleet.FLEET_TTL_MS // 1000  # the fleet description outlives its last heartbeat by this much
STATUS_TTL_S = 10

# KEYS: workers (zset), status key, fleet key. ARGV: name, status blob ('' = keep), status ttl, fleet ttl (0:
# none).
# Redis' own clock scores liveness, so no host clock matters. Returns TIME (for this host's clock offset)
# and whether the fleet description still existed (0: the worker publishes it again).
_HEARTBEAT_SCRIPT = """
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now_ms, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now_ms - 86400000)
if ARGV[2] ~= '' then redis.call('SET', KEYS[2], ARGV[2], 'EX', tonumber(ARGV[3])) end
local kept
if tonumber(ARGV[4]) > 0 then kept = redis.call('EXPIRE', KEYS[3], tonumber(ARGV[4]))
else kept = redis.call('EXISTS', KEYS[3]) end  -- a fleet that scales to zero: no TTL
return {t[1], t[2], kept}
"""


class Presence:
    """One worker's fleet membership and heartbeat (thread-safe: the lease keeper calls ``beat`` too)."""

    def __init__(self, r: redis.Redis, keys: Keys, name: str) -> None:
        self.r = r
        self.keys = keys
        self.name = name
        self.info: FleetInfo | None = None  # the description joined (published again when it vanishes)
        self.offset = 0.0  # Redis time - time.time(), refreshed by each heartbeat
        self._script = r.register_script(_HEARTBEAT_SCRIPT)

    def join(self, info: FleetInfo, replace: bool = False) -> None:
        """Publish the fleet description (FleetConflict when live workers serve another fingerprint, unless
        ``replace``) and mark this worker live."""
        fleet.join(self.r, self.keys, info, self.name, replace)
        self.info = info
        self.beat(b"")

    def rejoin(self) -> None:
        """Publish the joined description again (Redis lost it); a conflicting fleet is logged, not raised."""
        if self.info is not None:
            try:
                fleet.join(self.r, self.keys, self.info, self.name)
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
        return fleet.leave(self.r, self.keys, self.name, keep=keep)

    def beat(self, status: bytes) -> None:
        """Mark this worker live, renew the fleet description's TTL and (non-empty ``status``) publish the
        status for STATUS_TTL_S; measures the clock offset on the way."""
        before = time.time()
        t = self._script(keys=[self.keys.workers, self.keys.worker(self.name), self.keys.fleet],
                         args=[self.name, status, STATUS_TTL_S, self.fleet_ttl_s()])
        after = time.time()
        self.offset = int(t[0]) + int(t[1]) / 1e6 - (before + after) / 2
        if int(t[2]) == 0 and self.info is not None:  # the description is gone (deleted, or expired)
            log.warning("the fleet description was missing: publishing it again")
            self.rejoin()
