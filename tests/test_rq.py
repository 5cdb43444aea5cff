"""RQ as the front door: real ``rq worker --burst`` processes (JSON serializer) against the real Redis and a
real fleet worker; job functions enqueued by dotted name. Each test's queue removes its RQ keys afterwards
(tests/helpers/rq.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
import redis

from batchfleet.common.keys import Keys
from batchfleet.producer import Client
from tests.helpers.rq import remove_rq_keys

ROOT = Path(__file__).resolve().parents[1]

# the web backend's side: rq and redis only (no batchfleet, no torch), enqueue by name, wait for the answer
ENQUEUE = """
import json, sys, time
from redis import Redis
from rq import Queue
from rq.serializers import JSONSerializer
q = Queue(sys.argv[2], connection=Redis.from_url(sys.argv[1]), serializer=JSONSerializer)
job = q.enqueue("batchfleet.producer.rq.generate", "The quick brown fox", max_new_tokens=6)
print(job.id, flush=True)
end = time.monotonic() + 240
while job.get_status(refresh=True) not in ("finished", "failed") and time.monotonic() < end:
    time.sleep(0.05)
print(json.dumps({"status": job.get_status(), "result": job.return_value(),
                  "torch": "torch" in sys.modules, "batchfleet": "batchfleet" in sys.modules}))
"""


def test_rq_stays_optional():
    """Neither the producer package nor its rq module imports rq (or torch) until an RQ job runs."""
    code = ("import sys, batchfleet.producer, batchfleet.producer.rq; "
            "assert 'rq' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/", timeout=60)


@pytest.fixture
def queue(redis_url: str):
    """A queue of its own; afterwards every key of it, its jobs and its workers is deleted, and none is left."""
    pytest.importorskip("rq")
    from rq import Queue
    from rq.serializers import JSONSerializer

    r = redis.Redis.from_url(redis_url)
    q = Queue(f"bf-test-{uuid.uuid4().hex[:8]}", connection=r, serializer=JSONSerializer)
    yield q
    q.delete(delete_jobs=True)
    r.close()
    remove_rq_keys(redis_url, q.name)


def _rq_worker(redis_url: str, namespace: str, queue, **kw) -> subprocess.Popen:
    """``rq worker --burst --serializer JSON`` in its own process group (a kill takes its work-horse too), named
    after its queue (its keys are found even once its own key has expired)."""
    return subprocess.Popen(
        [sys.executable, "-m", "rq.cli", "worker", "--burst", "--serializer", "rq.serializers.JSONSerializer",
         "--name", f"{queue.name}-{uuid.uuid4().hex[:6]}", "--url", redis_url, queue.name], cwd=ROOT,
        start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "BATCHFLEET_REDIS_URL": redis_url, "BATCHFLEET_NAMESPACE": namespace}, **kw)


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children of any of its threads, and theirs), from /proc's parent links."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def _kill_with_horse(worker: subprocess.Popen) -> None:
    """SIGKILL an rq worker and everything below it (its work-horse runs in a process group of its own), mid-job;
    returns once none of them is left to write a line."""
    os.killpg(worker.pid, signal.SIGSTOP)  # frozen first: nothing forks or writes while the tree is collected
    below = _descendants(worker.pid)
    for pid in below:
        os.kill(pid, signal.SIGKILL)
    os.killpg(worker.pid, signal.SIGKILL)
    worker.wait(30)
    for pid in below:  # gone (reaped by init once its parent died), so it can write no more lines
        end = time.monotonic() + 30
        while Path(f"/proc/{pid}").exists() and time.monotonic() < end:
            time.sleep(0.01)


def test_generate_by_name_from_a_process_without_torch(start_worker, redis_url, namespace, queue):
    start_worker(max_wait_ms=10)
    web = subprocess.Popen([sys.executable, "-c", ENQUEUE, redis_url, queue.name], cwd="/",
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    end = time.monotonic() + 60
    while queue.count == 0 and web.poll() is None and time.monotonic() < end:
        time.sleep(0.05)
    worker = _rq_worker(redis_url, namespace, queue)
    log, _ = worker.communicate(timeout=240)
    assert worker.returncode == 0, log[-3000:]
    out, err = web.communicate(timeout=240)
    assert web.returncode == 0, err[-3000:]
    answer = json.loads(out.strip().splitlines()[-1])
    assert answer["status"] == "finished", log[-3000:]
    assert not answer["torch"] and not answer["batchfleet"]
    result = answer["result"]
    assert {"text", "token_ids", "finish_reason", "prompt_tokens", "completion_tokens", "queue_ms", "ttft_ms",
            "total_ms", "worker", "batch_size"} <= set(result)
    with Client(redis_url, namespace) as client:
        direct = client.generate("The quick brown fox", max_new_tokens=6)
    assert result["text"] == direct.text and result["token_ids"] == direct.token_ids
    assert result["completion_tokens"] == 6 and result["finish_reason"] == "length"


def test_bulk_job_killed_and_retried_writes_every_line_once(start_worker, redis_url, namespace, queue,
                                                            tmp_path):
    from rq import Retry
    from rq.registry import StartedJobRegistry

    start_worker(engine="native", mode="continuous", kv_cache_gb=0.05, max_batch_size=64)
    n, window = 500, 32
    src = tmp_path / "prompts.jsonl"
    src.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"question {i} " + "word " * (i % 5),
                                       "max_new_tokens": 12 + i % 5}) + "\n" for i in range(n)))
    dst = tmp_path / "answers.jsonl"
    job = queue.enqueue("batchfleet.producer.rq.bulk", str(src), str(dst), window=window, retry=Retry(max=2),
                        job_timeout=600)

    first = _rq_worker(redis_url, namespace, queue)
    end = time.monotonic() + 240
    while (not dst.exists() or dst.read_text().count("\n") < 100) and first.poll() is None \
            and time.monotonic() < end:
        time.sleep(0.01)
    assert first.poll() is None, "the job ended before it could be killed"
    _kill_with_horse(first)
    before = [json.loads(x) for x in dst.read_text().splitlines()]
    assert 100 <= len(before) < n
    job.refresh()
    assert job.get_status() == "started" and 0 < job.meta["done"] < n  # progress was in job.meta

    # what RQ's maintenance does once the dead worker's heartbeat lapses: the abandoned job is retried
    StartedJobRegistry(queue=queue).cleanup(timestamp=time.time() + 3600)
    if job.get_status(refresh=True) == "failed":  # RQ < 2 fails an abandoned job instead of retrying it
        job.requeue()
    assert job.get_status(refresh=True) == "queued"
    second = _rq_worker(redis_url, namespace, queue)
    log, _ = second.communicate(timeout=600)
    assert second.returncode == 0, log[-3000:]
    job.refresh()
    assert job.get_status() == "finished", log[-3000:]
    summary = job.return_value()
    assert summary["kept"] == len(before) and summary["total"] == n and not summary["interrupted"]

    out = [json.loads(x) for x in dst.read_text().splitlines()]
    assert sorted(o["index"] for o in out) == list(range(n))  # every line exactly once
    assert sorted(o["id"] for o in out) == sorted(f"q{i}" for i in range(n))
    assert all("result" in o and o["result"]["completion_tokens"] == 12 + o["index"] % 5 for o in out)
    assert out[:len(before)] == before
    assert job.meta["done"] == n and job.meta["total"] == n

    computed: Counter[str] = Counter()
    for _id, fields in redis.Redis.from_url(redis_url).xrange(Keys(namespace).batches):
        computed.update(x for x in fields[b"ids"].decode().split(",") if x)
    twice = sum(1 for c in computed.values() if c > 1)
    assert len(computed) == n and twice <= window
    print(f"\nrq bulk: {len(before)} lines before the kill, {summary['collected']} collected, "
          f"{summary['submitted']} submitted by the retry, {twice} computed twice")
