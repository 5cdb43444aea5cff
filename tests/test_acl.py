"""Security: least-privilege ACL users (the ones docs/SECURITY.md gives) run the fleet on a private
redis-server; two namespaces (tenants) share it without cross-talk and cannot read each other's keys.
Also: no pickle anywhere in the code that touches the wire."""

from __future__ import annotations

import logging
import re
import time
import uuid
from pathlib import Path

import pytest
import redis

from batchfleet.common.devtools import PrivateRedis, free_port
from batchfleet.common.errors import JobFailed
from batchfleet.common.keys import Keys
from batchfleet.producer import Client
from tests.conftest import worker_config
from tests.test_reliability_helpers import POISON_TOKEN, LoopThread, PoisonEngine

# Exactly the rules of docs/SECURITY.md (keep the two in sync).
WORKER_COMMANDS = ("+ping +client|setinfo +multi +exec +discard +xgroup|create +xreadgroup +xautoclaim +xpending "
                   "+xclaim +xack +xdel +xadd +xrange +xinfo|consumers +xgroup|delconsumer +set +get +del +exists "
                   "+evalsha +script|load +script|exists +rpush +expire")
PRODUCER_COMMANDS = "+ping +client|setinfo +get +evalsha +script|load +script|exists +xlen +xadd +blpop"


def worker_acl(ns: str) -> str:
    keys = " ".join(f"~{ns}:{k}" for k in ("stream:*", "reply:*", "done:*", "fleet", "worker:*", "batches",
                                           "dead", "flush"))
    return f"resetkeys {keys} resetchannels -@all {WORKER_COMMANDS}"


def producer_acl(ns: str, redis7: bool) -> str:
    fleet = f"%R~{ns}:fleet" if redis7 else f"~{ns}:fleet"  # read-only key selectors need Redis >= 7
    return f"resetkeys {fleet} ~{ns}:stream:* ~{ns}:reply:* resetchannels -@all {PRODUCER_COMMANDS}"


@pytest.fixture
def acl_redis():
    server = PrivateRedis(port=free_port()).start()
    yield server
    server.stop()


def _user_url(server: PrivateRedis, user: str, password: str) -> str:
    return f"redis://{user}:{password}@127.0.0.1:{server.port}/0"


def test_fleet_runs_under_least_privilege_acl_users_tenants_isolated(acl_redis, tiny_model_dir, cache_dir, caplog):
    caplog.set_level(logging.WARNING)
    admin = redis.Redis.from_url(acl_redis.url)
    redis7 = int(admin.info("server")["redis_version"].split(".")[0]) >= 7
    tenants = [f"ta{uuid.uuid4().hex[:4]}", f"tb{uuid.uuid4().hex[:4]}"]
    urls = {}
    for ns in tenants:
        admin.execute_command("ACL", "SETUSER", f"worker-{ns}", "on", f">wpw-{ns}", *worker_acl(ns).split())
        admin.execute_command("ACL", "SETUSER", f"producer-{ns}", "on", f">ppw-{ns}", *producer_acl(ns, redis7).split())
        urls[ns] = (_user_url(acl_redis, f"worker-{ns}", f"wpw-{ns}"),
                    _user_url(acl_redis, f"producer-{ns}", f"ppw-{ns}"))
    # PoisonEngine (test only) drives the redelivery commands too: release, reclaim, pending, dead letter
    workers = [LoopThread(worker_config(urls[ns][0], ns, tiny_model_dir, max_wait_ms=10, claim_idle_ms=400,
                                        max_deliveries=2), PoisonEngine) for ns in tenants]
    try:
        answers, poisons = {}, {}
        for ns in tenants:
            with Client(urls[ns][1], ns) as client:
                answers[ns] = [client.generate([10 + i, 11], max_new_tokens=2, timeout=30) for i in range(3)]
                poisons[ns] = client.submit([5, POISON_TOKEN], max_new_tokens=2)
                with pytest.raises(JobFailed, match="worker_failed"):
                    client.result(poisons[ns], timeout=30)
                time.sleep(0.3)  # let the lease keeper renew at least once
                with pytest.raises(redis.exceptions.NoPermissionError):
                    client.r.flushall()
    finally:
        for w in workers:
            w.stop()
    a, b = tenants
    for ns, w in zip(tenants, workers):
        assert {res.worker for res in answers[ns]} == {w.loop.transport.name}  # served by its own fleet only
        assert w.loop.counters["completed"] == 3 and w.loop.counters["internal_errors"] == 0
        assert w.loop.counters["reclaimed"] == 1 and w.lease_failures == 0
    denied = [rec.getMessage() for rec in caplog.records if rec.levelno >= logging.WARNING
              and ("unavailable" in rec.getMessage() or "NOPERM" in rec.getMessage())]
    assert denied == []
    # no cross-talk: each tenant's batch log holds only its own jobs
    for ns in tenants:
        logged = {j for _, f in admin.xrange(Keys(ns).batches) for j in f[b"ids"].decode().split(",")}
        assert logged == {res.id for res in answers[ns]} | {poisons[ns]}
        assert {f[b"id"].decode() for _, f in admin.xrange(Keys(ns).dead)} == {poisons[ns]}
    # tenant a's users cannot touch tenant b's keys
    for url in urls[a]:
        other = redis.Redis.from_url(url)
        for cmd, *args in (("GET", Keys(b).fleet), ("XLEN", Keys(b).stream(32)),
                           ("XADD", Keys(b).stream(32), "*", "id", "x"), ("KEYS", "*")):
            with pytest.raises(redis.exceptions.NoPermissionError):
                other.execute_command(cmd, *args)
    # a producer cannot read other tenants' replies nor consume the streams as a worker would
    with pytest.raises(redis.exceptions.NoPermissionError):
        redis.Redis.from_url(urls[a][1]).xreadgroup("workers", "x", {Keys(a).stream(32): ">"})


def test_no_pickle_in_wire_code():
    root = Path(__file__).resolve().parents[1]
    offenders = [str(p) for d in ("common", "producer", "worker") for p in (root / d).rglob("*.py")
                 if re.search(r"^\s*(import|from)\s+(c?pickle|dill|cloudpickle)\b|torch\.load\(",
                              p.read_text(), re.M)]
    assert offenders == []


def test_tls_and_acl_users_go_through_the_url():
    """rediss:// gives TLS connections with the URL's user and password in worker and both clients
    (the bundled redis-server is built without TLS, so the handshake itself is not exercised here)."""
    from batchfleet.common.config import ConnectionConfig
    from batchfleet.producer import AsyncClient
    from batchfleet.worker.consumer import connect

    url = "rediss://worker-a:s3cret@redis.example:6380/0?ssl_cert_reqs=required"
    pools = [connect(ConnectionConfig(redis_url=url)).connection_pool, Client(url).r.connection_pool,
             AsyncClient(url).r.connection_pool]
    for pool in pools:
        assert "SSL" in pool.connection_class.__name__
        assert pool.connection_kwargs["username"] == "worker-a" and pool.connection_kwargs["password"] == "s3cret"
