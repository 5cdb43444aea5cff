"""Redis client factories: every batchfleet process builds its clients here, from a plain URL, a Sentinel
URL (a fleet behind Redis Sentinel follows a failover to the new primary) or a Redis Cluster URL.

Sentinel URL: ``redis+sentinel://[user:password@]host:26379[,host2:26379...]/<master name>[/<db>]``.
The credentials are those of the Redis data nodes (Sentinels themselves are reached without a
password; add ``?sentinel_password=...`` when they have one). Every connection is asked of the
Sentinels for the current primary; a connection broken by a failover (or one that finds the old
primary demoted: READONLY) raises a ConnectionError, which callers already retry (common/redis/retry.py).

Cluster URL: ``redis+cluster://[user:password@]host:port[,host2:port...]``: a few seed nodes; redis-py's
cluster clients learn the slot map from them and follow MOVED/ASK and failovers. A cluster fleet's keys
carry the namespace as a hash tag (common/keys.py), so every script and pipeline touches one slot.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import redis
import redis.asyncio as aredis
import redis.asyncio.cluster as acluster
import redis.asyncio.sentinel as asentinel
import redis.cluster as scluster
import redis.sentinel as ssentinel
from redis.crc import key_slot

from batchfleet.common.redis.url import SentinelURL, is_cluster, is_sentinel, parse_cluster_url, parse_sentinel_url

WAIT_TIMEOUT_MS = 2_000  # how long one WAIT (--wait-replicas) may block for replica acknowledgements


def _sentinel_kwargs(s: SentinelURL, kw: dict[str, Any]) -> dict[str, Any]:
    """Timeouts of the data connections also bound the Sentinel queries (a dead Sentinel must not hang)."""
    out: dict[str, Any] = {k: kw[k] for k in ("socket_timeout", "socket_connect_timeout") if k in kw}
    if s.sentinel_password:
        out["password"] = s.sentinel_password
    return out


def _with_credentials(kw: dict[str, Any], username: str | None, password: str | None, **more: Any) -> dict[str, Any]:
    """``kw`` and ``more``, plus the URL's user and password where it has them (data-node connections)."""
    out = dict(kw, **more)
    if username:
        out["username"] = username
    if password:
        out["password"] = password
    return out


def _node_kwargs(s: SentinelURL, kw: dict[str, Any]) -> dict[str, Any]:
    return _with_credentials(kw, s.username, s.password, db=s.db)


def _cluster_kwargs(url: str, kw: dict[str, Any], node: type) -> dict[str, Any]:
    """A cluster client's arguments: the URL's seed nodes as ``node`` objects (sync or asyncio), its
    credentials, and ``kw``."""
    c = parse_cluster_url(url)
    return _with_credentials(kw, c.username, c.password, startup_nodes=[node(h, p) for h, p in c.nodes])


def fleet_slot(args: tuple[Any, ...]) -> int | None:
    """The slot of a command whose keys redis-py would otherwise learn by asking the server (``COMMAND
    GETKEYS``: one more round trip per call, and racy in its asyncio client): FCALL and XREAD(GROUP). A fleet's
    keys share one hash tag, so the first key decides. None: let redis-py decide."""
    name = str(args[0]).upper() if args else ""
    if name in ("FCALL", "FCALL_RO") and len(args) > 3 and int(args[2]) > 0:
        return key_slot(_encoded(args[3]))
    if name in ("XREAD", "XREADGROUP"):
        first = next((i + 1 for i, a in enumerate(args) if isinstance(a, str) and a.upper() == "STREAMS"), len(args))
        if first < len(args):
            return key_slot(_encoded(args[first]))
    return None


def _encoded(key: Any) -> bytes:
    return key if isinstance(key, bytes) else str(key).encode()


class _FleetCluster(scluster.RedisCluster):
    def determine_slot(self, *args: Any) -> int | None:
        slot = fleet_slot(args)
        return super().determine_slot(*args) if slot is None else slot


class _AsyncFleetCluster(acluster.RedisCluster):
    async def _determine_slot(self, command: str, *args: Any) -> int:
        slot = fleet_slot((command, *args))
        return await super()._determine_slot(command, *args) if slot is None else slot


def sync_client(url: str, wrap_connection: Callable[[type], type] | None = None, **kw: Any) -> redis.Redis:
    """A redis-py client for ``url`` (plain, Sentinel or Cluster); ``kw`` go to every connection.
    ``wrap_connection``: applied to the connection class of every pool the client makes (the worker's reply guard,
    worker/transport/reply_guard.py): the class the URL picked (TCP, TLS, Unix socket, Sentinel-managed), or each
    cluster
    node's (redis-py's cluster client passes a ``connection_class`` on, but not a ``parser_class``)."""
    if is_cluster(url):
        if wrap_connection is not None:
            kw = dict(kw, connection_class=wrap_connection(redis.Connection))
        return _FleetCluster(**_cluster_kwargs(url, kw, scluster.ClusterNode))
    if not is_sentinel(url):
        r = redis.Redis.from_url(url, **kw)
    else:
        s = parse_sentinel_url(url)
        manager = ssentinel.Sentinel(list(s.sentinels), sentinel_kwargs=_sentinel_kwargs(s, kw))
        r = manager.master_for(s.service, **_node_kwargs(s, kw))
    if wrap_connection is not None:  # no connection is made before the first command
        r.connection_pool.connection_class = wrap_connection(r.connection_pool.connection_class)
    return r


class _BlockingSentinelPool(asentinel.SentinelConnectionPool, aredis.BlockingConnectionPool):
    """A Sentinel-managed pool that waits for a free connection instead of raising at max_connections."""


def async_client(url: str, *, max_connections: int | None = None, **kw: Any) -> aredis.Redis:
    """An asyncio client for ``url`` (plain or Sentinel). With ``max_connections`` the pool is bounded and
    blocking (a caller waits for a free connection, without a pool timeout); a cluster client's pools are not
    bounded (redis-py's async cluster client raises at its limit instead of waiting)."""
    if is_cluster(url):
        return _AsyncFleetCluster(**_cluster_kwargs(url, kw, acluster.ClusterNode))
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




async def close_async(r: aredis.Redis) -> None:
    """Close a client from ``async_client`` with its connections: a client made on a given pool (the bounded
    and the Sentinel ones) leaves that pool open, so it is disconnected too; a cluster client has no single
    pool (its ``aclose`` closes every node's)."""
    await r.aclose()
    if (pool := getattr(r, "connection_pool", None)) is not None:
        await pool.disconnect()


class NotReplicated(redis.ConnectionError):
    """A write that fewer than ``--wait-replicas`` replicas acknowledged in time. A ConnectionError, so
    every caller's retry (common/redis/retry.py TRANSIENT) repeats the write, which is idempotent: an enqueue
    keeps its job id (the worker answers once), a reply its first-writer-wins marker."""


def same_node(r: Any, key: str) -> dict[str, Any]:
    """Options that send a keyless command (``WAIT`` after writes to ``key``, ``TIME`` to read the clock that
    stamps ``key``'s entries) to the master of ``key``'s slot on a cluster; redis-py would pick any node.
    Empty for one Redis."""
    node_of = getattr(r, "get_node_from_key", None)
    if node_of is None:
        return {}
    try:
        return {"target_nodes": node_of(key)}
    except redis.exceptions.SlotNotCoveredError:  # an asyncio cluster client before its first command: no map yet
        return {}


def xread(r: Any, streams: dict[str, Any], count: int, block: int | None = None,
          group: tuple[str, str] | None = None) -> Any:
    """``XREAD`` (``XREADGROUP`` with ``group`` = (group, consumer)) of ``streams`` {key: id}, all in one slot,
    answered as redis-py's own ``xread`` / ``xreadgroup`` (sync or asyncio client). On a cluster it goes
    straight to the slot's master: redis-py's would first ask a node twice which keys the command names
    (``COMMAND GETKEYS``: two more round trips per read)."""
    return r.execute_command(*xread_args(streams, count, block, group), **same_node(r, next(iter(streams))))


def xread_args(streams: dict[str, Any], count: int, block: int | None = None,
               group: tuple[str, str] | None = None) -> list[Any]:
    """The command ``xread`` sends (for a pipeline of reads)."""
    head = ["XREADGROUP", "GROUP", *group] if group else ["XREAD"]
    return [*head, "COUNT", count, *(["BLOCK", block] if block is not None else []), "STREAMS", *streams,
            *streams.values()]


def create_groups(r: Any, group: str, streams: list[str]) -> None:
    """Consumer group ``group`` on each of ``streams`` (made empty when missing), reading from the start, in one
    pipeline; a group there already stays as it is (BUSYGROUP), any other refusal is raised."""
    if not streams:
        return
    pipe = r.pipeline(transaction=False)
    for stream in streams:
        pipe.xgroup_create(stream, group, id="0", mkstream=True)
    for got in pipe.execute(raise_on_error=False):
        if isinstance(got, redis.ResponseError) and "BUSYGROUP" not in str(got):
            raise got


def require_replicas(acked: Any, wanted: int, what: str) -> None:
    """Raise NotReplicated when WAIT answered fewer than ``wanted`` replicas."""
    if int(acked) < wanted:
        raise NotReplicated(f"{what}: {int(acked)} of {wanted} replicas acknowledged within {WAIT_TIMEOUT_MS} ms")


async def write_acked(r: aredis.Redis, replicas: int, command: Any, key: str, what: str = "write") -> Any:
    """``await command(client)``, then, with ``replicas`` > 0, Redis ``WAIT replicas`` on the SAME connection
    (one pipeline: WAIT counts the replicas that have every earlier write of its connection; ``key``: one the
    command writes, which places the WAIT on a cluster). Returns the command's answer; raises NotReplicated
    when too few replicas acknowledged."""
    if replicas <= 0:
        return await command(r)
    async with r.pipeline(transaction=False) as pipe:  # gives its connection back however it ends
        queued = command(pipe)  # a pipeline's command only queues; awaiting a cluster pipeline would run it
        if queued is not pipe and inspect.isawaitable(queued):  # a Script call: a coroutine that queues
            await queued
        pipe.execute_command("WAIT", replicas, WAIT_TIMEOUT_MS, **same_node(r, key))
        answer, acked = await pipe.execute()
    require_replicas(acked, replicas, what)
    return answer
