"""``batchfleet bulk`` runs as its users found them: a rerun after deleting the output (or with --no-resume)
starts over and finishes, exit codes say whether any line failed and the counts are honest on resume, the
run's job ids and inbox cannot be computed by another producer, and answers that never come expire together
(each job's timeout runs from its own submission)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import redis

from batchfleet.common.keys import Keys
from batchfleet.common.wire.priority import BACKGROUND
from batchfleet.producer.bulk.file_run import bulk_file
from tests.conftest import TEST_BUCKETS
from tests.helpers.loops import silent_fleet

ROOT = Path(__file__).resolve().parents[1]


def bulk_cli(src: Path, dst: Path, redis_url: str, namespace: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "batchfleet.common.cli", "bulk", str(src), "-o", str(dst),
                           "--redis-url", redis_url, "--namespace", namespace, "--max-new-tokens", "2", *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def last_line(proc: subprocess.CompletedProcess) -> str:
    return proc.stderr.replace("\r", "\n").strip().splitlines()[-1]


def test_rerun_after_deleting_the_output_or_with_no_resume_starts_over(start_worker, redis_url, namespace, tmp_path):
    start_worker(max_wait_ms=5)
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"line {i}", "id": f"q{i}"}) + "\n" for i in range(12)))
    first = bulk_cli(src, dst, redis_url, namespace)
    assert first.returncode == 0, first.stderr[-2000:]
    key = (tmp_path / "out.jsonl.run").read_text()
    dst.unlink()
    again = bulk_cli(src, dst, redis_url, namespace)  # hung before: its job ids were answered already
    assert again.returncode == 0 and "12 submitted" in last_line(again), again.stderr[-2000:]
    assert (tmp_path / "out.jsonl.run").read_text() != key
    over = bulk_cli(src, dst, redis_url, namespace, "--no-resume")
    assert over.returncode == 0 and "12 submitted" in last_line(over), over.stderr[-2000:]
    out = [json.loads(x) for x in dst.read_text().splitlines()]
    assert sorted(o["index"] for o in out) == list(range(12)) and all("result" in o for o in out)
    kept = bulk_cli(src, dst, redis_url, namespace)  # resumes: nothing left to do
    assert kept.returncode == 0 and "12 kept from an earlier run" in last_line(kept)
    batch_stream = Keys(namespace).stream(TEST_BUCKETS[0], BACKGROUND)  # bulk runs at background priority
    assert redis.Redis.from_url(redis_url).xinfo_groups(batch_stream)[0]["entries-read"] == 36


def test_exit_codes_and_counts_are_honest_on_resume(start_worker, redis_url, namespace, tmp_path):
    start_worker(max_wait_ms=5)
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text('{"prompt": "ok"}\n{"prompt": "x", "bogus": 1}\n{broken\n')
    first = bulk_cli(src, dst, redis_url, namespace)
    assert first.returncode == 3 and last_line(first).endswith("2 failed"), first.stderr[-2000:]
    again = bulk_cli(src, dst, redis_url, namespace)
    assert again.returncode == 3, again.stderr[-2000:]
    assert last_line(again).endswith("2 failed (2 of them kept from an earlier run)"), again.stderr
    src.write_text("{broken\n")
    all_bad = bulk_cli(src, tmp_path / "bad.jsonl", redis_url, namespace)
    assert all_bad.returncode == 3 and last_line(all_bad).endswith("1 failed")


def test_missing_answers_expire_together_not_one_after_another(redis_url, namespace, tmp_path):
    # a live "worker" that publishes the fleet and never reads: no answer ever comes
    with silent_fleet(redis_url, namespace):
        src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
        src.write_text("".join(json.dumps({"prompt": f"p{i}", "max_new_tokens": 2}) + "\n" for i in range(20)))
        t0 = time.monotonic()
        summary = asyncio.run(bulk_file(str(src), str(dst), redis_url=redis_url, namespace=namespace, timeout=1.0))
        took = time.monotonic() - t0
    out = [json.loads(x) for x in dst.read_text().splitlines()]
    assert summary.failed == 20 and all(o["error"]["code"] == "deadline_exceeded" for o in out)
    assert took < 8, f"20 missing answers took {took:.1f} s: they waited one after another"
    assert os.path.exists(str(dst) + ".run")
