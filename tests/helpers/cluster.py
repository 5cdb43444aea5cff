"""A private Redis Cluster for tests: ``masters`` redis-server processes (7.x, cluster-enabled), optionally
``replicas`` per master, joined with ``redis-cli --cluster create``, as an operator would build one."""

from __future__ import annotations

import random
import socket
import subprocess
import time
from dataclasses import dataclass, field

import redis

from batchfleet.worker.devtools import PrivateRedis
from tests.helpers.acl import redis7_binary, redis_cli

NODE_TIMEOUT_MS = 1500  # how soon a dead master is failed over (small: the failover test waits for it)


def cluster_port() -> int:
    """A free port p (<= 55535) whose bus port p + 10000 is free too (a cluster node listens on both)."""
    for _ in range(200):
        port = random.randint(20_000, 45_000)
        try:
            for p in (port, port + 10_000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


@dataclass
class PrivateCluster:
    masters: int = 3
    replicas: int = 0
    nodes: list[PrivateRedis] = field(default_factory=list)

    @property
    def url(self) -> str:
        """The fleet's URL: every node as a seed."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self, timeout_s: float = 30.0) -> PrivateCluster:
        cli = redis_cli()
        if cli is None:
            raise RuntimeError("a Redis Cluster test needs redis-cli (apt-get install redis-tools)")
        binary = redis7_binary()
        for _ in range(self.masters * (1 + self.replicas)):
            self.nodes.append(PrivateRedis(port=cluster_port(), binary=binary, extra_args=(
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(NODE_TIMEOUT_MS), "--appendonly", "no")).start())
        subprocess.run([cli, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
                        "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                       check=True, capture_output=True, timeout=60)
        self.wait_ok(timeout_s)
        return self

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Until every live node says cluster_state:ok and sees every slot served."""
        deadline = time.monotonic() + timeout_s
        while True:
            states = []
            for n in self.nodes:
                if n.proc is None or n.proc.poll() is not None:
                    continue
                try:
                    states.append(redis.Redis(port=n.port, socket_timeout=1).cluster("info")["cluster_state"])
                except redis.RedisError:
                    states.append("down")
            if states and all(s == "ok" for s in states):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"cluster not ok: {states}")
            time.sleep(0.1)

    def node_of(self, key: str) -> PrivateRedis:
        """The master serving ``key``'s slot now, as the first live master's slot map says."""
        for n in self.nodes:
            if n.proc is None or n.proc.poll() is not None:
                continue
            r = redis.Redis(port=n.port, socket_timeout=1)
            if r.info("replication")["role"] != "master":
                continue
            slot = r.cluster("keyslot", key)
            for lo, hi, master, *_ in r.execute_command("CLUSTER", "SLOTS"):
                if int(lo) <= slot <= int(hi):
                    return next(m for m in self.nodes if m.port == int(master[1]))
        raise LookupError(key)

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()



def module_cluster_url(masters: int = 3):
    """A module fixture's body: a private cluster of ``masters`` for the module's fleets (overriding the suite's
    Redis), its URL yielded, the cluster stopped after."""
    cluster = PrivateCluster(masters=masters).start()
    yield cluster.url
    cluster.stop()


def answers_streams_and_cancels(client, other, namespace: str, n: int) -> None:
    """The core paths through ``client``: ``n`` answers in order, a stream equal to ``other``'s plain answer,
    and a job cancelled before it is enqueued (the hf engine runs a started batch to its end: the marker
    stops it)."""
    from batchfleet.producer import Cancelled

    results = client.generate_many([[10 + i, 11, 12] for i in range(n)], max_new_tokens=6, timeout=60)
    assert [len(r.token_ids) for r in results] == [6] * n
    assert "".join(d.text for d in client.stream([5, 6, 7], max_new_tokens=5, timeout=60)) == \
        other.generate([5, 6, 7], max_new_tokens=5, timeout=60).text
    job = f"cancelled-{namespace}"
    client.cancel(job)
    client.submit([9, 9, 9], max_new_tokens=400, timeout=60, job_id=job)
    try:
        client.result(job, timeout=60)
    except Cancelled:
        return
    raise AssertionError(f"job {job} was not cancelled")
