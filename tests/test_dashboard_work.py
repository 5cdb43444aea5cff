"""The dashboard shows the work (issue 32, item 1): a running OpenAI batch job and a running bulk run with their
progress, rate and ETA in a real headless Chromium against a real fleet (a worker process frozen with
SIGSTOP mid-run, so "running" holds while the page loads); the bulk-run registry (reported, expiring,
pruned); the history samples (one per slot whatever the samplers, TTFT from the workers' heartbeats); the
read-only operator key on the gateway and ``batchfleet status --gateway``."""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import redis
import redis.asyncio

from batchfleet.common.config import DashboardConfig
from batchfleet.common.errors import ConfigError
from batchfleet.common.keys import Keys
from batchfleet.producer import Client
from batchfleet.producer.bulk.file_run import bulk_file
from batchfleet.producer.bulk.registry import FINISHED_KEPT, RUN_TTL_S, SHOWN_FINISHED, RunReporter, bulk_runs
from batchfleet.producer.bulk.work import Summary
from batchfleet.producer.ops.batch_jobs import batch_job_row
from batchfleet.producer.ops.history import history, record_sample, take_sample
from batchfleet.producer.ops.status import render_work
from tests.conftest import TEST_BUCKETS
from tests.helpers.browser import Dom, chromium, needs_chromium
from tests.helpers.loops import wait_until
from tests.test_status import run_status

KEY, OPERATOR = "sk-model-0123456789", "op-readonly-0123456789"
LINES = 2000  # neither ends before the freeze, which waits for the bulk run's measured rate (10 s or more)


class BulkThread:
    """``bulk_file`` (what ``batchfleet bulk`` runs) in a thread with its own loop; ``stop`` ends it."""

    def __init__(self, redis_url: str, namespace: str, text: str, out: Path, defaults: dict | None = None) -> None:
        self.args, self.ready = (redis_url, namespace, text, str(out)), threading.Event()
        self.defaults = defaults
        self.summary: Summary | None = None
        self.thread = threading.Thread(target=asyncio.run, args=(self.main(),), daemon=True)
        self.thread.start()

    async def main(self) -> None:
        redis_url, namespace, text, out = self.args
        self.loop, self.stopping = asyncio.get_running_loop(), asyncio.Event()
        self.ready.set()
        self.summary = await bulk_file(None, out, text=text, redis_url=redis_url, namespace=namespace, window=2,
                                       stop=self.stopping, plain=True, defaults=self.defaults)

    def stop(self) -> None:
        self.ready.wait(30)
        self.loop.call_soon_threadsafe(self.stopping.set)
        self.thread.join(60)


def worker_args(model_dir: Path, cache_dir: Path) -> list[str]:
    return ["--model", str(model_dir), "--cache-dir", str(cache_dir), "--engine", "hf", "--mode", "dynamic",
            "--dtype", "float32", "--max-seq-len", "512", "--buckets", ",".join(map(str, TEST_BUCKETS)),
            "--threads", "1"]


def counts(r: redis.Redis, keys: Keys, batch_id: str) -> dict:
    doc = json.loads(r.hget(keys.openai_batch(batch_id), "doc"))
    return {"status": doc["status"], **(doc.get("request_counts") or {})}


@needs_chromium
def test_chromium_shows_a_running_batch_job_and_a_running_bulk_run(redis_url, namespace, tiny_model_dir, cache_dir,
                                                                   tmp_path, start_gateway):
    from batchfleet.worker.devtools import spawn_worker

    keys, r = Keys(namespace), redis.Redis.from_url(redis_url)
    worker = spawn_worker(redis_url, namespace, worker_args(tiny_model_dir, cache_dir),
                          log_path=str(tmp_path / "worker.log"))
    bulk = None
    try:
        gw = start_gateway(api_keys=KEY, operator_keys=OPERATOR, served_model_names=("tiny",), batch_window=2,
                           files_dir=str(tmp_path / "files"))
        api = openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        text = "".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                                   "body": {"model": "tiny", "max_tokens": 2, "messages": [
                                       {"role": "user", "content": f"question {i}"}]}}) + "\n" for i in range(LINES))
        upload = api.files.create(file=("in.jsonl", io.BytesIO(text.encode())), purpose="batch")
        job = api.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
        bulk = BulkThread(redis_url, namespace, "".join(f"prompt number {i}\n" for i in range(LINES)),
                          tmp_path / "out.jsonl")
        # both made progress (the job's counts are published every second, a bulk run reports every 5 s)
        wait_until(lambda: counts(r, keys, job.id).get("completed", 0) >= 1, 120, "the batch job's progress", 0.2)
        # the bulk run's rate and ETA once measured: MIN_ANSWERS answers over MIN_WINDOW_S after its first
        # (producer/bulk/rate.py), told by its reports every 5 s
        wait_until(lambda: [b["eta_s"] is not None for b in bulk_runs(r, keys)][:1] == [True], 120,
                   "the bulk run's measured rate", 0.2)
        os.kill(worker.proc.pid, signal.SIGSTOP)  # the fleet stops answering: both stay running, part done
        try:
            dom = Dom(chromium(f"{gw.url}/dashboard?tz=utc#key={OPERATOR}"))
        finally:
            os.kill(worker.proc.pid, signal.SIGCONT)
    finally:
        if bulk is not None:
            bulk.stop()
        worker.stop(30)
        r.close()
    assert not dom.text["error"].strip() and dom.text["zone"] == "times in UTC"
    for word in ("priority", "prefill batch", "batch job", "bulk run"):
        assert word in dom.text["words"]
    (row,) = [row for row in dom.rows if "data-job" in row]
    assert row["data-job"] == job.id and row["data-status"] == "in_progress"
    cells = [c.strip() for c in row["cells"]]
    answered = re.fullmatch(rf"(\d+) / {LINES} \((\d+)%\)", cells[2])
    assert answered and 1 <= int(answered[1]) < LINES, cells
    assert cells[4].endswith("/s") and cells[5] != "-"  # rate, ETA
    assert "created (UTC)" in dom.text["jobs"]
    (run,) = [row for row in dom.rows if "data-run" in row]
    assert run["data-state"] == "running"
    cells = [c.strip() for c in run["cells"]]
    answered = re.fullmatch(rf"(\d+) / {LINES} \((\d+)%\)", cells[3])
    assert answered and 1 <= int(answered[1]) < LINES and cells[2] == "- → out.jsonl", cells
    assert cells[5].endswith("/s") and cells[6] != "-"  # rate, ETA
    # the gateway took a history sample at start: each chart has it
    assert {"queued requests", "throughput", "time to first token"} <= set(dom.charts)
    assert int(dom.charts["queued requests"]["data-points"]) >= 1


def test_bulk_run_registry_keeps_finished_runs_bounded_and_forgets_killed_ones(start_worker, redis_url, namespace,
                                                                             tmp_path):
    """Issue 58, item 3d: a finished bulk run stays listed as finished batch jobs do (not 5 minutes): its last
    report has no TTL and the last FINISHED_KEPT ended runs are kept, the older ones' reports deleted."""
    start_worker(max_wait_ms=5)
    keys, r = Keys(namespace), redis.Redis.from_url(redis_url)
    summary = asyncio.run(bulk_file(None, str(tmp_path / "o.jsonl"), text="a\nb\nc\n", redis_url=redis_url,
                                    namespace=namespace, plain=True))
    assert summary.written == 3
    (run,) = bulk_runs(r, keys)
    assert (run["state"], run["done"], run["total"], run["failed"], run["output"], run["priority"]) == (
        "finished", 3, 3, 0, "o.jsonl", "background")
    assert run["eta_s"] is None and r.ttl(keys.bulk_run(run["id"])) == -1  # no TTL: kept while listed
    assert r.zscore(keys.bulk_runs, run["id"]) is None and r.zscore(keys.bulk_runs_finished, run["id"]) is not None
    # a killed run: its report expired; the index entry left behind is skipped, then pruned by the next writer
    r.zadd(keys.bulk_runs, {"killed": int(time.time() * 1000) - (RUN_TTL_S + 1) * 1000})
    assert [b["id"] for b in bulk_runs(r, keys)] == [run["id"]]
    reporter = RunReporter(redis.asyncio.Redis.from_url(redis_url), keys, "other", "in.txt", None, Summary(total=9),
                           "interactive")
    asyncio.run(reporter.report())
    assert [m.decode() for m in r.zrange(keys.bulk_runs, 0, -1)] == ["other"]
    assert [(b["id"], b["state"], b["input"], b["total"], b["priority"]) for b in bulk_runs(r, keys)] == [
        ("other", "running", "in.txt", 9, "interactive"), (run["id"], "finished", "-", 3, "background")]
    # bounded: FINISHED_KEPT + 2 more runs end; the registry keeps the last FINISHED_KEPT and deletes the others
    ended = [run["id"], *(f"r{i}" for i in range(FINISHED_KEPT + 2))]

    async def end_all() -> None:
        client = redis.asyncio.Redis.from_url(redis_url)
        for i, run_id in enumerate(ended[1:]):
            await RunReporter(client, keys, run_id, None, None, Summary(total=1, written=1)).report(
                "stopped" if i % 2 else "finished")
        await client.aclose()

    asyncio.run(end_all())
    kept = {m.decode() for m in r.zrange(keys.bulk_runs_finished, 0, -1)}
    assert len(kept) == FINISHED_KEPT and ended[-1] in kept
    assert {i for i in ended if r.exists(keys.bulk_run(i))} == kept  # no report outlives its index entry
    listed = bulk_runs(r, keys)
    assert [b["id"] for b in listed][:2] == ["other", ended[-1]] and len(listed) == 1 + SHOWN_FINISHED
    assert {b["state"] for b in listed[1:]} == {"finished", "stopped"}
    # a stopped run run again reports as running: out of the ended ones
    asyncio.run(RunReporter(redis.asyncio.Redis.from_url(redis_url), keys, ended[-1], None, None,
                            Summary(total=1)).report())
    assert r.zscore(keys.bulk_runs_finished, ended[-1]) is None
    assert [b["state"] for b in bulk_runs(r, keys) if b["id"] == ended[-1]] == ["running"]
    r.close()


def test_history_one_sample_per_slot_with_ttft_from_the_heartbeats(start_worker, redis_url, namespace):
    start_worker(max_wait_ms=5)
    keys = Keys(namespace)
    a, b = redis.Redis.from_url(redis_url), redis.Redis.from_url(redis_url)  # two gateways' samplers
    with Client(redis_url, namespace) as client:
        client.generate_many([[5] * 4, [6] * 40, [7] * 4], max_new_tokens=3, timeout=60)
    wait_until(lambda: take_sample(a, keys)["results_1m"] >= 3, 30, "a heartbeat counting the results", 0.2)
    sample = take_sample(a, keys)
    assert sample["live"] == 1 and sample["ttft_ms"] > 0 and sample["queued_interactive"] == 0
    wrote = [record_sample(a, keys), record_sample(b, keys)]
    if wrote == [True, True]:  # the slot turned between the two: a third in the same slot is refused
        wrote.append(record_sample(a, keys))
    assert wrote.count(True) == len(wrote) - 1 and wrote[-1] is False
    rows = history(a, keys)
    assert len(rows) == a.xlen(keys.history) == wrote.count(True)
    assert rows[-1]["live"] == 1 and rows[-1]["results_1m"] >= 3 and rows[-1]["t"] <= time.time()
    assert history(a, keys, int(rows[-1]["t"] * 1000)) == []
    a.close()
    b.close()


def test_history_samples_ttft_per_priority(start_worker, redis_url, namespace):
    """Issue 58, item 3c: the heartbeat's one-minute TTFT mean per priority, and the history sample's, are the
    means of the results each priority got (a background backlog no longer lifts the interactive figure)."""
    start_worker(max_wait_ms=5)
    keys, r = Keys(namespace), redis.Redis.from_url(redis_url)
    with Client(redis_url, namespace) as client:
        interactive = client.generate_many([[5] * 4, [6] * 30], max_new_tokens=2, timeout=60)
        background = client.generate_many([[7] * 4, [8] * 8, [9] * 20], max_new_tokens=2, timeout=60,
                                          priority="background")
    wait_until(lambda: (take_sample(r, keys).get("results_1m_interactive"), take_sample(r, keys).get(
        "results_1m_background")) == (2, 3), 30, "a heartbeat counting the results per priority", 0.2)
    sample = take_sample(r, keys)

    def mean(results) -> float:
        return sum(res.ttft_ms for res in results) / len(results)

    assert sample["ttft_ms_interactive"] == pytest.approx(mean(interactive), abs=0.06)
    assert sample["ttft_ms_background"] == pytest.approx(mean(background), abs=0.06)
    assert sample["results_1m"] == 5 and sample["ttft_ms"] == pytest.approx(mean(interactive + background), abs=0.06)
    assert record_sample(r, keys)  # no other sampler runs here: this slot is ours
    (row,) = history(r, keys)[-1:]
    assert row["ttft_ms_interactive"] == sample["ttft_ms_interactive"] and row["results_1m_background"] == 3
    r.close()


def test_operator_key_sees_the_dashboard_and_status_and_cannot_call_the_model(redis_url, namespace, start_gateway):
    gw = start_gateway(api_keys=KEY, operator_keys=OPERATOR)
    with httpx.Client(base_url=gw.url, timeout=30) as http:
        def get(path: str, key: str | None) -> httpx.Response:
            return http.get(path, headers={"Authorization": f"Bearer {key}"} if key else {})
        assert get("/dashboard/data", OPERATOR).status_code == 200
        assert get("/dashboard/data", KEY).json()["error"]["code"] == "operator_key_required"
        assert get("/dashboard/data", KEY).status_code == 403 and get("/dashboard/data", None).status_code == 401
        refused = get("/v1/models", OPERATOR)
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "operator_key_read_only"
        assert get("/v1/models", None).status_code == 401
        assert get("/dashboard/data?history_after=x", OPERATOR).status_code == 400
    ok = run_status(redis_url, "elsewhere", "--gateway", gw.url, "--operator-key", OPERATOR)
    assert ok.returncode == 0 and namespace in ok.stdout and "bulk runs (batchfleet bulk):\nnone" in ok.stdout, ok
    as_json = json.loads(run_status(redis_url, namespace, "--json", "--gateway", gw.url, "--operator-key",
                                    OPERATOR).stdout)
    assert as_json["namespace"] == namespace and as_json["batch_jobs"] == [] and "history" not in as_json
    refused = run_status(redis_url, namespace, "--gateway", gw.url, "--operator-key", KEY)
    assert refused.returncode == 1 and "HTTP 403" in refused.stderr and "operator key" in refused.stderr


@pytest.mark.unit
def test_operator_keys_are_not_api_keys():
    with pytest.raises(ConfigError, match="operator key"):
        DashboardConfig(api_keys="same-key-123", operator_keys="same-key-123")
    assert DashboardConfig(operator_keys="a-long-key-1,b-long-key-2").operator_keys == ("a-long-key-1", "b-long-key-2")


@pytest.mark.unit
def test_batch_job_row_progress_rate_and_eta():
    doc = {"id": "batch_1", "status": "in_progress", "in_progress_at": 1000, "created_at": 990,
           "request_counts": {"total": 100, "completed": 15, "failed": 5}}
    row = batch_job_row(doc, None, now=1010)
    assert (row["completed"], row["failed"], row["total"], row["rate"], row["eta_s"]) == (15, 5, 100, 2.0, 40.0)
    assert batch_job_row(doc, 1005, now=1010)["status"] == "cancelling"
    done = batch_job_row({**doc, "status": "completed", "completed_at": 1050}, None, now=2000)
    assert done["rate"] == 0.4 and done["eta_s"] is None and done["ended_at"] == 1050
    assert batch_job_row({"id": "batch_2", "status": "validating"}, None, now=1)["rate"] is None


@pytest.mark.unit
def test_status_text_shows_batch_jobs_and_bulk_runs_with_progress_rate_and_eta():
    snap = {"batch_jobs": [batch_job_row({"id": "batch_1", "status": "in_progress", "in_progress_at": 1000,
                                          "request_counts": {"total": 2000, "completed": 500, "failed": 0}},
                                         None, now=1100)],
            "bulk_runs": [{"id": "b1", "state": "running", "input": "in.txt", "output": "out.jsonl", "done": 30,
                           "total": 40, "rate": 2.0, "eta_s": 5.0, "failed": 1, "host": "h", "pid": 7}]}
    text = "\n".join(render_work(snap))
    assert "batch jobs (/v1/batches):" in text and "bulk runs (batchfleet bulk):" in text
    assert re.search(r"batch_1\s+in_progress\s+500/2000 \(25%\)\s+5\.0/s\s+5\.0m\s+0", text), text
    assert re.search(r"b1\s+running\s+in\.txt -> out\.jsonl\s+30/40 \(75%\)\s+2\.0/s\s+5\.0s\s+1\s+h:7", text), text
    assert render_work({"batch_jobs": [], "bulk_runs": []}) == ["", "batch jobs (/v1/batches):", "none", "",
                                                                "bulk runs (batchfleet bulk):", "none"]
