"""The OpenAI Batch API on the gateway, driven by the official ``openai`` client: files.create, batches.create,
retrieve until done, files.content, list, cancel; a malformed file fails the whole batch; each key sees
only its own files and batches; ``batchfleet bulk`` on the same file gives the same answers."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import openai
import pytest
import redis

from batchfleet.common.keys import Keys
from tests.conftest import TEST_BUCKETS

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]
KEY_A, KEY_B = "key-a-" + "x" * 24, "key-b-" + "y" * 24
JSON = {"content-type": "application/json"}


def batch_line(custom_id: str, body: dict, url: str = "/v1/chat/completions") -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body}) + "\n"


def chat(text: str, max_tokens: int = 3, **kw) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0, **kw}


def wait_until(client: openai.OpenAI, batch_id: str, statuses: tuple[str, ...], timeout: float = 120):
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}: {batch}"
        time.sleep(0.2)


def enqueued(redis_url: str, namespace: str, priority: str = "background") -> int:
    """Jobs ever enqueued in one class's streams (every bucket)."""
    r = redis.Redis.from_url(redis_url)
    keys = [Keys(namespace).stream(b, priority) for b in TEST_BUCKETS]
    return sum(r.xinfo_stream(k)["entries-added"] for k in keys if r.exists(k))


def lines_of(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def test_batch_with_the_openai_client_and_bulk_on_the_same_file(start_worker, start_gateway, redis_url, namespace,
                                                               tmp_path):
    start_worker(max_wait_ms=5)
    gw = start_gateway(api_keys=(KEY_A, KEY_B), served_model_names=("tiny",), files_dir=str(tmp_path / "files"))
    a = openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY_A, max_retries=0, timeout=60)
    b = openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY_B, max_retries=0, timeout=60)
    text = ("".join(batch_line(f"r{i}", chat(f"question {i}")) for i in range(6))
            + batch_line("bad", chat("x", temperature="hot"))
            + batch_line("long", chat("x", max_tokens=10**6)))
    src = tmp_path / "batch.jsonl"
    src.write_text(text)
    uploaded = a.files.create(file=("batch.jsonl", io.BytesIO(text.encode())), purpose="batch")
    assert uploaded.bytes == len(text.encode()) and uploaded.purpose == "batch"
    batch = a.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h",
                             metadata={"job": "nightly"})
    assert batch.status == "validating" and batch.metadata == {"job": "nightly"}
    done = wait_until(a, batch.id, ("completed", "failed"))
    assert done.status == "completed", done
    assert done.request_counts.total == 8 and done.request_counts.completed == 6 and done.request_counts.failed == 2
    assert done.in_progress_at and done.finalizing_at and done.completed_at
    out, errors = lines_of(a, done.output_file_id), lines_of(a, done.error_file_id)
    assert sorted(o["custom_id"] for o in out) == [f"r{i}" for i in range(6)]
    assert all(o["response"]["status_code"] == 200 for o in out)
    assert {e["custom_id"]: e["response"]["status_code"] for e in errors} == {"bad": 400, "long": 400}
    long = next(e for e in errors if e["custom_id"] == "long")["response"]["body"]["error"]
    assert long["code"] == "context_length_exceeded" and long["param"] == "max_tokens"
    # the same request over HTTP gets the same refusal
    with pytest.raises(openai.BadRequestError) as refused:
        a.chat.completions.create(**chat("x", temperature="hot"))
    bad = next(e for e in errors if e["custom_id"] == "bad")["response"]["body"]
    assert refused.value.body == bad["error"]
    # a key sees only its own
    assert [x.id for x in a.batches.list()] == [batch.id]
    assert list(b.batches.list()) == [] and uploaded.id not in [f.id for f in b.files.list()]
    with pytest.raises(openai.NotFoundError):
        b.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        b.files.content(uploaded.id)
    with pytest.raises(openai.ConflictError):
        a.batches.cancel(batch.id)
    assert {f.id for f in a.files.list()} == {uploaded.id, done.output_file_id, done.error_file_id}
    # batchfleet bulk on the same file: the same answers
    dst = tmp_path / "out.jsonl"
    proc = subprocess.run([sys.executable, "-m", "batchfleet.common.cli", "bulk", str(src), "-o", str(dst),
                           "--redis-url", redis_url, "--namespace", namespace, "--served-model-name", "tiny"],
                          cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 3, proc.stderr[-2000:]
    bulk_out = {o["custom_id"]: o for o in map(json.loads, dst.read_text().splitlines())}

    def answer(o: dict) -> str:
        return o["response"]["body"]["choices"][0]["message"]["content"]

    assert {k: answer(v) for k, v in bulk_out.items()} == {o["custom_id"]: answer(o) for o in out}
    assert a.files.delete(uploaded.id).deleted
    with pytest.raises(openai.NotFoundError):
        a.files.retrieve(uploaded.id)
    # batches run at background priority: 7 jobs (n=1 x 6 and the request refused at submission: none) per run
    assert enqueued(redis_url, namespace) == 12 and enqueued(redis_url, namespace, "interactive") == 0


def test_malformed_file_fails_whole_and_cancel_finalizes(start_worker, start_gateway, namespace, redis_url,
                                                         tmp_path):
    gw = start_gateway(served_model_names=("tiny",), files_dir=str(tmp_path / "files"))
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0, timeout=60)
    malformed = (batch_line("a", chat("x")) + "{not json\n" + batch_line("a", chat("y"))
                 + batch_line("c", chat("z"), url="/v1/completions"))
    f = client.files.create(file=("bad.jsonl", io.BytesIO(malformed.encode())), purpose="batch")
    failed = wait_until(client, client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                      completion_window="24h").id, ("failed",))
    assert [(e.line, e.code) for e in failed.errors.data] == [(2, "invalid_json_line"), (3, "duplicate_custom_id"),
                                                               (4, "mismatched_endpoint")]
    assert failed.output_file_id is None and failed.failed_at
    # cancel: a batch far longer than the test, cancelled while it runs
    worker = start_worker(max_wait_ms=5, max_running=1, max_batch_size=1)  # one at a time: slower than the test
    many = "".join(batch_line(f"r{i}", chat(f"q {i}", max_tokens=100, ignore_eos=True)) for i in range(200))
    f = client.files.create(file=("many.jsonl", io.BytesIO(many.encode())), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_until(client, batch.id, ("in_progress",))
    deadline = time.monotonic() + 60
    while client.batches.retrieve(batch.id).request_counts.completed < 2:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert client.batches.cancel(batch.id).status == "cancelling"
    cancelled = wait_until(client, batch.id, ("cancelled",), timeout=60)
    assert cancelled.cancelling_at and cancelled.cancelled_at
    out, errors = lines_of(client, cancelled.output_file_id), lines_of(client, cancelled.error_file_id)
    ids = [o["custom_id"] for o in out + errors]
    assert sorted(ids) == sorted(f"r{i}" for i in range(200))  # each exactly once
    assert 2 <= len(out) < 200 and {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    assert cancelled.request_counts.completed == len(out) and cancelled.request_counts.failed == len(errors)
    # the work stopped in the fleet: nothing of the batch is left queued or running
    r = redis.Redis.from_url(redis_url)
    streams = [k for k in (Keys(namespace).stream(b, "background") for b in TEST_BUCKETS) if r.exists(k)]
    deadline = time.monotonic() + 30
    while any(g["pending"] or g["lag"] for k in streams for g in r.xinfo_groups(k)):
        assert time.monotonic() < deadline, [r.xinfo_groups(k) for k in streams]
        time.sleep(0.2)
    # ... and the worker computed only what was written: every other job it skipped or stopped, cancelled; the
    # lines never sent (a run queues only what the fleet reads next, producer/bulk/queued.py) cost it nothing
    assert worker.loop.ledger["completed"] == len(out)
    assert worker.loop.ledger["cancelled"] == enqueued(redis_url, namespace) - len(out) <= len(errors)


def test_killed_runner_is_taken_over_and_every_request_appears_once(start_worker, start_gateway, redis_url,
                                                                    namespace, tmp_path):
    start_worker(max_wait_ms=5, max_running=2)
    files_dir = tmp_path / "files"
    gw = start_gateway(served_model_names=("tiny",), files_dir=str(files_dir), batch_runner=False)
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0, timeout=60)
    n, window = 150, 8
    text = "".join(batch_line(f"r{i}", chat(f"q {i}", max_tokens=24, ignore_eos=True)) for i in range(n))
    f = client.files.create(file=("in.jsonl", io.BytesIO(text.encode())), purpose="batch")

    def runner(log: Any = subprocess.DEVNULL) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "batchfleet.common.cli", "batches", "--redis-url", redis_url,
                                 "--namespace", namespace, "--files-dir", str(files_dir), "--served-model-name",
                                 "tiny", "--batch-window", str(window), "--batch-lease", "2"],
                                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log)

    first = runner()
    try:
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        run = json.loads(redis.Redis.from_url(redis_url).hget(Keys(namespace).openai_batch(batch.id), "run"))
        output = files_dir / run["output"]
        deadline = time.monotonic() + 90
        while not output.exists() or output.read_bytes().count(b"\n") < 20:
            assert time.monotonic() < deadline and first.poll() is None
            time.sleep(0.01)
        first.kill()  # SIGKILL mid-batch: no cleanup, the lease stays until it expires
        first.wait()
    finally:
        first.kill()
    before = output.read_bytes()
    before = before[:before.rfind(b"\n") + 1]
    assert 20 <= before.count(b"\n") < n
    assert client.batches.retrieve(batch.id).status == "in_progress"
    log = tmp_path / "second.log"
    with open(log, "wb") as log_file:
        second = runner(log_file)
        try:
            done = wait_until(client, batch.id, ("completed",), timeout=120)
        finally:
            second.kill()
            second.wait()
    logged = log.read_text()  # the runner says what it did (issue 31)
    assert f"batch {batch.id} taken over (in_progress)" in logged and f"batch {batch.id} completed: " in logged
    out = client.files.content(done.output_file_id).content
    assert out.startswith(before)  # what was written stays, untouched
    assert done.error_file_id is None and done.request_counts.completed == n
    assert sorted(json.loads(x)["custom_id"] for x in out.splitlines()) == sorted(f"r{i}" for i in range(n))
    # nothing written was computed again: at most the lines in flight at the kill were enqueued twice
    assert n <= enqueued(redis_url, namespace) <= n + window


def test_expired_batch_returns_what_completed_and_the_rest_as_expired(start_worker, start_gateway, redis_url,
                                                                      namespace, tmp_path):
    worker = start_worker(max_wait_ms=5, max_running=1, max_batch_size=1)
    gw = start_gateway(served_model_names=("tiny",), files_dir=str(tmp_path / "files"))
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0, timeout=60)
    many = "".join(batch_line(f"r{i}", chat(f"q {i}", max_tokens=100, ignore_eos=True)) for i in range(100))
    f = client.files.create(file=("many.jsonl", io.BytesIO(many.encode())), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="3s")
    done = wait_until(client, batch.id, ("expired", "completed"), timeout=60)
    assert done.status == "expired" and done.expired_at >= done.expires_at
    out, errors = lines_of(client, done.output_file_id), lines_of(client, done.error_file_id)
    assert sorted(o["custom_id"] for o in out + errors) == sorted(f"r{i}" for i in range(100))
    assert out and {e["error"]["code"] for e in errors} == {"batch_expired"}
    assert worker.loop.ledger["completed"] == len(out)


def test_hostile_requests_to_files_and_batches_get_clear_errors(start_gateway, tmp_path):
    import httpx

    gw = start_gateway(files_dir=str(tmp_path / "files"), max_file_mb=1)
    with httpx.Client(base_url=gw.url, timeout=30) as http:
        cases = [
            http.post("/v1/files", content=b"not multipart", headers={"content-type": "application/json"}),
            http.post("/v1/files", files={"file": ("x.jsonl", b"{}\n")}),  # no purpose
            http.post("/v1/files", files={"file": ("x.jsonl", b"{}\n")}, data={"purpose": "fine-tune"}),
            http.post("/v1/files", files={"file": ("x.jsonl", b"x" * (2 << 20))}, data={"purpose": "batch"}),
            http.post("/v1/files", content=b"--b\r\ngarbage",
                      headers={"content-type": "multipart/form-data; boundary=b"}),
            http.get("/v1/files/../../etc/passwd"), http.get("/v1/files/file-" + "0" * 24 + "/content"),
            http.get("/v1/files", params={"limit": "-1"}), http.get("/v1/batches", params={"limit": "x"}),
            http.post("/v1/batches", json={"input_file_id": "file-x", "endpoint": "/v1/chat/completions"}),
            http.post("/v1/batches", json={"input_file_id": 7, "endpoint": "/v1/chat/completions"}),
            http.post("/v1/batches", json={"input_file_id": "f", "endpoint": "/v1/moderations"}),
            http.post("/v1/batches", json={"input_file_id": "f", "endpoint": "/v1/completions",
                                           "completion_window": "forever"}),
            http.post("/v1/batches", json={"input_file_id": "f", "endpoint": "/v1/completions", "extra": 1}),
            http.post("/v1/batches", content=b"\xff\xfe", headers=JSON),
            http.post("/v1/batches", content=b"[" * 5000, headers=JSON),
            http.get("/v1/batches/batch_nope"), http.post("/v1/batches/batch_" + "0" * 24 + "/cancel"),
        ]
        statuses = [r.status_code for r in cases]
        assert statuses == [400, 400, 400, 413, 400, 404, 404, 400, 400, 404, 400, 400, 400, 400, 400, 400,
                            404, 404], [(r.status_code, r.text[:200]) for r in cases]
        assert all(set(r.json()["error"]) == {"message", "type", "param", "code"} for r in cases)
        good = http.post("/v1/files", files={"file": ("x.jsonl", b"{}\n")}, data={"purpose": "batch"}).json()
        assert good["bytes"] == 3 and http.get(f"/v1/files/{good['id']}/content").content == b"{}\n"
        assert http.get("/v1/files").json()["data"][0]["id"] == good["id"]
        assert not list((tmp_path / "files").glob("*.part"))  # the refused upload left nothing behind


def test_a_gateway_without_the_shared_files_volume_says_so(start_gateway, tmp_path):
    import httpx

    first = start_gateway(files_dir=str(tmp_path / "one"))
    other = start_gateway(files_dir=str(tmp_path / "other"))  # same Redis, another directory: misconfigured
    with httpx.Client(timeout=30) as http:
        f = http.post(first.url + "/v1/files", files={"file": ("x.jsonl", b"{}\n")}, data={"purpose": "batch"}).json()
        assert http.get(f"{first.url}/v1/files/{f['id']}/content").content == b"{}\n"
        missing = http.get(f"{other.url}/v1/files/{f['id']}/content")
    assert missing.status_code == 500 and missing.json()["error"]["code"] == "file_unavailable"
    assert "same files volume" in missing.json()["error"]["message"]


def test_an_input_deleted_while_its_batch_waits_fails_it_keeping_what_was_written(start_worker, start_gateway,
                                                                                   tmp_path):
    start_worker(max_wait_ms=5, max_running=1, max_batch_size=1)
    files_dir = str(tmp_path / "files")
    api = start_gateway(served_model_names=("tiny",), files_dir=files_dir, batch_runner=False)
    client = openai.OpenAI(base_url=api.url + "/v1", api_key="none", max_retries=0, timeout=60)
    # slower than the test even on a quiet machine (a run queuing only the fleet's next read measured faster)
    many = "".join(batch_line(f"r{i}", chat(f"q {i}", max_tokens=50, ignore_eos=True)) for i in range(300))
    f = client.files.create(file=("many.jsonl", io.BytesIO(many.encode())), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    runner = start_gateway(files_dir=files_dir, served_model_names=("tiny",))
    deadline = time.monotonic() + 60
    while client.batches.retrieve(batch.id).request_counts.completed < 2:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    runner.stop()  # its run stops, the lease is released; the batch waits, in progress
    assert client.batches.retrieve(batch.id).status == "in_progress"
    assert client.files.delete(f.id).deleted
    start_gateway(files_dir=files_dir, served_model_names=("tiny",))  # the next runner finds the input gone
    failed = wait_until(client, batch.id, ("failed",), timeout=30)
    assert [e.code for e in failed.errors.data] == ["file_not_found"]
    out = lines_of(client, failed.output_file_id)
    assert len(out) == failed.request_counts.completed >= 2  # what was written stays readable
