"""Where a worker keeps the kernel choices it measured (worker/engine/native/kernel_cache.py): the fleet's Redis
(``Keys.kernel_choices``: a pod has no disk that outlives it, and every worker of one CPU kind shares them) and
this host's cache dir (``<cache_dir>/kernels/choices-<fingerprint>.json``: a worker without Redis' copy, or
before another worker of its kind wrote it).

Neither is needed: a Redis that does not answer, refuses the key (an ACL without ``~<ns>:kernels:*``) or holds
something else only costs the measurement (logged once, never raised).
"""

from __future__ import annotations

import logging

import redis

from batchfleet.common.config import WorkerConfig
from batchfleet.common.redis.clients import sync_client
from batchfleet.worker.engine.native.kernel_cache import REDIS_TTL_S, KernelChoices

log = logging.getLogger(__name__)

TIMEOUT_S = 5.0  # a start waits at most this long per Redis call for a cache it can do without


class KernelStore:
    """The kernel choices of ``cfg``'s fleet and cache dir, read into ``choices`` at start (``read``) and written
    back where they lack what ``choices`` holds then (``write``). ``fleet``: use Redis (False: the in-process
    benchmark transport, whose fleet has no Redis)."""

    def __init__(self, cfg: WorkerConfig, choices: KernelChoices, fleet: bool = True) -> None:
        self.cfg, self.choices, self.fleet = cfg, choices, fleet
        self.key = cfg.keys.kernel_choices(choices.fingerprint)
        self.in_redis: set[str] = set()
        self.in_file: set[str] = set()

    def _client(self) -> redis.Redis:
        return sync_client(self.cfg.connection.redis_url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S)

    def read(self) -> None:
        c = self.choices
        self.in_file = set(c.load_file(self.cfg.engine.cache_dir))
        if self.fleet:
            try:
                r = self._client()
                try:
                    raw = r.get(self.key)
                finally:
                    r.close()
            except (redis.RedisError, OSError) as exc:
                log.info("kernel choices not read from Redis (%s): measured where not cached here", exc)
            else:
                entries = c.parse(raw, f"Redis {self.key}")
                c.merge(entries)
                self.in_redis = set(entries)
        log.info("kernel choices for this CPU kind (%s): %d cached (%d in Redis)", c.fingerprint, len(c.entries),
                 len(self.in_redis))

    def write(self) -> None:
        c = self.choices
        if not set(c.entries) <= self.in_file:
            c.save_file(self.cfg.engine.cache_dir)
            self.in_file = set(c.entries)
        if not self.fleet or set(c.entries) <= self.in_redis:
            return
        try:
            r = self._client()
            try:
                c.merge(c.parse(r.get(self.key), f"Redis {self.key}"))  # what other workers wrote since: kept
                r.set(self.key, c.document(), ex=REDIS_TTL_S)
            finally:
                r.close()
        except (redis.RedisError, OSError) as exc:
            log.info("kernel choices not written to Redis (%s)", exc)
        else:
            self.in_redis = set(c.entries)
            log.info("kernel choices of this CPU kind written to Redis (%s: %d entries)", self.key, len(c.entries))
