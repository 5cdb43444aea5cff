"""Start-up and liveness: the metrics port is bound before the model loads (a second worker on the same
port stops at once with one line, no traceback, never having joined the fleet); a worker that exits leaves
the live set at once; /metrics binds the host it is given."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import redis

from batchfleet.common.keys import Keys
from batchfleet.common.redis.fleetstate import live_workers
from batchfleet.worker.devtools import free_port


def _busy_port() -> tuple[socket.socket, int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # the worker's default bind address, where the clash happens
    sock.listen()
    return sock, sock.getsockname()[1]


def _worker(redis_url: str, namespace: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "batchfleet.worker", "--redis-url", redis_url, "--namespace",
                           namespace, *args], capture_output=True, text=True, timeout=120)


def test_metrics_port_in_use_stops_before_the_model_loads(redis_url: str, namespace: str, tmp_path: Path):
    sock, port = _busy_port()
    try:
        # a model path that does not exist: had the model been loaded first, that would be the error
        missing = str(tmp_path / "no-such-model")
        proc = _worker(redis_url, namespace, "--metrics-port", str(port), "--model", missing)
        assert proc.returncode == 1
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert lines[0].startswith(f"Error: cannot serve metrics on 127.0.0.1:{port}:") and "in use" in lines[0]
        assert not proc.stdout
        json_mode = _worker(redis_url, namespace, "--metrics-port", str(port), "--model", missing,
                            "--log-format", "json")
        assert json_mode.returncode == 1
        (record,) = [json.loads(line) for line in json_mode.stderr.strip().splitlines()]
        assert record["level"] == "ERROR" and "cannot serve metrics" in record["message"]
    finally:
        sock.close()
    r = redis.Redis.from_url(redis_url)
    keys = Keys(namespace)
    assert not r.exists(keys.fleet) and r.zcard(keys.workers) == 0, "it never joined the fleet"
    r.close()


def test_a_stopped_worker_leaves_the_live_set_at_once(start_worker, redis_url: str, namespace: str):
    """Stopping runs what a worker process does on its way out (worker/compose.py run_worker: the loop ends,
    the transport closes): no 30 s of being counted alive by status, /health and producers."""
    w = start_worker()
    name = w.loop.transport.name
    r = redis.Redis.from_url(redis_url)
    keys = Keys(namespace)
    assert len(live_workers(r, keys)) == 1
    w.stop()
    assert len(live_workers(r, keys)) == 0 and r.zscore(keys.workers, name) is None
    assert not r.exists(keys.worker(name)) and not r.exists(keys.fleet)
    r.close()


def test_metrics_bind_localhost_by_default_elsewhere_when_asked(start_worker):
    """/metrics has no key: it listens on 127.0.0.1 unless --metrics-host says otherwise (issue 32)."""
    port = free_port()
    w = start_worker(metrics_port=port)
    server = w.loop.observer.server
    assert server.server.server_address[0] == "127.0.0.1" and server.port == port
    anywhere = start_worker(metrics_port=free_port(), metrics_host="0.0.0.0")  # noqa: S104 - what is tested
    assert anywhere.loop.observer.server.server.server_address[0] == "0.0.0.0"
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert b"batchfleet_workers_live" in resp.read()
