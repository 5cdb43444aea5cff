"""docs/SECURITY.md's users on a Redis Cluster, as docs/OPERATIONS.md "Redis Cluster" says to set them: the
documented block with the namespace as a hash tag in every key pattern, plus the cluster line, on every node;
the function library on every master. A worker as ``worker-a``, ``Client`` as ``producer-a`` and the gateway
(OpenAI batches included) as ``gateway-a`` run end to end, and no node refused anything (``ACL LOG``)."""

from __future__ import annotations

import logging
import re

import pytest
import redis

from batchfleet.common.config import ConnectionConfig
from batchfleet.common.errors import Cancelled
from batchfleet.common.redis.clients import sync_client
from batchfleet.producer import Client
from tests.conftest import worker_config
from tests.helpers.acl import BUCKETS, NAMESPACE, PASSWORDS, SECURITY_MD, acl_block, paste, run_load_command
from tests.helpers.batches import bodies_of, run_batch
from tests.helpers.cluster import PrivateCluster
from tests.helpers.loops import LoopThread, wait_until


def cluster_acl_lines(sharded: bool = False) -> str:
    """The documented block as OPERATIONS.md says to adapt it: ``~a:`` -> ``~{a}:`` (and, for a sharded fleet,
    each such pattern once more as ``~{a:*}:``), then its cluster line."""
    def tagged(m: re.Match) -> str:
        return f"{m[1]}{{a}}:{m[2]}" + (f" {m[1]}{{a:*}}:{m[2]}" if sharded else "")

    block = re.sub(r"((?:%[RW]+)?~)a:([^\s)]+)", tagged, acl_block())
    found = re.search(r"```redis\n(ACL SETUSER.*?)```", _ops_cluster_section(), re.S)
    assert found, 'docs/OPERATIONS.md "Redis Cluster" has no ```redis block with the cluster line(s)'
    return block + found.group(1)


def _ops_cluster_section() -> str:
    text = (SECURITY_MD.parent / "OPERATIONS.md").read_text()
    return text.split("## Redis Cluster", 1)[1].split("\n## ", 1)[0]


def _url(cluster: PrivateCluster, user: str) -> str:
    return f"redis+cluster://{user}:{PASSWORDS[user]}@" + ",".join(f"127.0.0.1:{n.port}" for n in cluster.nodes)


@pytest.mark.parametrize("shards", [1, 3], ids=["one-tag", "sharded"])
def test_the_documented_users_run_a_fleet_on_a_cluster(tiny_model_dir, tmp_path, caplog, shards):
    import openai

    from tests.helpers.gateway import GatewayThread

    caplog.set_level(logging.WARNING)
    cluster = PrivateCluster(masters=3).start()
    try:
        text = cluster_acl_lines(sharded=shards > 1)
        for node in cluster.nodes:
            replies = paste(node, text)
            assert replies == ["OK"] * len(text.strip().splitlines()), replies
            done = run_load_command(node)
            assert done.returncode == 0, done.stderr
        worker = LoopThread(worker_config(_url(cluster, "worker-a"), NAMESPACE, tiny_model_dir, buckets=BUCKETS,
                                          max_seq_len=BUCKETS[-1], max_wait_ms=10, shards=shards, tenant_idle_s=0.5))
        gw = GatewayThread(_url(cluster, "gateway-a"), NAMESPACE, files_dir=str(tmp_path / "files"),
                           batch_lease_s=2.0)
        try:
            with Client(_url(cluster, "producer-a"), NAMESPACE) as client:
                assert len(client.generate([10, 11], max_new_tokens=2, timeout=30).token_ids) == 2
                assert "".join(d.text for d in client.stream([12, 13], max_new_tokens=4, timeout=30)) is not None
                client.cancel("acl-cancelled-job")
                client.submit([5, 6], max_new_tokens=8, job_id="acl-cancelled-job")
                with pytest.raises(Cancelled):
                    client.result("acl-cancelled-job", timeout=30)
            # a named tenant: its streams made by the enqueue function and the worker, retired once idle (the
            # worker's tenant scripts under worker-a), made again by its next request
            admin = sync_client(f"redis+cluster://127.0.0.1:{cluster.nodes[0].port}")
            queued = [k.queued_tenants for k in ConnectionConfig("redis+cluster://x", NAMESPACE).keys
                      .with_shards(shards).every_shard]
            with Client(_url(cluster, "producer-a"), NAMESPACE, tenant="acme") as acme:
                assert len(acme.generate([14, 15], max_new_tokens=2, timeout=30).token_ids) == 2
                wait_until(lambda: not any(admin.sismember(q, "acme") for q in queued), 30, "acme's retirement")
                assert len(acme.generate([16, 17], max_new_tokens=2, timeout=30).token_ids) == 2
            admin.close()
            assert sum(p.tenant_streams.retired for p in getattr(worker.loop.transport, "parts",
                                                                   [worker.loop.transport])) >= 1
            api = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0, timeout=30)
            batch = run_batch(api, "/v1/completions", {f"r{i}": {"prompt": f"item {i}", "max_tokens": 2}
                                                        for i in range(3)}, timeout_s=60)
            assert batch.status == "completed" and sorted(bodies_of(api, batch.output_file_id)) == ["r0", "r1", "r2"]
        finally:
            gw.stop()
            worker.stop()
        assert worker.loop.ledger["internal_errors"] == 0
        denied = [rec.getMessage() for rec in caplog.records if rec.levelno >= logging.WARNING
                  and ("unavailable" in rec.getMessage() or "NOPERM" in rec.getMessage())]
        assert denied == []
        logs = {n.port: redis.Redis(port=n.port).acl_log() for n in cluster.nodes}
        assert all(not entries for entries in logs.values()), logs
    finally:
        cluster.stop()
