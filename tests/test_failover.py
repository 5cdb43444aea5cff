"""Redis failover with real processes on loopback: a primary, a replica and three Sentinels; a real worker
(in a thread) and client load through a ``redis+sentinel://`` URL; the primary is killed -9 under load.

Replication lags under load; on loopback it takes microseconds, so the test makes the lag real: right
before the kill the replica is stalled (SIGSTOP) and cut off for LAG_S while the producers burst (a backlog
builds in Redis). With ``--wait-replicas 1`` no acknowledged request may be lost and no caller gets two
different answers (asserted): an enqueue or reply the replica did not acknowledge is retried (idempotent).
A reply whose WAIT the kill interrupted is rewritten on the new primary, so the client's inbox may hold it
twice; the client drops the second copy (reported as ``written_twice``). Without it, what the dead primary
acknowledged but never replicated is gone: the test prints what was lost (not asserted). The recovery time
(kill -> first acknowledged enqueue on the new primary) is printed for both. The killed node comes back as a
replica of the new primary (what a restarted pod does), so WAIT 1 can be satisfied again.
"""

from __future__ import annotations

import dataclasses
import shutil
import signal
import subprocess
import time
import uuid
from collections import defaultdict
from pathlib import Path

import msgpack
import pytest
import redis

from batchfleet.common.errors import ConfigError
from batchfleet.common.redis.clients import sync_client
from batchfleet.common.redis.url import parse_sentinel_url
from batchfleet.producer import Client
from batchfleet.worker.devtools import PrivateRedis, free_port
from tests.conftest import worker_config
from tests.helpers.load import SteadyLoad
from tests.helpers.loops import LoopThread, wait_until

MASTER = "mymaster"
LAG_S = 0.5  # the replica is cut off this long before the primary is killed
SUBMIT_EVERY_S = 0.05  # per producer thread (4 threads: ~80 requests/s)


def test_sentinel_url_parsing_and_validation():
    s = parse_sentinel_url("redis+sentinel://u:p%40ss@h1:26380,h2/svc/3")
    assert s.sentinels == (("h1", 26380), ("h2", 26379)) and s.service == "svc" and s.db == 3
    assert (s.username, s.password) == ("u", "p@ss")
    assert parse_sentinel_url("redis+sentinel://h:1/m").db == 0
    from batchfleet.common.config import ConnectionConfig

    assert ConnectionConfig("redis+sentinel://h:1,h2:2/m/0", wait_replicas="1").wait_replicas == 1
    for bad in ("redis+sentinel://h:1", "redis+sentinel:///m", "redis+sentinel://h:x/m", "redis+sentinel://h/m/x/y",
                "redis+sentinel://:secret@h:x/m"):
        with pytest.raises(ConfigError) as err:
            ConnectionConfig(bad)
        assert "secret" not in str(err.value)
    with pytest.raises(ConfigError):
        ConnectionConfig(wait_replicas=-1)


class Sentinel:
    """One ``redis-server <conf> --sentinel`` process with short failover timeouts."""

    def __init__(self, directory: Path, master_port: int) -> None:
        self.port = free_port()
        conf = directory / f"sentinel-{self.port}.conf"
        conf.write_text(f"port {self.port}\nbind 127.0.0.1\ndaemonize no\ndir {directory}\n"
                        f"logfile {directory}/sentinel-{self.port}.log\n"
                        f"sentinel monitor {MASTER} 127.0.0.1 {master_port} 2\n"
                        f"sentinel down-after-milliseconds {MASTER} 1000\n"
                        f"sentinel failover-timeout {MASTER} 3000\n"
                        f"sentinel parallel-syncs {MASTER} 1\n")
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        self.proc = subprocess.Popen([binary, str(conf), "--sentinel"], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        self.r = redis.Redis(port=self.port, decode_responses=True)

    def master(self) -> dict:
        return self.r.sentinel_master(MASTER)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(5)


@pytest.fixture
def cluster(tmp_path: Path):
    """(primary, replica, sentinels, url); everything is stopped at teardown."""
    primary = PrivateRedis(port=free_port()).start()
    replica = PrivateRedis(port=free_port()).start()
    replica_r = redis.Redis(port=replica.port, decode_responses=True)
    replica_r.replicaof("127.0.0.1", primary.port)
    wait_until(lambda: replica_r.info("replication")["master_link_status"] == "up", 10, "replication link")
    sentinels = [Sentinel(tmp_path, primary.port) for _ in range(3)]
    servers = [primary, replica]
    try:
        def ready() -> bool:
            try:
                return all(int(s.master()["num-other-sentinels"]) == 2 and int(s.master()["num-slaves"]) == 1
                           for s in sentinels)
            except redis.RedisError:
                return False
        wait_until(ready, 30, "sentinels discover each other and the replica", every_s=0.2)
        url = f"redis+sentinel://{','.join(f'127.0.0.1:{s.port}' for s in sentinels)}/{MASTER}/0"
        yield primary, replica, sentinels, url, servers
    finally:
        for s in sentinels:
            s.stop()
        for srv in servers:
            srv.stop()


def run_failover(cluster, tiny_model_dir: Path, monkeypatch, wait_replicas: int) -> dict:
    primary, replica, sentinels, url, servers = cluster
    monkeypatch.setenv("BATCHFLEET_WAIT_REPLICAS", str(wait_replicas))  # the clients read it (like the CLI)
    ns = f"fo-{uuid.uuid4().hex[:6]}"
    worker = LoopThread(worker_config(url, ns, tiny_model_dir, max_wait_ms=10, max_batch_size=16,
                                      claim_idle_ms=2000, wait_replicas=wait_replicas))
    finals: dict[str, list[str]] = defaultdict(list)  # job id -> text of every final reply its inbox got
    client = Client(url, ns, retry_s=60)
    dispatch = client._async.inbox._dispatch  # observe every reply the reader routes (the client is real)

    def counting(entry_id: str, fields: dict) -> None:
        try:
            reply = msgpack.unpackb(fields.get(b"p", b""), raw=False)
        except Exception:
            reply = {}
        if reply.get("kind") != "delta":
            finals[fields.get(b"id", b"").decode()].append(reply.get("text") or reply.get("code"))
        dispatch(entry_id, fields)

    client._async.inbox._dispatch = counting

    load = SteadyLoad(client, every_s=SUBMIT_EVERY_S)
    acked = load.acked  # (monotonic time, job id) of every enqueue that returned
    try:
        load.start()
        time.sleep(3)
        # replication lags under load: the replica stalls for LAG_S (SIGSTOP), then the primary dies. Writes
        # the primary acknowledged in that window exist nowhere else: the window --wait-replicas closes.
        replica.proc.send_signal(signal.SIGSTOP)
        redis.Redis(port=primary.port).client_kill_filter(_type="replica")  # unsent replication data is dropped
        load.burst.set()
        time.sleep(LAG_S)
        before = len(acked)
        killed_at = time.monotonic()
        primary.kill()
        replica.proc.send_signal(signal.SIGCONT)
        load.burst.clear()
        wait_until(lambda: int(sentinels[0].r.sentinel_get_master_addr_by_name(MASTER)[1]) == replica.port, 30,
                   "failover", every_s=0.05)
        promoted_s = time.monotonic() - killed_at
        # the crashed node restarts as a replica of the new primary (a restarted pod, an operator)
        again = PrivateRedis(port=free_port(), extra_args=("--replicaof", "127.0.0.1", str(replica.port))).start()
        servers.append(again)
        wait_until(lambda: any(t > killed_at + promoted_s for t, _ in acked), 30, "enqueues after the failover",
                   every_s=0.02)
        recovered_s = min(t for t, _ in acked if t > killed_at + promoted_s) - killed_at
        time.sleep(3)
        load.stop()
        assert not load.errors, load.errors
        jobs = [j for _, j in acked]
        # the backlog drains in a few seconds; a lost job never comes
        answered, lost = load.results(within_s=15)
        time.sleep(0.5)  # late duplicates, if any, reach the reader
        twice = sorted(j for j, texts in finals.items() if len(texts) > 1)
        differing = sorted(j for j in twice if len(set(finals[j])) > 1)
        report = {"wait_replicas": wait_replicas, "acknowledged": len(jobs), "before_kill": before,
                  "answered": len(answered), "lost": lost, "written_twice": twice, "differing": differing,
                  "promoted_s": round(promoted_s, 2), "first_ack_after_kill_s": round(recovered_s, 2)}
        print(f"\nfailover report: {dict(report, lost=f'{len(lost)} {lost[:5]}...' if lost else [])}")
        return report
    finally:
        load.stop()
        client.close()
        worker.stop()
        r = sync_client(url)
        for key in r.scan_iter(match=f"{ns}:*", count=1000):
            r.delete(key)
        r.close()


def test_failover_with_wait_replicas_loses_nothing(cluster, tiny_model_dir, monkeypatch):
    report = run_failover(cluster, tiny_model_dir, monkeypatch, wait_replicas=1)
    assert report["acknowledged"] > report["before_kill"] > 0
    assert report["lost"] == [], report
    # a reply whose WAIT the kill interrupted is rewritten on the new primary (the client may not have it);
    # the client's inbox drops the second copy, so the caller gets one answer, and both copies are the same
    assert report["differing"] == [], report
    assert report["first_ack_after_kill_s"] < 30


def test_failover_without_wait_reports_losses(cluster, tiny_model_dir, monkeypatch):
    report = run_failover(cluster, tiny_model_dir, monkeypatch, wait_replicas=0)
    assert report["acknowledged"] > report["before_kill"] > 0
    print(f"without --wait-replicas: {len(report['lost'])} of {report['acknowledged']} acknowledged requests lost, "
          f"{len(report['written_twice'])} replies written twice (the caller sees one)")


def test_wait_replicas_unmet_reply_is_transient_and_rewrite_idempotent(redis_url, namespace):
    """On a Redis without replicas, WAIT 1 answers 0: the worker's reply write raises NotReplicated (a
    transient error: the loop keeps the reply in its outbox), and rewriting it is idempotent."""
    from batchfleet.common.config import ConnectionConfig
    from batchfleet.common.redis.clients import WAIT_TIMEOUT_MS, NotReplicated
    from batchfleet.common.redis.retry import TRANSIENT
    from batchfleet.common.wire.protocol import Error, decode_reply
    from batchfleet.worker.transport.base import Reply
    from batchfleet.worker.transport.consumer import StreamConsumer

    if int(redis.Redis.from_url(redis_url).info("replication")["connected_slaves"]) > 0:
        pytest.skip("this Redis has replicas")
    consumer = StreamConsumer(ConnectionConfig(redis_url, namespace, wait_replicas=1), (32,), "w-wait", 60)
    consumer.setup()
    inbox = consumer.keys.inbox("waitinbox0123456789")
    reply = Reply("job-1", Error("job-1", "engine_error", "first"), 32, "", inbox)
    t0 = time.monotonic()
    with pytest.raises(NotReplicated) as err:
        consumer.settler.write_replies([reply])
    assert isinstance(err.value, TRANSIENT) and time.monotonic() - t0 >= WAIT_TIMEOUT_MS / 1000 * 0.9
    with pytest.raises(NotReplicated):  # the outbox writes it again: it rings again, the answer stays the first
        consumer.settler.write_replies([dataclasses.replace(reply, message=Error("job-1", "engine_error", "second"))])
    assert decode_reply(consumer.r.get(consumer.keys.done("job-1", inbox))).message == "first"
    assert consumer.r.xlen(inbox) == 2
    consumer.close()
