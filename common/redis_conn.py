"""Redis client factories: every batchfleet process builds its clients here, from a plain URL or from a
Sentinel URL, so a fleet behind Redis Sentinel follows a failover to the new primary.

Sentinel URL: ``redis+sentinel://[user:password@]host:26379[,host2:26379...]/<master name>[/<db>]``.
The credentials are those of the Redis data nodes (Sentinels themselves are reached without a
password; add ``?sentinel_password=...`` when they have one). Every connection is asked of the
Sentinels for the current primary; a connection broken by a failover (or one that finds the old
primary demoted: READONLY) raises a ConnectionError, which callers already retry (common/retry.py).
"""

from __future__ import annotations

from typing import Any

import redis
import redis.asyncio as aredis
import redis.asyncio.sentinel as asentinel
import redis.sentinel as ssentinel

from batchfleet.common.redis_url import SentinelURL, is_sentinel, parse_sentinel_url

WAIT_TIMEOUT_MS = 2_000  # how long one WAIT (--wait-replicas) may block for replica acknowledgements


def _sentinel_kwargs(s: SentinelURL, kw: dict[str, Any]) -> dict[str, Any]:
    """Timeouts of the data connections also bound the Sentinel queries (a dead Sentinel must not hang)."""
    out = {k: kw[k] for k in ("socket_timeout", "socket_connect_timeout") if k in kw}
    if s.sentinel_password:
        out["password"] = s.sentinel_password
    return out


def _node_kwargs(s: SentinelURL, kw: dict[str, Any]) -> dict[str, Any]:
    out = dict(kw, db=s.db)
    if s.username:
        out["username"] = s.username
    if s.password:
        out["password"] = s.password
    return out


def sync_client(url: str, **kw: Any) -> redis.Redis:
    """A redis-py client for ``url`` (plain or Sentinel); ``kw`` go to every connection."""
    if not is_sentinel(url):
        return redis.Redis.from_url(url, **kw)
    s = parse_sentinel_url(url)
    manager = ssentinel.Sentinel(list(s.sentinels), sentinel_kwargs=_sentinel_kwargs(s, kw))
    return manager.master_for(s.service, **_node_kwargs(s, kw))


class _BlockingSentinelPool(asentinel.SentinelConnectionPool, aredis.BlockingConnectionPool):
    """A Sentinel-managed pool that waits for a free connection instead of raising at max_connections."""


def async_client(url: str, *, max_connections: int | None = None, **kw: Any) -> aredis.Redis:
    """An asyncio client for ``url`` (plain or Sentinel). With ``max_connections`` the pool is bounded and
    blocking (a caller waits for a free connection, without a pool timeout)."""
    if not is_sentinel(url):
        if max_connections is None:
            return aredis.Redis.from_url(url, **kw)
        return aredis.Redis(connection_pool=aredis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=None, **kw))
    s = parse_sentinel_url(url)
    manager = asentinel.Sentinel(list(s.sentinels), sentinel_kwargs=_sentinel_kwargs(s, kw))
    node = _node_kwargs(s, kw)
    if max_connections is None:
        return manager.master_for(s.service, **node)
    return manager.master_for(s.service, connection_pool_class=_BlockingSentinelPool,
                              max_connections=max_connections, timeout=None, **node)




class NotReplicated(redis.ConnectionError):
    """A write that fewer than ``--wait-replicas`` replicas acknowledged in time. A ConnectionError, so
    every caller's retry (common/retry.py TRANSIENT) repeats the write, which is idempotent: an enqueue
    keeps its job id (the worker answers once), a reply its first-writer-wins marker."""


def require_replicas(acked: Any, wanted: int, what: str) -> None:
    """Raise NotReplicated when WAIT answered fewer than ``wanted`` replicas."""
    if int(acked) < wanted:
        raise NotReplicated(f"{what}: {int(acked)} of {wanted} replicas acknowledged within {WAIT_TIMEOUT_MS} ms")


async def write_acked(r: aredis.Redis, replicas: int, command: Any, what: str = "write") -> Any:
    """``await command(client)``, then, with ``replicas`` > 0, Redis ``WAIT replicas`` on the SAME connection
    (one pipeline: WAIT counts the replicas that have every earlier write of its connection). Returns the
    command's answer; raises NotReplicated when too few replicas acknowledged."""
    if replicas <= 0:
        return await command(r)
    async with r.pipeline(transaction=False) as pipe:  # gives its connection back however it ends
        await command(pipe)  # a pipeline's command only queues (awaiting the pipeline returns it)
        pipe.execute_command("WAIT", replicas, WAIT_TIMEOUT_MS)
        answer, acked = await pipe.execute()
    require_replicas(acked, replicas, what)
    return answer
