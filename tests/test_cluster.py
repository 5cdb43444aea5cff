"""The fleet on a real local Redis Cluster (tests/helpers/cluster.py: 3 masters, ``redis-cli --cluster
create``), through ``redis+cluster://`` URLs: every key of a namespace under its hash tag on one slot, the
core paths (answers, streaming, cancel, the OpenAI API), a worker killed -9, and a master killed -9 under
load with ``--wait-replicas 1`` (its replica promoted, nothing acknowledged lost, no restart of anyone)."""

from __future__ import annotations

import shutil
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from batchfleet.common.config import ConnectionConfig
from batchfleet.common.redis.clients import sync_client
from batchfleet.producer import Client
from batchfleet.worker.devtools import spawn_worker
from tests.conftest import worker_config
from tests.helpers.cluster import answers_streams_and_cancels, module_cluster_url
from tests.helpers.load import SteadyLoad
from tests.helpers.loops import LoopThread, wait_until


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    """This module's fleets run on a private 3-master cluster (it overrides the suite's Redis)."""
    yield from module_cluster_url()


def _keys_by_node(url: str, pattern: str) -> dict[str, list[str]]:
    r = sync_client(url, decode_responses=True)
    try:
        return {n.name: keys for n in r.get_primaries()
                if (keys := list(r.scan_iter(match=pattern, count=1000, target_nodes=n)))}
    finally:
        r.close()


def test_a_fleet_on_a_cluster_answers_streams_and_cancels_with_every_key_in_one_slot(redis_url, namespace,
                                                                                     start_worker):
    start_worker(max_wait_ms=10, max_batch_size=8)
    with Client(redis_url, namespace) as client:
        answers_streams_and_cancels(client, client, namespace, 16)
    keys = ConnectionConfig(redis_url, namespace).keys
    by_node = _keys_by_node(redis_url, keys.pattern)
    assert len(by_node) == 1, f"a namespace's keys span masters: {by_node}"
    names = next(iter(by_node.values()))
    assert keys.workers in names and keys.stream(32) in names and all(k.startswith(f"{{{namespace}}}:") for k in names)
    assert not _keys_by_node(redis_url, f"{namespace}:*"), "a key escaped the hash tag"


def test_the_gateway_on_a_cluster_serves_the_openai_client(redis_url, namespace, start_worker, start_gateway):
    import openai

    start_worker(max_wait_ms=10)
    gw = start_gateway()
    api = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=60)
    model = api.models.list().data[0].id
    out = api.completions.create(model=model, prompt="hello", max_tokens=5, temperature=0)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 5
    chunks = list(api.completions.create(model=model, prompt="hello", max_tokens=5, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == out.choices[0].text


@pytest.mark.parametrize("shards", [1, 3], ids=["one-tag", "sharded"])
def test_a_worker_killed_on_a_cluster_loses_nothing(redis_url, namespace, tmp_path, shards):
    args = ["--buckets", "32,64", "--max-seq-len", "256", "--dtype", "float32", "--max-batch-size", "8",
            "--max-wait-ms", "50", "--claim-idle-ms", "1000", "--threads", "1", "--shards", str(shards)]
    a = spawn_worker(redis_url, namespace, args, name=f"a-{namespace}", log_path=str(tmp_path / "a.log"))
    b = spawn_worker(redis_url, namespace, args, name=f"b-{namespace}", log_path=str(tmp_path / "b.log"))
    keys = ConnectionConfig(redis_url, namespace).keys.with_shards(shards)
    r = sync_client(redis_url)
    try:
        with Client(redis_url, namespace) as client, ThreadPoolExecutor(8) as pool:
            jobs = [client.submit([10 + i % 50, 11, 12], max_new_tokens=48, timeout=120) for i in range(32)]
            futures = [pool.submit(client.result, j, 120) for j in jobs]
            wait_until(lambda: any(f[b"worker"] == a.name.encode() for _, f in r.xrange(keys.batches)), 60,
                       "a batch on worker a")
            a.kill()
            results = [f.result() for f in futures]
            home = keys.of_shard(keys.shard_of(client.reply_key))  # the client's inbox and done markers
        assert [len(x.token_ids) for x in results] == [48] * 32
        assert all(r.exists(home.done(j, client.reply_key)) for j in jobs)
        assert sum(r.xlen(k.stream(32)) + r.xlen(k.stream(64)) for k in keys.every_shard) == 0
    finally:
        a.kill()
        b.kill()
        r.close()


@pytest.mark.parametrize("shards", [1, 3], ids=["one-tag", "sharded"])
def test_a_master_killed_under_load_fails_over_and_loses_nothing_acknowledged(tiny_model_dir, monkeypatch, shards):
    """3 masters with a replica each; the master of the fleet's slot (sharded: of its last shard's) is killed
    -9 under load: its replica is promoted, the worker and the client go on without a restart, and with
    --wait-replicas 1 every enqueue that returned gets its answer, once."""
    from tests.helpers.cluster import PrivateCluster

    cluster = PrivateCluster(masters=3, replicas=1).start()
    wait_replicas = 1
    monkeypatch.setenv("BATCHFLEET_WAIT_REPLICAS", str(wait_replicas))  # the client reads it, like the CLI
    ns = f"fo-{uuid.uuid4().hex[:6]}"
    keys = ConnectionConfig(cluster.url, ns).keys.with_shards(shards).of_shard(shards - 1)
    worker = LoopThread(worker_config(cluster.url, ns, tiny_model_dir, max_wait_ms=10, max_batch_size=16,
                                      claim_idle_ms=2000, wait_replicas=wait_replicas, shards=shards))
    client = Client(cluster.url, ns, retry_s=60)
    load = SteadyLoad(client)
    try:
        load.start()
        wait_until(lambda: len(load.acked) > 20 or load.errors, 60, "load before the kill")
        assert not load.errors, load.errors
        master = cluster.node_of(keys.workers)
        killed_at = time.monotonic()
        master.kill()
        wait_until(lambda: cluster.node_of(keys.workers) is not master, 60, "a replica promoted", every_s=0.1)
        promoted_s = time.monotonic() - killed_at
        master.start()  # the crashed node comes back (its nodes.conf): a replica of the promoted one
        wait_until(lambda: any(t > killed_at + promoted_s for t, _ in load.acked), 60, "enqueues after the failover")
        time.sleep(2)
        load.stop()
        assert not load.errors, load.errors
        answered, lost = load.results(within_s=30)
        print(f"\ncluster failover: {len(load.acked)} acknowledged, promoted in {promoted_s:.1f} s, lost {lost[:5]}")
        assert lost == [] and len(answered) == len(load.acked)
        assert all(len(a.token_ids) == 4 for a in answered.values())
    finally:
        load.stop()
        client.close()
        worker.stop()
        cluster.stop()


def test_kedas_demand_on_a_cluster_counts_every_unanswered_request(redis_url, namespace, start_worker, tmp_path):
    """deploy/k8s rendered for this cluster's URL by scripts/k8s_redis.py; the demand the gateway exports read
    through a cluster client (the tagged streams). With 8 requests a worker, KEDA's arithmetic asks for >= 2
    workers for 17 requests, counts each unanswered one exactly once, and 0 when all are answered."""
    from scripts.k8s_redis import write
    from tests.helpers.deploy import K8S, render
    from tests.helpers.keda import for_fleet
    from tests.test_keda_signal import assert_backlog_counted

    k8s = tmp_path / "k8s"
    shutil.copytree(K8S, k8s, ignore=shutil.ignore_patterns("secret.env"))
    write(redis_url, k8s)
    (shipped,) = [d for d in render(k8s) if d["kind"] == "ScaledObject"]
    so = for_fleet(shipped)
    so["spec"]["advanced"]["scalingModifiers"]["target"] = "8"
    start_worker(max_batch_size=4, max_running=4)  # 4 at a time, 200 tokens each: the rest stays unanswered a while
    r = sync_client(redis_url)
    try:
        # answered entries may count until their acks, a round trip later (222e500): up to one batch (4)
        assert_backlog_counted(redis_url, namespace, r, so, 17, 200, settling=4)
    finally:
        r.close()
