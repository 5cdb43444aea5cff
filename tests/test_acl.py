"""Security: docs/SECURITY.md's ACL block installs on Redis 7 as pasted into redis-cli, each attack of a
hostile producer is refused (NOPERM), what ACLs cannot refuse behaves as documented, and a fleet runs end
to end under the documented users. Also: no pickle anywhere in the code that touches the wire."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import pytest
import redis

from batchfleet.common.keys import Keys
from batchfleet.common.redis.functions import FUNCTION_NAMES, LIBRARY_NAME
from tests.helpers.acl import BUCKETS, NAMESPACE, acl_block, connect, install_documented_acl, start_redis7

K = Keys(NAMESPACE)
INBOX = K.inbox("Zq3xV9bN1sT7yU5wE2rK4m")  # some other client's inbox
ENQUEUE, CANCEL = FUNCTION_NAMES["enqueue"], FUNCTION_NAMES["cancel"]
BUSY_LOOP = "local i = 0 while true do i = i + 1 end"


@pytest.fixture(scope="module")
def server():
    """A private Redis 7 with the documented users and library; Lua is 'busy' after 100 ms (busy test);
    DEBUG enabled, so that the ACL is what refuses it."""
    srv = start_redis7("--busy-reply-threshold", "100", "--enable-debug-command", "yes")
    try:
        install_documented_acl(srv)
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def producer(server):
    r = connect(server, "producer-a", decode_responses=True)
    yield r
    r.close()


def enqueue(r: redis.Redis, stream: str, max_len: int = 0, payload: str = "p", max_payload: int = 1 << 20):
    return r.fcall(ENQUEUE, 2, stream, K.workers, max_len, "job1", INBOX, payload, max_payload, 0, 30_000)


def test_documented_users_exist_with_their_library(server):
    admin = connect(server, "bf-admin-a", decode_responses=True)
    assert [dict(zip(lib[::2], lib[1::2]))["library_name"] for lib in admin.function_list()] == [LIBRARY_NAME]
    assert {u for u in redis.Redis(port=server.port, decode_responses=True).acl_users()} >= {
        "bf-admin-a", "worker-a", "producer-a", "gateway-a"}
    with pytest.raises(redis.exceptions.NoPermissionError):
        admin.get(K.fleet)  # the admin has no key access at all


def test_the_block_has_no_command_redis_7_0_refuses():
    assert "client|setinfo" not in acl_block()  # refused by 7.0.15: the whole line would fail
    assert all(line.startswith("ACL SETUSER ") and "\\" not in line for line in acl_block().strip().splitlines())


REFUSED = [
    # own Lua: a busy loop would answer BUSY to every tenant
    ("EVAL", BUSY_LOOP, 0), ("SCRIPT", "LOAD", BUSY_LOOP), ("SCRIPT", "KILL"), ("SCRIPT", "FLUSH"),
    ("FUNCTION", "LOAD", f"#!lua name=evil\nredis.register_function('x', function() {BUSY_LOOP} end)"),
    ("FUNCTION", "DELETE", LIBRARY_NAME), ("FUNCTION", "FLUSH"), ("FUNCTION", "KILL"), ("FCALL_RO", ENQUEUE, 0),
    # trim or delete a stream
    ("XTRIM", K.stream(128), "MAXLEN", 0), ("DEL", K.stream(128)), ("UNLINK", K.stream(128)),
    ("XGROUP", "DESTROY", K.stream(128), "workers"), ("FLUSHALL",), ("FLUSHDB",),
    ("XGROUP", "SETID", K.stream(128), "workers", "$"),
    # keys outside the patterns: junk streams, other keys of the namespace, forged replies, tenant b
    ("XADD", K.stream(128) + "junk", "*", "id", "x"), ("XADD", "a:stream:junk", "*", "id", "x"),
    ("XADD", K.fleet, "*", "id", "x"), ("XADD", K.dead, "*", "id", "x"), ("XADD", K.done("x", INBOX), "*", "id", "x"),
    ("XADD", K.workers, "*", "id", "x"), ("XADD", INBOX, "*", "id", "x", "p", "forged"),
    ("XADD", Keys("b").stream(128), "*", "id", "x"), ("SET", K.fleet, "x"), ("SET", INBOX, "1"),
    ("ZADD", K.workers, 1, "fake-worker"), ("GET", Keys("b").fleet), ("XREAD", "STREAMS", Keys("b").inbox("x" * 22), 0),
    ("FCALL", ENQUEUE, 2, "a:stream:junk", K.workers, 0, "j", INBOX, "p", 100, 0, 1),
    ("FCALL", ENQUEUE, 2, K.dead, K.workers, 0, "j", INBOX, "p", 100, 0, 1),
    # finding inboxes: key listing, monitoring, and every key whose content names one
    ("KEYS", "*"), ("SCAN", 0), ("SCAN", 0, "MATCH", "a:inbox:*"), ("RANDOMKEY",), ("MONITOR",),
    ("CLIENT", "LIST"), ("CLIENT", "KILL", "TYPE", "normal"), ("DEBUG", "OBJECT", INBOX), ("INFO",),
    ("TYPE", INBOX), ("EXISTS", INBOX), ("XINFO", "STREAM", K.stream(128)),
    ("XINFO", "STREAM", K.stream(128, "background")), ("XINFO", "GROUPS", K.stream(128)), ("XINFO", "GROUPS", INBOX),
    ("OBJECT", "ENCODING", INBOX),
    ("XRANGE", K.stream(128), "-", "+"), ("XREVRANGE", K.stream(128), "+", "-"),
    ("XREAD", "STREAMS", K.stream(128), 0), ("XREADGROUP", "GROUP", "workers", "x", "STREAMS", K.stream(128), ">"),
    ("XREAD", "STREAMS", K.cancels, 0), ("XRANGE", K.cancels, "-", "+"), ("GET", K.cancel("job1")),
    ("SET", K.cancel("job1"), INBOX, "GET"), ("DUMP", INBOX), ("GET", K.worker("w1")),
    # everything else
    ("CONFIG", "GET", "*"), ("ACL", "LIST"), ("ACL", "WHOAMI"), ("SHUTDOWN",), ("PUBLISH", "c", "m"),
    ("SUBSCRIBE", "c"), ("EXPIRE", INBOX, 1),
]


@pytest.mark.parametrize("command", REFUSED, ids=lambda c: " ".join(str(x) for x in c)[:40])
def test_producer_attack_refused(producer, command):
    with pytest.raises(redis.exceptions.NoPermissionError):
        producer.execute_command(*command)


def test_producer_cannot_run_a_script_someone_else_loaded(server, producer):
    sha = connect(server, "worker-a").script_load("return 1")
    with pytest.raises(redis.exceptions.NoPermissionError):
        producer.evalsha(sha, 0)


@pytest.mark.parametrize("command", [("SCRIPT", "KILL"), ("FUNCTION", "KILL"), ("KEYS", "*"), ("SCAN", 0),
                                     ("FLUSHALL",), ("CONFIG", "SET", "maxmemory", "1"), ("EVAL", "return 1", 0),
                                     ("GET", Keys("b").fleet), ("XADD", Keys("b").stream(128), "*", "id", "x"),
                                     ("XREAD", "STREAMS", Keys("b").inbox("x" * 22), 0), ("DEL", K.stream(128))])
def test_worker_cannot_either(server, command):
    with pytest.raises(redis.exceptions.NoPermissionError):
        connect(server, "worker-a").execute_command(*command)


def test_a_busy_script_is_stopped_by_the_admin_only(server, producer):
    """The attack of the issue, run by the only user left who can run Lua (the trusted worker): Redis
    answers BUSY to everyone, neither producer nor worker may kill it, the admin can."""
    def busy() -> None:
        try:
            worker = connect(server, "worker-a")
            worker.evalsha(worker.script_load(BUSY_LOOP), 0)
        except redis.ResponseError:
            pass  # "Script killed by user with SCRIPT KILL..."

    runner = threading.Thread(target=busy, daemon=True)
    runner.start()
    deadline = time.monotonic() + 10
    while True:  # BUSY once the script ran past busy-reply-threshold (100 ms)
        try:
            producer.ping()
        except redis.exceptions.BusyLoadingError:
            pass
        except redis.ResponseError as exc:
            if "BUSY" in str(exc):
                break
            raise
        assert time.monotonic() < deadline, "the script never made Redis busy"
        time.sleep(0.05)
    for user in ("producer-a", "worker-a"):
        with pytest.raises(redis.exceptions.NoPermissionError):
            connect(server, user).script_kill()
    assert connect(server, "bf-admin-a").script_kill()
    runner.join(10)
    assert producer.ping()


def test_enqueue_and_cancel_functions_run_as_the_producer(server, producer):
    assert enqueue(producer, K.stream(256)) == 1
    assert producer.xlen(K.stream(256)) == 1
    assert producer.fcall(CANCEL, 2, K.cancel("job1"), K.cancels, "job1", INBOX, 60, 100) == 1
    assert producer.set(K.cancel("job2"), INBOX, ex=60)  # write-only markers: set, never read back
    assert producer.xread({INBOX: 0}, block=10) == [] and producer.xdel(INBOX, "1-1") == 0
    assert producer.get(K.fleet) is None  # readable, not published yet
    assert producer.execute_command("TIME")
    # a bulk run reads its background streams' group position (producer/bulk/queued.py): ids and counts only
    enqueue(producer, K.stream(256, "background"))
    assert producer.xinfo_groups(K.stream(256, "background")) == []  # no group yet: none made by the producer
    with pytest.raises(redis.ResponseError, match="no such key"):  # a tenant's too: allowed, not there yet
        producer.xinfo_groups(K.stream(256, "background", "acme"))


def test_the_gateway_takes_renews_and_releases_a_batch_lease(server):
    """gateway-a may run the lease functions (GET + PEXPIRE / DEL inside, issue 31) and, while the loaded
    library lacks them, the same bodies by EVALSHA; the producer may do neither."""
    from batchfleet.common.redis.functions import LEASE_BODIES, LEASE_FUNCTION_NAMES

    gateway = connect(server, "gateway-a")
    lease = K.batch_lease("batch_" + "1" * 24)
    assert gateway.set(lease, "mine", nx=True, px=10_000)
    assert gateway.fcall(LEASE_FUNCTION_NAMES["lease_renew"], 1, lease, "mine", 60_000) == 1
    assert 10_000 < redis.Redis(port=server.port).pttl(lease) <= 60_000  # (gateway-a has no PTTL)
    renew = gateway.register_script(LEASE_BODIES["lease_renew"])
    assert renew(keys=[lease], args=["mine", 30_000]) == 1
    assert gateway.fcall(LEASE_FUNCTION_NAMES["lease_release"], 1, lease, "mine") == 1
    assert [e for e in redis.Redis(port=server.port, decode_responses=True).acl_log()
            if e["username"] == "gateway-a"] == []
    with pytest.raises(redis.exceptions.NoPermissionError):
        connect(server, "producer-a").fcall(LEASE_FUNCTION_NAMES["lease_renew"], 1, lease, "x", 1)
    gateway.close()


def test_what_acls_cannot_refuse(server, producer):
    """docs/SECURITY.md, "What ACLs cannot refuse": XADD's arguments are not checked by ACLs."""
    stream = K.stream(512)
    assert enqueue(producer, stream, max_len=1) == 1
    assert enqueue(producer, stream, max_len=1) == 0  # the queue limit, as the function applies it
    producer.xadd(stream, {"id": "raw", "r": INBOX, "p": "x"})  # ... and a raw XADD past it
    assert producer.xlen(stream) == 2
    assert enqueue(producer, stream, payload="x" * 100, max_payload=10) == -2  # the payload cap, bypassed:
    big = producer.xadd(stream, {"id": "big", "r": INBOX, "p": "x" * 100})
    assert producer.xdel(stream, big) == 1  # XDEL of a waiting entry (the client's withdrawal of an add past the limit)
    producer.xadd(stream, {"id": "x"}, maxlen=0, approximate=False)  # XADD MAXLEN 0 empties the queue
    assert producer.xlen(stream) == 0
    assert enqueue(producer, stream, max_len=0, max_payload=1 << 30) == 1  # FCALL with arguments of its own
    assert producer.xadd(K.cancels, {"id": "x"}, maxlen=0, approximate=False)


def test_acl_block_names_every_bucket_stream_of_the_fleet():
    streams = set(re.findall(r"~a:stream:(\d+)", acl_block()))
    assert streams == {str(b) for b in BUCKETS}


def test_no_pickle_in_wire_code():
    root = Path(__file__).resolve().parents[1]
    offenders = [str(p) for d in ("common", "producer", "worker") for p in (root / d).rglob("*.py")
                 if re.search(r"^\s*(import|from)\s+(c?pickle|dill|cloudpickle)\b|torch\.load\(",
                              p.read_text(), re.M)]
    assert offenders == []


def test_tls_and_acl_users_go_through_the_url():
    """rediss:// gives TLS connections with the URL's user and password in the worker and the clients
    (``Client`` runs an ``AsyncClient``; the bundled redis-server is built without TLS, so the handshake
    itself is not exercised here)."""
    from batchfleet.common.config import ConnectionConfig
    from batchfleet.producer import AsyncClient
    from batchfleet.worker.transport.consumer import connect as worker_connect

    url = "rediss://worker-a:s3cret@redis.example:6380/0?ssl_cert_reqs=required"
    client = AsyncClient(url)
    pools = [worker_connect(ConnectionConfig(redis_url=url)).connection_pool, client.r.connection_pool,
             client.inbox.reader.connection_pool]
    for pool in pools:
        assert "SSL" in pool.connection_class.__name__
        assert pool.connection_kwargs["username"] == "worker-a" and pool.connection_kwargs["password"] == "s3cret"
