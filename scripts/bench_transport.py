"""What the Redis path itself costs per request, with no engine: the full producer -> stream -> worker
-> reply -> producer chain (Client.submit's XADD + XLEN, XREADGROUP, the reply pipeline: SET NX of the answer,
a ring in the client's inbox, XACK/XDEL; the client's inbox reader XREAD + MGET, then XDEL + emptying the answer),
one request at a time, on the configured Redis. Prints a markdown row and writes JSON.

    python scripts/bench_transport.py --json docs/bench/transport.json
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import click

from batchfleet.common.config import DEFAULT_REDIS_URL, ConnectionConfig
from batchfleet.common.wire.protocol import FleetInfo, Request, Result
from batchfleet.producer import Client
from batchfleet.worker.benchmark.loadgen import percentile
from batchfleet.worker.devtools import delete_namespace, ensure_redis
from batchfleet.worker.engine.tokenizer import byte_level_tokenizer
from batchfleet.worker.transport.base import Reply
from batchfleet.worker.transport.consumer import StreamConsumer


@click.command(help=__doc__)
@click.option("--redis-url", default=DEFAULT_REDIS_URL, show_default=True, help="Started privately if unreachable.")
@click.option("-n", "n", type=int, default=500, show_default=True, help="Timed requests (after 20 warm-up ones).")
@click.option("--json", "json_path", default=None, help="Write the result as JSON here.")
def main(redis_url: str, n: int, json_path: str | None) -> None:
    url, private = ensure_redis(redis_url)
    conn = ConnectionConfig(redis_url=url, namespace=f"transport-{uuid.uuid4().hex[:6]}")
    worker = StreamConsumer(conn, (128,), "probe", reply_ttl_s=60)
    worker.setup()
    worker.presence.join(FleetInfo(model="none", tokenizer_json=byte_level_tokenizer().backend_tokenizer.to_str(),
                                   buckets=(128,), max_seq_len=256, max_batch_size=1, vocab_size=320,
                                   eos_token_ids=(2,)))
    client = Client(url, conn.namespace)  # the probe's presence.join marked it live
    prompt = list(range(10, 42))
    samples = []
    try:
        for i in range(n + 20):
            t0 = time.perf_counter()
            job = client.submit(prompt, max_new_tokens=8)
            (entry,) = worker.read(count=1, block_ms=None)
            req = Request.decode(entry.fields[b"p"])
            res = Result(id=req.id, token_ids=[5] * 8, text="x" * 8, finish_reason="length", prompt_tokens=32,
                         completion_tokens=8, queue_ms=0, ttft_ms=0, total_ms=0, worker="probe", batch_size=1)
            worker.settler.write_replies([Reply(job, res, entry.bucket, entry.entry_id, req.reply_key)])
            client.result(job, timeout=10)
            if i >= 20:
                samples.append((time.perf_counter() - t0) * 1000)
    finally:
        delete_namespace(url, conn.namespace)
        if private is not None:
            private.stop()
    doc = {"n": len(samples), "p50_ms": round(percentile(samples, 50), 3),
           "p99_ms": round(percentile(samples, 99), 3), "redis": url,
           "chain": "submit (XADD + XLEN) + XREADGROUP + reply pipeline (SET NX answer, XADD ring, EXPIRE, XACK, "
                    "XDEL) + inbox XREAD + MGET (+ XDEL, SET '' XX)"}
    print("| requests | transport p50 ms | transport p99 ms |\n|---|---|---|")
    print(f"| {doc['n']} | {doc['p50_ms']} | {doc['p99_ms']} |")
    if json_path:
        Path(json_path).write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
