"""``batchfleet bulk`` resumes: Ctrl-C midway, run it again, every line answered once, little recomputed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import redis

from batchfleet.common.keys import Keys
from batchfleet.common.wire.priority import BACKGROUND
from batchfleet.producer.bulk.files import RunNames, run_names
from batchfleet.producer.bulk.lines import parse_lines
from tests.conftest import TEST_BUCKETS, worker_config
from tests.helpers.loops import LoopThread

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.unit
def test_lines_are_named_from_the_run_key_and_checked():
    text = ['{"prompt": "a", "id": "doc-1"}', "", '{"prompt": "b", "max_new_token": 3}', '"plain"',
            '{"prompt": "c", "id": "doc-1"}', '{"prompt": "d", "id": "odd id/with spaces"}', "{bad",
            '{"prompt": "e", "id": true}']
    prefix = RunNames.fresh().prefix
    lines = parse_lines(text, prefix)
    assert [ln.index for ln in lines] == [0, 2, 3, 4, 5, 6, 7]  # line numbers: the blank line counts
    by = {ln.index: ln for ln in lines}
    assert by[0].job_id == f"{prefix}.doc-1" and by[0].error is None
    assert by[2].error["code"] == "invalid_request" and "max_new_token" in by[2].error["message"]
    assert by[3].error is None and by[3].obj == {"prompt": "plain"} and by[3].job_id == f"{prefix}.l3"
    assert by[4].error["code"] == "invalid_request" and "duplicate" in by[4].error["message"]
    assert by[5].error is None and by[5].job_id.startswith(prefix + ".h")  # hashed into a valid job id
    assert by[6].error["code"] == by[7].error["code"] == "invalid_request"
    assert [ln.job_id for ln in parse_lines(text, prefix)] == [ln.job_id for ln in lines]  # stable per key


@pytest.mark.unit
def test_run_key_is_random_kept_beside_the_output_and_read_back_on_resume(tmp_path):
    out = tmp_path / "out.jsonl"
    first, resumed = run_names(str(out), resume=True)  # no output yet: a new key, written (0600)
    assert not resumed and json.loads((tmp_path / "out.jsonl.run").read_text())["key"] == first.key
    assert (tmp_path / "out.jsonl.run").stat().st_mode & 0o777 == 0o600
    out.write_text("")
    again, resumed = run_names(str(out), resume=True)
    assert resumed and again == first
    fresh, resumed = run_names(str(out), resume=False)  # --no-resume: a new key replaces it
    assert not resumed and fresh.key != first.key and len({first.prefix, fresh.prefix}) == 2
    assert len(first.key) == 64 and first.inbox not in first.key and first.prefix[1:] not in first.key


def _bulk(src: Path, dst: Path, redis_url: str, namespace: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "batchfleet.common.cli", "bulk", str(src), "-o", str(dst),
                             "--redis-url", redis_url, "--namespace", namespace, "--window", "256"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _lines(dst: Path) -> list[dict]:
    return [json.loads(x) for x in dst.read_text().splitlines()] if dst.exists() else []


def _complete_lines(dst: Path) -> int:
    """Lines the running writer has finished (its last one may be half written when read)."""
    return dst.read_bytes().count(b"\n") if dst.exists() else 0


NATIVE = {"engine": "native", "mode": "continuous", "kv_cache_gb": 0.05, "max_batch_size": 64}


class GatedEngine:
    """TEST ONLY engine wrapper: nothing starts until ``gate`` is set (so queued jobs stay queued)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.gate = threading.Event()

    def add(self, requests) -> None:
        self.gate.wait(20)  # bounded: the worker's heartbeat waits too
        self.inner.add(requests)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


@pytest.mark.parametrize("fleet", ["running", "stopped"])
def test_interrupted_bulk_resumes_without_recomputing(fleet, start_worker, redis_url, namespace, tmp_path,
                                                      tiny_model_dir):
    """``stopped``: the only worker stops before the interrupt, and its successor starts nothing until the
    second run has enqueued its jobs, so the jobs in flight at the interrupt are still queued then: the
    second run enqueues them again, and each is still answered (and written) once."""
    worker = start_worker(**NATIVE)
    n = 2000
    src = tmp_path / "prompts.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"prompt {i} " + "word " * (i % 7),
                                       "max_new_tokens": 2 + i % 3}) + "\n" for i in range(n)))
    dst = tmp_path / "out.jsonl"

    first = _bulk(src, dst, redis_url, namespace)
    deadline = time.monotonic() + 300
    while _complete_lines(dst) < 300 and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert first.poll() is None, "the run ended before it could be interrupted"
    if fleet == "stopped":
        worker.stop()  # hands back what it held: the jobs in flight wait in the queue
    first.send_signal(signal.SIGINT)
    _, err = first.communicate(timeout=60)
    message = err.replace("\r", "\n").strip().splitlines()[-1]
    if fleet == "running" or first.returncode == 130:
        assert first.returncode == 130 and message.startswith("interrupted: "), err[-2000:]
    else:  # the run saw the fleet gone before the SIGINT: it stopped by itself, resumable alike (and the
        # SIGINT may have found it past its message, exiting: then the signal's default action ends it)
        assert first.returncode in (1, -signal.SIGINT), err[-2000:]
        assert message.startswith("stopped (no live worker"), err[-2000:]
    assert "run the same command again to resume" in message
    in_flight = int(message.split(" unanswered (")[1].split(" of them")[0])
    before = _lines(dst)
    written_before = len(before)
    assert 300 <= written_before < n and 0 <= in_flight <= 256, message
    gated = None
    if fleet == "stopped":
        assert in_flight > 0, message
        gated = LoopThread(worker_config(redis_url, namespace, tiny_model_dir, **NATIVE), wrap=GatedEngine)
    second = _bulk(src, dst, redis_url, namespace)
    if gated is not None:
        r = redis.Redis.from_url(redis_url)
        queued = sum(r.xlen(Keys(namespace).stream(b, BACKGROUND)) for b in TEST_BUCKETS)
        end = time.monotonic() + 60
        keys = Keys(namespace)
        while sum(r.xlen(keys.stream(b, BACKGROUND)) for b in TEST_BUCKETS) <= queued and time.monotonic() < end:
            time.sleep(0.01)  # until the second run has enqueued more
        gated.loop.engine.gate.set()
    _, err2 = second.communicate(timeout=600)
    if gated is not None:
        gated.stop()
    assert second.returncode == 0, err2[-2000:]
    summary = err2.replace("\r", "\n").strip().splitlines()[-1]
    collected = int(summary.split(" kept from an earlier run, ")[1].split(" collected")[0])
    assert collected <= in_flight, summary
    if gated is not None:  # answered only what the stopping worker finished: the rest was enqueued again
        assert collected < in_flight, summary
    out = _lines(dst)
    assert sorted(o["index"] for o in out) == list(range(n))  # every line exactly once
    assert all("result" in o for o in out), [o for o in out if "error" in o][:3]
    assert all(o["result"]["completion_tokens"] == 2 + o["index"] % 3 for o in out)
    assert out[:written_before] == before  # kept, not rewritten

    r = redis.Redis.from_url(redis_url)
    computed: Counter[str] = Counter()
    for _id, fields in r.xrange(Keys(namespace).batches):
        computed.update(x for x in fields[b"ids"].decode().split(",") if x)
    twice = sum(1 for c in computed.values() if c > 1)
    assert len(computed) == n
    assert twice <= in_flight, f"{twice} jobs computed twice, {in_flight} were in flight at the interrupt"
    print(f"\nbulk resume ({fleet} fleet): {written_before} lines before SIGINT, {in_flight} in flight, "
          f"{twice} computed twice; second run: {summary}")
