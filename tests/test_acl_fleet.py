"""A fleet end to end under docs/SECURITY.md's users on Redis 7: the worker runs as ``worker-a`` (with the
redelivery and dead-letter path), ``Client`` and ``AsyncClient`` run as ``producer-a`` (generate, stream,
cancel), the gateway with its batches runner as ``gateway-a``, and Redis refused nothing any of them sent
(``ACL LOG`` stays empty)."""

from __future__ import annotations

import asyncio
import io
import logging

import pytest
import redis

from batchfleet.common.errors import Cancelled, JobFailed
from batchfleet.producer import AsyncClient, Client
from batchfleet.producer.bulk.file_run import bulk_file
from tests.conftest import worker_config
from tests.helpers.acl import BUCKETS, NAMESPACE, install_documented_acl, start_redis7, user_url
from tests.helpers.loops import POISON_TOKEN, LoopThread, PoisonEngine


async def _async_part(url: str) -> tuple[str, str]:
    client = AsyncClient(url, NAMESPACE)
    try:
        result = await client.generate([20, 21], max_new_tokens=4, timeout=30)
        stream = await client.stream([22, 23], max_new_tokens=8, timeout=30)
        text = "".join([d.text async for d in stream])
        assert stream.result is not None and stream.result.text.startswith(text)
        return result.text, stream.result.text
    finally:
        await client.aclose()


def test_fleet_runs_under_the_documented_users(tiny_model_dir, caplog):
    caplog.set_level(logging.WARNING)
    server = start_redis7()
    try:
        install_documented_acl(server)
        cfg = worker_config(user_url(server, "worker-a"), NAMESPACE, tiny_model_dir, buckets=BUCKETS,
                            max_seq_len=BUCKETS[-1], max_wait_ms=10, claim_idle_ms=400, max_deliveries=2)
        # PoisonEngine (test only) drives the redelivery commands too: release, reclaim, pending, dead letter
        worker = LoopThread(cfg, PoisonEngine)
        producer_url = user_url(server, "producer-a")
        try:
            with Client(producer_url, NAMESPACE) as client:
                answers = [client.generate([10 + i, 11], max_new_tokens=2, timeout=30) for i in range(3)]
                stream = client.stream([12, 13], max_new_tokens=8, timeout=30)
                text = "".join(d.text for d in stream)
                assert stream.result is not None and stream.result.text.startswith(text)
                # cancelled before it is enqueued: the marker stops it whichever tick reads it (this hf
                # engine runs a started batch to its end, and a lone request starts at once)
                long = "acl-cancelled-job"
                client.cancel(long)
                client.submit([5, 6], max_new_tokens=BUCKETS[-1] - 2, job_id=long)
                with pytest.raises(Cancelled):
                    client.result(long, timeout=30)
                poison = client.submit([5, POISON_TOKEN], max_new_tokens=2)
                with pytest.raises(JobFailed, match="worker_failed"):
                    client.result(poison, timeout=30)
            asyncio.run(_async_part(producer_url))
            out = io.StringIO()  # a bulk run as producer-a: it reports to the bulk-run registry too
            asyncio.run(bulk_file(None, None, text="x\ny\n", out=out, redis_url=producer_url, namespace=NAMESPACE,
                                  plain=True, defaults={"max_new_tokens": 2}))
            assert len(out.getvalue().splitlines()) == 2
        finally:
            worker.stop()
        assert {res.worker for res in answers} == {worker.loop.transport.name}
        assert worker.loop.ledger["internal_errors"] == 0 and worker.loop.ledger["reclaimed"] >= 1
        assert worker.lease_failures == 0
        # nothing the fleet sent was refused: no NOPERM logged, nothing in Redis' ACL log
        denied = [rec.getMessage() for rec in caplog.records if rec.levelno >= logging.WARNING
                  and ("unavailable" in rec.getMessage() or "NOPERM" in rec.getMessage())]
        assert denied == []
        assert redis.Redis(port=server.port).acl_log() == []
    finally:
        server.stop()


def test_batches_run_under_the_documented_gateway_user(tiny_model_dir, tmp_path, caplog):
    import io
    import json
    import time

    import httpx
    import openai

    from tests.helpers.gateway import GatewayThread

    caplog.set_level(logging.WARNING)
    server = start_redis7()
    try:
        install_documented_acl(server)
        cfg = worker_config(user_url(server, "worker-a"), NAMESPACE, tiny_model_dir, buckets=BUCKETS,
                            max_seq_len=BUCKETS[-1], max_wait_ms=10)
        worker = LoopThread(cfg)
        gw = GatewayThread(user_url(server, "gateway-a"), NAMESPACE, files_dir=str(tmp_path / "files"),
                           batch_lease_s=2.0)
        try:
            client = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0, timeout=30)
            lines = "".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                                        "body": {"prompt": f"item {i}", "max_tokens": 2}}) + "\n" for i in range(4))
            f = client.files.create(file=("in.jsonl", io.BytesIO(lines.encode())), purpose="batch")
            batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
            deadline = time.monotonic() + 60
            while (batch := client.batches.retrieve(batch.id)).status != "completed":
                assert time.monotonic() < deadline and batch.status in ("validating", "in_progress", "finalizing")
                time.sleep(0.2)
            out = client.files.content(batch.output_file_id).text.splitlines()
            assert sorted(json.loads(x)["custom_id"] for x in out) == [f"r{i}" for i in range(4)]
            model = client.models.list().data[0].id
            # ignore_eos: the random tiny model may sample EOS; the point is that gateway-a may serve it
            answer = client.completions.create(model=model, prompt="hi", max_tokens=2, extra_body={"ignore_eos": True})
            assert answer.choices[0].finish_reason == "length"
            # the Responses API's store (a:response:*) and an embed request
            stored = client.responses.create(model=model, input="hi", max_output_tokens=2)
            assert client.responses.retrieve(stored.id).output_text == stored.output_text
            client.responses.delete(stored.id)
            assert len(client.embeddings.create(model=model, input="hi").data[0].embedding) > 0
            assert [b.id for b in client.batches.list()] == [batch.id]
            assert f.id in [x.id for x in client.files.list(purpose="batch")] and client.files.delete(f.id).deleted
            data = httpx.get(gw.url + "/dashboard/data", timeout=30).json()  # the dashboard's reads and history
            assert [(j["id"], j["status"], j["completed"]) for j in data["batch_jobs"]] == [(batch.id, "completed", 4)]
            assert data["workers"] and data["history"] and data["history"][0]["live"] == 1
            # the gateway's work gauges (gateway/work_metrics.py) read the same records as gateway-a
            from batchfleet.gateway.work_metrics import WorkCollector

            work = WorkCollector(gw.config.connection)
            try:
                gauges = {s.name: s.value for fam in work.collect() for s in fam.samples
                          if s.labels.get("status") == "completed"}
            finally:
                work.close()
            assert gauges == {"batchfleet_batch_jobs": 1}  # a NOPERM would leave the gauges out
        finally:
            gw.stop()
            worker.stop()
        denied = [rec.getMessage() for rec in caplog.records if rec.levelno >= logging.WARNING
                  and "NOPERM" in rec.getMessage()]
        assert denied == [] and redis.Redis(port=server.port).acl_log() == []
    finally:
        server.stop()
