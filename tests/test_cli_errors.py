"""``batchfleet submit`` / ``bulk`` / ``status`` fail with one line (``Error: ...``, exit 1), never a
traceback, and never show a Redis password. Real Redis, real subprocesses (a traceback is what a
person would see, so the commands run as ``python -m batchfleet.common.cli``)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import click
import pytest
import redis
from click.testing import CliRunner

from batchfleet.common.errors import (
    FleetUnavailable,
    InvalidRequest,
    JobFailed,
    NoWorkers,
    PromptTooLong,
    QueueFull,
    RedisUnavailable,
    Timeout,
)
from batchfleet.producer.cli import error_line, one_line_errors

SECRET = "s3cret-pw"


def cli(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHFLEET_")}
    return subprocess.run([sys.executable, "-m", "batchfleet.common.cli", *argv], capture_output=True, text=True,
                          timeout=120, env=env, cwd=cwd)


def one_line(proc: subprocess.CompletedProcess, exit_code: int = 1) -> str:
    """The command's single ``Error: ...`` line, after checking there is nothing else on stderr."""
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out, out
    assert SECRET not in out, out
    assert proc.returncode == exit_code, out
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), out
    return lines[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def prompts_file(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "hello"}) + "\n")
    return path


@pytest.mark.parametrize("command", ["submit", "bulk", "status"])
def test_unreachable_redis_is_one_line(command, prompts_file):
    url = f"redis://user:{SECRET}@127.0.0.1:{free_port()}/0"
    args = {"submit": ["hello"], "bulk": [str(prompts_file)], "status": []}[command]
    line = one_line(cli(command, *args, "--redis-url", url))
    assert "unreachable" in line and "user:***@127.0.0.1" in line


@pytest.mark.parametrize("url", [f"redis://u:{SECRET}@localhost:notaport/0", f"http://u:{SECRET}@localhost:6379",
                                 f"redis://u:{SECRET}@localhost:6379/db", f"redis://:{SECRET}@:6379"])
def test_malformed_url_hides_the_password(url):
    for proc in (cli("submit", "hello", "--redis-url", url), cli("status", "--redis-url", url)):
        out = proc.stdout + proc.stderr
        assert proc.returncode == 2 and "Invalid value for '--redis-url'" in out, out
        assert SECRET not in out and "Traceback" not in out and "***@" in out, out


def test_wrong_password_is_one_line(redis_url):
    host = redis_url.split("://", 1)[1].rsplit("@", 1)[-1]
    line = one_line(cli("submit", "hello", "--redis-url", f"redis://nobody:{SECRET}@{host}"))
    assert "credentials" in line or "unreachable" in line, line


def test_no_workers_is_one_line(redis_url, namespace, prompts_file):
    for argv in (["submit", "hello"], ["bulk", str(prompts_file)]):
        line = one_line(cli(*argv, "--redis-url", redis_url, "--namespace", namespace))
        assert "NoWorkers" in line or "FleetUnavailable" in line, line
    proc = cli("status", "--redis-url", redis_url, "--namespace", namespace)
    assert proc.returncode == 0 and "no fleet published" in proc.stdout and "0 live workers" in proc.stdout


def test_request_errors_are_one_line(start_worker, redis_url, namespace):
    start_worker(max_wait_ms=10)
    conn = ["--redis-url", redis_url, "--namespace", namespace]
    line = one_line(cli("submit", "word " * 400, *conn))  # the test fleet's largest bucket is 256 tokens
    assert line.startswith("Error: PromptTooLong: "), line
    line = one_line(cli("submit", "hello", "--temperature", "-3", *conn))
    assert line.startswith("Error: InvalidRequest: "), line


def test_timeout_is_one_line_and_says_how_long(start_worker, redis_url, namespace):
    # a dynamic batch that waits a minute to fill: the job is still queued when the caller gives up
    start_worker(max_wait_ms=60_000, max_batch_size=64, window="fixed")
    line = one_line(cli("submit", "hello", "--timeout", "1.5", "--redis-url", redis_url, "--namespace", namespace))
    # how long was waited is the caller's timeout, not what was left of it after submitting (issue #10
    # quotes "within 4.995498890999897 s"); whether a worker is alive is said too
    assert line.startswith("Error: Timeout: ") and "within 1.5 s" in line and "worker" in line, line


URL = f"redis://user:{SECRET}@redis.example:6379/0"


@pytest.mark.parametrize("exc", [
    NoWorkers("no live worker under namespace 'x'"), FleetUnavailable("no fleet"),
    Timeout("no result for job j within 2.0 s; 1 worker alive"), PromptTooLong("prompt has 900 tokens"),
    InvalidRequest("temperature must be 0 or in [0.01, 100]"), QueueFull("bucket 128 is full"),
    JobFailed("j", "engine_error", "boom\nwith a second line"), RedisUnavailable("down for 30 s"),
    redis.ConnectionError("Error 111 connecting"), redis.TimeoutError("Timeout reading from socket"),
    redis.AuthenticationError("invalid username-password pair"), redis.ResponseError("NOPERM no permissions"),
])
def test_each_expected_failure_is_one_line(exc):
    @click.command()
    @click.option("--redis-url", default=URL)
    @one_line_errors
    def fails(redis_url: str) -> None:
        raise exc

    res = CliRunner().invoke(fails, [])
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit), res.output  # handled, not raised
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and SECRET not in res.output, res.output
    assert error_line(exc, URL) is not None


def test_a_bug_keeps_its_traceback():
    assert error_line(KeyError("x"), URL) is None
