"""A busy worker does not hoard what an idle peer could serve (issue #12, point 6d): two real workers
(hf engine, dynamic mode, in threads); worker A reads long and short requests, starts the long batch
(one ``step`` of ~10 s) and releases the short ones it cannot start; its idle peer B takes them over at
once and answers them while A's long batch still runs. Each request is computed and answered once."""

from __future__ import annotations

import threading
import time

import redis

from batchfleet.common.keys import Keys
from batchfleet.producer import Client
from batchfleet.worker.requests.table import Stage
from tests.conftest import worker_config
from tests.helpers.loops import wait_until

SHORT_BOUND_S = 12.0  # release after 1 s + reclaim period 0.5 s + the short batch, on 2 busy cores (loaded: 2x)


def test_busy_worker_releases_queued_short_requests_to_its_idle_peer(redis_url, namespace, tiny_model_dir):
    from batchfleet.worker.compose import build_worker

    kw = {"buckets": (32, 64), "max_seq_len": 2048, "max_batch_size": 16, "max_wait_ms": 50,
          "claim_idle_ms": 1000, "threads": 1}
    # both built (fleet joined, model loaded) before anything runs, so A reads everything first
    a = build_worker(worker_config(redis_url, namespace, tiny_model_dir, name="busy-a", **kw))
    b = build_worker(worker_config(redis_url, namespace, tiny_model_dir, name="idle-b", **kw))
    keys = Keys(namespace)
    r = redis.Redis.from_url(redis_url)
    threads = []
    try:
        with Client(redis_url, namespace) as client:
            long_jobs = [client.submit([10 + i, 11, 12], max_new_tokens=1500) for i in range(8)]
            short_jobs = [client.submit([20 + i % 30] * 40, max_new_tokens=2) for i in range(16)]  # bucket 64
            time.sleep(0.1)  # both batches closed by age: the older (long) one starts first
            threads.append(threading.Thread(target=a.run, daemon=True))
            threads[-1].start()
            # A's batch record is written once its first step returns (hf: the whole batch): watch A's table
            wait_until(lambda: a.requests.count(Stage.RUNNING) > 0, 30, "A's batch")
            t_batch = time.monotonic()
            assert a.requests.count(Stage.QUEUED) == 16  # A read them all: the shorts wait behind the long batch
            threads.append(threading.Thread(target=b.run, daemon=True))
            threads[-1].start()
            shorts = [client.result(j, timeout=60) for j in short_jobs]
            short_s = time.monotonic() - t_batch
            longs = [client.result(j, timeout=120) for j in long_jobs]
            long_s = time.monotonic() - t_batch
        print(f"\nshort requests answered {short_s:.1f}s after A's long batch began (A's batch: {long_s:.1f}s); "
              f"A handed {a.ledger['handed_to_peers']} to B")
        assert {res.worker for res in shorts} == {"idle-b"} and {res.worker for res in longs} == {"busy-a"}
        assert short_s < SHORT_BOUND_S and short_s < long_s  # B served them while A was still busy
        assert a.ledger["handed_to_peers"] == 16 and b.ledger["reclaimed"] == 16
        ran = [i for _, f in r.xrange(keys.batches) for i in f[b"ids"].decode().split(",")]
        assert sorted(ran) == sorted(long_jobs + short_jobs)  # each computed once: none released twice
    finally:
        for loop in (a, b):
            loop.stopping.set()
        for t in threads:
            t.join(120)
        for loop in (a, b):
            loop.transport.close()
