"""Every process that serves metrics also serves the standard ``process_*`` metrics operators expect (issue 58,
item 3a): a real worker process (``python -m batchfleet.worker --metrics-port``) and a real gateway process
(``batchfleet serve --metrics-port``), each scraped over HTTP and parsed with prometheus_client's text parser;
each reports its own process (its start time is that pid's, read from /proc)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from batchfleet.worker.devtools import free_port, spawn_worker
from tests.test_dashboard_work import worker_args

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="process_* metrics are read from /proc")


def scrape(port: int, proc: subprocess.Popen, wait_s: float = 60) -> dict[str, float]:
    """sample name -> value (unlabelled samples; the last of a labelled family), once the port answers."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
                text = resp.read().decode()
            break
        except OSError:
            assert time.monotonic() < deadline and proc.poll() is None, f"no /metrics on port {port}"
            time.sleep(0.2)
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


def start_time(pid: int) -> float:
    """A process' start (epoch s) as the kernel has it: boot time + its start in clock ticks."""
    boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                if line.startswith("btime "))
    ticks = float(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[19])
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def check_own_process(metrics: dict[str, float], pid: int) -> None:
    assert metrics["process_resident_memory_bytes"] > 0 and metrics["process_virtual_memory_bytes"] > 0
    assert metrics["process_cpu_seconds_total"] > 0
    assert metrics["process_open_fds"] > 0 and metrics["process_max_fds"] >= metrics["process_open_fds"]
    assert metrics["process_start_time_seconds"] == pytest.approx(start_time(pid), abs=0.02)  # this pid's
    assert metrics["python_info"] == 1 and "python_gc_collections_total" in metrics


def test_worker_and_gateway_processes_serve_process_metrics(redis_url, namespace, tiny_model_dir, cache_dir, tmp_path):
    worker_port, gateway_port, metrics_port = free_port(), free_port(), free_port()
    worker = spawn_worker(redis_url, namespace, [*worker_args(tiny_model_dir, cache_dir), "--metrics-port",
                                                 str(worker_port)], log_path=str(tmp_path / "worker.log"))
    gateway = subprocess.Popen([sys.executable, "-m", "batchfleet.common.cli", "serve", "--port", str(gateway_port),
                                "--metrics-port", str(metrics_port), "--redis-url", redis_url, "--namespace",
                                namespace, "--files-dir", str(tmp_path / "files")], stderr=subprocess.DEVNULL)
    try:
        from_worker = scrape(worker_port, worker.proc)
        from_gateway = scrape(metrics_port, gateway)
        check_own_process(from_worker, worker.proc.pid)
        check_own_process(from_gateway, gateway.pid)
    finally:
        gateway.terminate()
        gateway.wait(10)
        worker.stop(30)
    # beside the batchfleet metrics each already served
    assert from_worker["batchfleet_workers_live"] == 1 and "batchfleet_requests_running" in from_worker
    assert from_gateway["batchfleet_gateway_requests_in_progress"] == 0 and "batchfleet_workers_live" in from_gateway


@pytest.mark.unit
def test_process_collectors_are_registered_once_per_registry():
    from prometheus_client import CollectorRegistry, generate_latest

    from batchfleet.common.metrics import with_process_metrics

    registry = CollectorRegistry(auto_describe=True)
    assert with_process_metrics(with_process_metrics(registry)) is registry  # twice: no duplicate error
    text = generate_latest(registry).decode()
    assert text.count("# TYPE process_resident_memory_bytes gauge") == 1 and "python_info{" in text
