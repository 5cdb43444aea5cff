"""``--log-format json``: one JSON object per line with time, level, logger, message and, where they apply,
job, bucket and worker; ``text`` stays the default."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import redis

from batchfleet.common import logs
from batchfleet.common.keys import Keys
from batchfleet.common.options import option_args
from batchfleet.worker.devtools import WorkerProcess, wait_for_heartbeat
from tests.conftest import TEST_BUCKETS, TEST_WORKER
from tests.helpers.loops import wait_until


@pytest.mark.unit
def test_json_formatter_fields():
    rec = logging.LogRecord("batchfleet.x", logging.WARNING, __file__, 1, "job %s\nfailed", ("j1",), None)
    rec.job, rec.bucket = "j1", 64
    out = json.loads(logs.JsonFormatter().format(rec))
    assert out["level"] == "WARNING" and out["logger"] == "batchfleet.x" and out["message"] == "job j1\nfailed"
    assert out["job"] == "j1" and out["bucket"] == 64 and out["time"].endswith("+00:00")
    plain = json.loads(logs.JsonFormatter().format(logging.LogRecord("a", logging.INFO, "", 1, "hi", None, None)))
    assert "job" not in plain and "bucket" not in plain
    try:
        raise ValueError("boom")
    except ValueError:
        rec = logging.LogRecord("a", logging.ERROR, "", 1, "failed", None, sys.exc_info())
    assert "ValueError: boom" in json.loads(logs.JsonFormatter().format(rec))["exc_info"]
    text = logs.formatter("text").format(logging.LogRecord("a", logging.INFO, "", 1, "hi", None, None))
    assert re.match(r"^\d{4}-\d\d-\d\d .* INFO a: hi$", text)


def test_worker_logs_json_lines(redis_url: str, namespace: str, tiny_model_dir: Path, tmp_path: Path):
    name = f"w-{uuid.uuid4().hex[:8]}"
    args = [*option_args({**TEST_WORKER, "buckets": ",".join(map(str, TEST_BUCKETS)), "model": str(tiny_model_dir)}),
            "--log-format", "json"]
    err = open(tmp_path / "stderr", "wb")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen([sys.executable, "-m", "batchfleet.worker", "--redis-url", redis_url, "--namespace",
                             namespace, "--name", name, *args], stdout=subprocess.DEVNULL, stderr=err)
    wp = WorkerProcess(name, proc, Keys(namespace))
    keys, r = Keys(namespace), redis.Redis.from_url(redis_url)
    try:
        wait_for_heartbeat(redis_url, wp, 180)
        # an entry nobody can be answered on is dead-lettered with a warning about that job
        r.xadd(keys.stream(TEST_BUCKETS[1]), {"id": "job-log-1", "r": "nope", "p": b"x"})
        wait_until(lambda: r.xlen(keys.dead) == 1, 30, "the dead letter")
    finally:
        assert wp.stop() == 0
        err.close()
        r.close()
    lines = (tmp_path / "stderr").read_text().splitlines()
    records = [json.loads(line) for line in lines]  # every line is one JSON object
    assert all({"time", "level", "logger", "message"} <= set(x) for x in records)
    assert all(x.get("worker") == name for x in records), records
    (gave_up,) = [x for x in records if "giving up" in x["message"]]
    assert gave_up["level"] == "WARNING" and gave_up["job"] == "job-log-1" and gave_up["bucket"] == TEST_BUCKETS[1]
    assert any("serving buckets" in x["message"] for x in records)


def test_cli_log_format_option():
    proc = subprocess.run([sys.executable, "-m", "batchfleet.common.cli", "--log-format", "yaml", "status"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "'yaml' is not one of 'text', 'json'" in proc.stderr
