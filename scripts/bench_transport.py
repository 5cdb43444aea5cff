"""What the Redis path itself costs per request, with no engine: the full producer -> stream -> worker
-> reply -> producer chain (Client.submit script, XREADGROUP, reply script with XACK/XDEL, BLPOP),
one request at a time, on the configured Redis. Prints a markdown row and writes JSON.

    python scripts/bench_transport.py --json docs/bench/transport.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batchfleet.common.config import ConnectionConfig  # noqa: E402
from batchfleet.common.localredis import ensure_redis  # noqa: E402
from batchfleet.common.protocol import FleetInfo, Request, Result  # noqa: E402
from batchfleet.producer import Client  # noqa: E402
from batchfleet.worker.benchmark.loadgen import percentile  # noqa: E402
from batchfleet.worker.consumer import Reply, StreamConsumer  # noqa: E402
from batchfleet.worker.engine.models import byte_level_tokenizer  # noqa: E402
from batchfleet.worker.spawn import delete_namespace  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    ap.add_argument("-n", type=int, default=500)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    url, private = ensure_redis(args.redis_url)
    conn = ConnectionConfig(redis_url=url, namespace=f"transport-{uuid.uuid4().hex[:6]}")
    worker = StreamConsumer(conn, (128,), "probe", reply_ttl_s=60)
    worker.setup()
    worker.publish_fleet(FleetInfo(model="none", tokenizer_json=byte_level_tokenizer().backend_tokenizer.to_str(),
                                   buckets=(128,), max_seq_len=256, max_batch_size=1, vocab_size=320,
                                   eos_token_ids=(2,)))
    client = Client(url, conn.namespace)
    prompt = list(range(10, 42))
    samples = []
    try:
        for i in range(args.n + 20):
            t0 = time.perf_counter()
            job = client.submit(prompt, max_new_tokens=8)
            (entry,) = worker.read(count=1, block_ms=None)
            req = Request.decode(entry.fields[b"p"])
            res = Result(id=req.id, token_ids=[5] * 8, text="x" * 8, finish_reason="length", prompt_tokens=32,
                         completion_tokens=8, queue_ms=0, ttft_ms=0, total_ms=0, worker="probe", batch_size=1)
            worker.write_replies([Reply(job, res.encode(), entry.bucket, entry.entry_id)])
            client.result(job, timeout=10)
            if i >= 20:
                samples.append((time.perf_counter() - t0) * 1000)
    finally:
        delete_namespace(url, conn.keys)
        if private is not None:
            private.stop()
    doc = {"n": len(samples), "p50_ms": round(percentile(samples, 50), 3),
           "p99_ms": round(percentile(samples, 99), 3), "redis": url,
           "chain": "submit (EVALSHA) + XREADGROUP + reply script (SET NX, RPUSH, EXPIRE, XACK, XDEL) + BLPOP"}
    print("| requests | transport p50 ms | transport p99 ms |\n|---|---|---|")
    print(f"| {doc['n']} | {doc['p50_ms']} | {doc['p99_ms']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
