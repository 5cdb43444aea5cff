"""Preemptions are exported by reason (issue 32): a KV cache too small for what runs preempts for capacity,
which the saturation alert reads, never counted as the priorities' priority preemptions; a real worker on the
native engine with a deliberately tiny KV pool, scraped over HTTP."""

from __future__ import annotations

from batchfleet.producer import Client
from batchfleet.worker.devtools import free_port
from tests.test_metrics import one, scrape

TINY_KV = dict(engine="native", mode="continuous", max_running=16, max_batch_size=16, max_wait_ms=20)


def test_a_full_kv_cache_preempts_for_capacity(start_worker, redis_url: str, namespace: str):
    port = free_port()
    w = start_worker(**TINY_KV, kv_cache_gb=0.0005, metrics_port=port)
    with Client(redis_url, namespace) as client:  # all interactive: no priority preemption can happen
        results = client.generate_many([[5 + i] * 20 for i in range(16)], max_new_tokens=60, ignore_eos=True,
                                         timeout=300)
    assert all(r.completion_tokens == 60 for r in results)
    stats = w.loop.engine.stats()
    m = scrape(port)
    print(f"\nKV blocks {stats['kv_blocks_total']}, preemptions {stats['preemptions']}")
    assert stats["preemptions"] > 0 and stats["priority_preemptions"] == 0, stats
    assert one(m, "batchfleet_preemptions_total", reason="capacity") == stats["preemptions"]
    assert one(m, "batchfleet_preemptions_total", reason="priority") == 0
