"""The people-facing entry points: submit, bulk, demo, compose file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml
from click.testing import CliRunner

from batchfleet.common.cli import main

ROOT = Path(__file__).resolve().parent.parent


def test_submit_prints_completion(start_worker, redis_url, namespace):
    start_worker(max_wait_ms=10)
    res = CliRunner().invoke(main, ["submit", "hello fleet", "--max-new-tokens", "5", "--json",
                                    "--redis-url", redis_url, "--namespace", namespace])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["completion_tokens"] == 5 and out["finish_reason"] == "length"


def test_env_vars_configure_connection(start_worker, redis_url, namespace):
    start_worker(max_wait_ms=10)
    res = CliRunner().invoke(main, ["submit", "env", "--max-new-tokens", "2"],
                             env={"BATCHFLEET_REDIS_URL": redis_url, "BATCHFLEET_NAMESPACE": namespace})
    assert res.exit_code == 0, res.output


def test_bulk_keeps_order_and_reports_errors(start_worker, redis_url, namespace, tmp_path):
    start_worker(max_wait_ms=20)
    lines = [json.dumps({"prompt": f"prompt number {i}", "max_new_tokens": 2 + i % 3}) for i in range(12)]
    lines.insert(3, "{not json")
    lines.insert(7, json.dumps({"prompt": "x" * 1000}))  # too long: an error line, run continues
    lines.insert(9, json.dumps({"prompt": "bad param", "temperature": -3}))
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    dst = tmp_path / "out.jsonl"
    res = CliRunner().invoke(main, ["bulk", str(src), "-o", str(dst), "--window", "4",
                                    "--redis-url", redis_url, "--namespace", namespace])
    assert res.exit_code == 0, res.output
    out = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [o["index"] for o in out] == list(range(15))
    errors = [o["index"] for o in out if "error" in o]
    assert errors == [3, 7, 9]
    assert out[7]["error"]["code"] == "PromptTooLong"
    good = [o for o in out if "result" in o]
    assert [o["result"]["completion_tokens"] for o in good] == [2 + i % 3 for i in range(12)]


def test_demo_runs_end_to_end(redis_url):
    proc = subprocess.run([sys.executable, "-m", "batchfleet.common.cli", "demo", "--requests", "8", "--threads", "4",
                           "--max-new-tokens", "4", "--redis-url", redis_url],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "throughput" in proc.stdout and "TTFT p50 / p99" in proc.stdout


def test_compose_file_structure():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"redis", "worker", "producer"} <= set(services)
    redis_svc = services["redis"]
    assert "--appendonly" in redis_svc["command"] and "yes" in redis_svc["command"]
    assert "healthcheck" in redis_svc
    for name, svc in services.items():
        assert "container_name" not in svc, f"{name}: fixed container names break --scale"
    worker = services["worker"]
    assert "ports" not in worker  # a published port would also break --scale
    assert worker["environment"]["BATCHFLEET_REDIS_URL"].startswith("redis://redis:")
    assert worker["depends_on"]["redis"]["condition"] == "service_healthy"
    assert (ROOT / "Dockerfile").exists()
