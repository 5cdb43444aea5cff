"""The work the fleet runs as Prometheus gauges on the gateway's /metrics (issue 58, item 3b): a real OpenAI
batch job and a real bulk run against a real worker process (frozen with SIGSTOP mid-run, so "running" holds
while /metrics is scraped), scraped over HTTP and parsed with prometheus_client's text parser; the numbers are
the records' in Redis (what the dashboard shows), then the ended states once the job finished and the run stopped."""

from __future__ import annotations

import io
import json
import os
import signal

import openai
import pytest
import redis
from prometheus_client.core import GaugeMetricFamily

from batchfleet.common.config import ConnectionConfig
from batchfleet.common.keys import Keys
from batchfleet.common.metrics import registry_with, serve_metrics
from batchfleet.gateway.work_metrics import BATCH_STATUSES, WorkCollector, work_families
from batchfleet.producer.bulk.registry import bulk_runs
from batchfleet.worker.devtools import free_port
from tests.helpers.loops import wait_until
from tests.helpers.metrics import scrape
from tests.test_dashboard_work import BulkThread, counts, worker_args

LINES = 400  # the batch job's: it does not end before the freeze (it waits behind the interactive bulk run)
BULK_LINES = 2000  # the bulk run's: far more than it answers between its first written line and the freeze
WORK = ("batchfleet_batch_jobs", "batchfleet_batch_job_requests", "batchfleet_bulk_runs", "batchfleet_bulk_run_lines")


def of(m: dict, name: str, **labels: str) -> float:
    return m[name][tuple(sorted(labels.items()))]


def expected(r: redis.Redis, keys: Keys, batch_id: str) -> dict[tuple, float]:
    """What the gauges must say, from the records in Redis (the batch job's counts, the bulk run's report)."""
    job = counts(r, keys, batch_id)
    (run,) = bulk_runs(r, keys)
    lines = {"completed": run["done"] - run["failed"], "failed": run["failed"], "remaining": run["total"] - run["done"]}
    return {("batch_jobs", job["status"]): 1.0,
            ("requests", "completed"): job["completed"], ("requests", "failed"): job["failed"],
            ("requests", "remaining"): job["total"] - job["completed"] - job["failed"], ("runs", run["state"]): 1.0,
            **{("lines", k): v if run["state"] == "running" else 0 for k, v in lines.items()}}  # running runs'


def seen(m: dict) -> dict[tuple, float]:
    job_status = [s for s in BATCH_STATUSES if of(m, "batchfleet_batch_jobs", status=s)]
    run_state = [s for s in ("running", "finished", "stopped") if of(m, "batchfleet_bulk_runs", state=s)]
    return {**{("batch_jobs", s): of(m, "batchfleet_batch_jobs", status=s) for s in job_status},
            **{("requests", s): of(m, "batchfleet_batch_job_requests", priority="background", state=s)
               for s in ("completed", "failed", "remaining")},
            **{("runs", s): of(m, "batchfleet_bulk_runs", state=s) for s in run_state},
            **{("lines", s): of(m, "batchfleet_bulk_run_lines", priority="interactive", state=s)
               for s in ("completed", "failed", "remaining")}}


def test_gateway_metrics_count_batch_jobs_and_bulk_runs(redis_url, namespace, tiny_model_dir, cache_dir, tmp_path,
                                                        start_gateway):
    from batchfleet.gateway.metrics import serve_gateway_metrics
    from batchfleet.worker.devtools import spawn_worker

    keys, r = Keys(namespace), redis.Redis.from_url(redis_url)
    worker = spawn_worker(redis_url, namespace, worker_args(tiny_model_dir, cache_dir),
                          log_path=str(tmp_path / "worker.log"))
    gw = start_gateway(served_model_names=("tiny",), batch_window=2, files_dir=str(tmp_path / "files"))
    server = serve_gateway_metrics(gw.app.state.metrics, 0)
    bulk = None
    try:
        before = scrape(server.port)  # nothing yet: every status and state at 0, exported from the start
        assert all(v == 0 for name in WORK for v in before[name].values())
        assert len(before["batchfleet_batch_jobs"]) == len(BATCH_STATUSES)
        assert set(before["batchfleet_bulk_run_lines"]) == {(("priority", p), ("state", s)) for p in (
            "interactive", "background") for s in ("completed", "failed", "remaining")}  # `priority`, no `class`
        api = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        text = "".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                                   "body": {"model": "tiny", "max_tokens": 2, "prompt": f"item {i}"}}) + "\n"
                       for i in range(LINES))
        upload = api.files.create(file=("in.jsonl", io.BytesIO(text.encode())), purpose="batch")
        job = api.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
        wait_until(lambda: counts(r, keys, job.id).get("completed", 0) >= 1, 120, "the batch job's progress", 0.2)
        # then an interactive bulk run: served first, it holds the background batch job back until the freeze
        out = tmp_path / "out.jsonl"
        bulk = BulkThread(redis_url, namespace, "".join(f"prompt number {i}\n" for i in range(BULK_LINES)), out,
                          defaults={"priority": "interactive", "max_new_tokens": 2})
        # frozen at its first written line, not at its first report (every 5 s): a short run could end before that
        wait_until(lambda: out.exists() and out.stat().st_size > 0, 120, "the bulk run's first line", 0.02)
        os.kill(worker.proc.pid, signal.SIGSTOP)  # no more answers: both stay part done while scraped
        try:
            wait_until(lambda: [b["done"] for b in bulk_runs(r, keys)][:1] >= [1], 30, "the bulk run's report", 0.2)
            # answers already on their way land within a moment: wait until the scrape and Redis agree
            last: list = []

            def agree() -> bool:
                last[:] = [seen(scrape(server.port)), expected(r, keys, job.id)]
                return last[0] == last[1]

            try:
                wait_until(agree, 60, "the gauges", 0.2)
            except AssertionError:
                raise AssertionError(f"scraped {last[0]} != in Redis {last[1]}; bulk runs {bulk_runs(r, keys)}, "
                                     f"batch job {counts(r, keys, job.id)}") from None
            now = expected(r, keys, job.id)
            assert now[("batch_jobs", "in_progress")] == 1 and now[("runs", "running")] == 1
            assert 1 <= now[("requests", "completed")] and now[("requests", "remaining")] >= 1
            assert 1 <= now[("lines", "completed")] and now[("lines", "remaining")] >= 1
            running = scrape(server.port)
            assert of(running, "batchfleet_bulk_run_lines", priority="background", state="remaining") == 0
            assert of(running, "batchfleet_batch_job_requests", priority="interactive", state="remaining") == 0
            api.batches.cancel(job.id)  # while nothing is answered: it cannot complete first
        finally:
            os.kill(worker.proc.pid, signal.SIGCONT)
        bulk.stop()  # a clean stop: the run ends "stopped" (or "finished", had it just ended), kept among the ended
        bulk = None
        wait_until(lambda: counts(r, keys, job.id)["status"] == "cancelled", 120, "the batch job's end", 0.2)
        ended = scrape(server.port)
        assert of(ended, "batchfleet_batch_jobs", status="cancelled") == 1
        assert of(ended, "batchfleet_batch_jobs", status="in_progress") == 0
        assert of(ended, "batchfleet_bulk_runs", state="running") == 0
        assert of(ended, "batchfleet_bulk_runs", state="stopped") + of(ended, "batchfleet_bulk_runs",
                                                                        state="finished") == 1
        for name in ("batchfleet_batch_job_requests", "batchfleet_bulk_run_lines"):  # unfinished work only
            assert set(ended[name].values()) == {0}, name
    finally:
        if bulk is not None:
            bulk.stop()
        server.close()
        worker.stop(30)
        r.close()


def test_a_scrape_answers_without_the_work_gauges_when_redis_does_not():
    down = WorkCollector(ConnectionConfig(f"redis://127.0.0.1:{free_port()}/0", "nowhere"))
    server = serve_metrics(registry_with(down), 0)
    try:
        families = scrape(server.port)
    finally:
        server.close()
        down.close()
    assert not any(name in families for name in WORK) and "process_open_fds" in families


@pytest.mark.unit
def test_work_families_sum_unfinished_jobs_and_running_runs():
    jobs = [{"status": "in_progress", "total": 100, "completed": 30, "failed": 5},
            {"status": "cancelling", "total": 10, "completed": 2, "failed": 0},
            {"status": "completed", "total": 50, "completed": 49, "failed": 1},  # ended: counted by status only
            {"status": "validating", "total": 0, "completed": 0, "failed": 0}]
    runs = [{"state": "running", "priority": "interactive", "total": 20, "done": 12, "failed": 2},
            {"state": "running", "total": 9, "done": 3, "failed": 0},  # a report older than the priority field
            {"state": "finished", "priority": "background", "total": 7, "done": 7, "failed": 0},
            {"state": "stopped", "priority": "background", "total": 8, "done": 4, "failed": 1}]
    fams: dict[str, GaugeMetricFamily] = {f.name: f for f in work_families(jobs, runs)}
    values = {name: {tuple(s.labels.values()): s.value for s in f.samples} for name, f in fams.items()}
    assert values["batchfleet_batch_jobs"] == {("validating",): 1, ("in_progress",): 1, ("finalizing",): 0,
                                               ("cancelling",): 1, ("completed",): 1, ("failed",): 0,
                                               ("expired",): 0, ("cancelled",): 0}
    assert values["batchfleet_batch_job_requests"] == {
        ("interactive", "completed"): 0, ("background", "completed"): 32, ("interactive", "failed"): 0,
        ("background", "failed"): 5, ("interactive", "remaining"): 0, ("background", "remaining"): 73}
    assert values["batchfleet_bulk_runs"] == {("running",): 2, ("finished",): 1, ("stopped",): 1}
    assert values["batchfleet_bulk_run_lines"] == {
        ("interactive", "completed"): 10, ("background", "completed"): 3, ("interactive", "failed"): 2,
        ("background", "failed"): 0, ("interactive", "remaining"): 8, ("background", "remaining"): 6}
