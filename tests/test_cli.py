"""The people-facing entry points: submit, bulk, demo, compose file."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings
from collections import Counter
from pathlib import Path

import click
import pytest
import yaml
from click.testing import CliRunner

from batchfleet.common.cli import main
from batchfleet.common.config import DynamicBatchingConfig, WorkerConfig
from batchfleet.common.engine_config import EngineConfig
from batchfleet.common.options import build_worker_config, option_args

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
    assert res.exit_code == 3, res.output  # every line answered, three of them with an error line
    out = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [o["index"] for o in out] == list(range(15))
    errors = [o["index"] for o in out if "error" in o]
    assert errors == [3, 7, 9]
    assert out[7]["error"]["code"] == "prompt_too_long"
    assert out[3]["error"]["code"] == out[9]["error"]["code"] == "invalid_request"
    good = [o for o in out if "result" in o]
    assert [o["result"]["completion_tokens"] for o in good] == [2 + i % 3 for i in range(12)]


def test_demo_runs_end_to_end(redis_url):
    proc = subprocess.run([sys.executable, "-m", "batchfleet.common.cli", "demo", "--requests", "8", "--clients", "4",
                           "--max-new-tokens", "4", "--redis-url", redis_url],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "throughput" in proc.stdout and "TTFT p50 / p99" in proc.stdout
    assert "8 from 4 client threads" in proc.stdout
    assert "Warning" not in proc.stderr, proc.stderr[-2000:]
    # what it does before the table, each step with the seconds since it started: the worker's start-up phases
    # (relayed from its log while the demo waits for it), then its own steps
    steps = [re.match(r"^\[\s*(\d+\.\d) s\] (.*)$", line) for line in proc.stdout.split("\n| metric")[0].splitlines()
             if line.strip()]
    assert all(steps), proc.stdout
    seconds, texts = [float(m[1]) for m in steps], [m[2] for m in steps]
    assert seconds == sorted(seconds), proc.stdout
    expected = ["starting worker", "worker: loading torch and transformers", "worker: loading the model",
                "worker: building the native engine", "worker: choosing the weight matmul kernels",
                "worker: joining the fleet", "worker ready", "warm-up request", "sending 8 prompts", "done"]
    at = [next((i for i, text in enumerate(texts) if text.startswith(step)), None) for step in expected]
    assert None not in at and at == sorted(at), proc.stdout


@pytest.mark.unit
def test_demo_relays_start_up_phases_and_warnings_of_either_log_format():
    from batchfleet.worker.demo import phase_message

    assert phase_message("2026-12-06 22:08:23,547 INFO batchfleet.startup: loading the model") == "loading the model"
    assert phase_message(json.dumps({"time": "t", "level": "INFO", "logger": "batchfleet.startup",
                                     "message": "joining the fleet", "worker": "w"})) == "joining the fleet"
    assert phase_message("2026-12-06 22:08:23,547 WARNING batchfleet.worker.engine.native.cpu_kernel: no C compiler "
                         "found: paged_decode.c unavailable") == "no C compiler found: paged_decode.c unavailable"
    for other in ("2026-12-06 22:08:23,547 INFO batchfleet.worker.compose: worker w serving buckets (128,)",
                  "Loading weights: 100%|##########| 21/21\r", "batchfleet worker w ready", "{not json", ""):
        assert phase_message(other) is None, other


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


# --- options derived from the config dataclasses --------------------------------------------------------

WORKER_FLAGS = {  # docs/CONFIGURATION.md's table: every flag keeps its name and env var
    "--redis-url": "BATCHFLEET_REDIS_URL", "--namespace": "BATCHFLEET_NAMESPACE", "--model": "BATCHFLEET_MODEL",
    "--preset": "BATCHFLEET_PRESET", "--device": "BATCHFLEET_DEVICE", "--dtype": "BATCHFLEET_DTYPE",
    "--engine": "BATCHFLEET_ENGINE", "--mode": "BATCHFLEET_MODE", "--max-wait-ms": "BATCHFLEET_MAX_WAIT_MS",
    "--max-batch-size": "BATCHFLEET_MAX_BATCH_SIZE", "--max-seq-len": "BATCHFLEET_MAX_SEQ_LEN",
    "--buckets": "BATCHFLEET_BUCKETS", "--padding": "BATCHFLEET_PADDING", "--block-size": "BATCHFLEET_BLOCK_SIZE",
    "--kv-cache-gb": "BATCHFLEET_KV_CACHE_GB", "--reply-ttl": "BATCHFLEET_REPLY_TTL",
    "--claim-idle-ms": "BATCHFLEET_CLAIM_IDLE_MS", "--max-deliveries": "BATCHFLEET_MAX_DELIVERIES",
    "--stall-timeout-s": "BATCHFLEET_STALL_TIMEOUT_S", "--max-queue-len": "BATCHFLEET_MAX_QUEUE_LEN",
    "--threads": "BATCHFLEET_THREADS", "--cache-dir": "BATCHFLEET_CACHE_DIR",
    "--native-kernel": "BATCHFLEET_NATIVE_KERNEL", "--worker-name": "BATCHFLEET_WORKER_NAME",
}


@pytest.fixture
def clean_env(monkeypatch):
    """No BATCHFLEET_* variable of the test runner's shell leaks into option defaults."""
    for name in list(os.environ):
        if name.startswith("BATCHFLEET_"):
            monkeypatch.delenv(name)


def _command(name: str) -> click.Command:
    return main.get_command(click.Context(main), name)


def _flags(name: str) -> list[str]:
    command = _command(name)
    return [opt for p in command.get_params(click.Context(command)) for opt in (*p.opts, *p.secondary_opts)]


@pytest.mark.parametrize("name", ["worker", "demo", "bench"])
def test_help_lists_each_option_once_without_warnings(name):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # click warns about a parameter used more than once
        res = CliRunner().invoke(main, [name, "--help"])
    assert res.exit_code == 0, res.output
    twice = [flag for flag, n in Counter(_flags(name)).items() if n > 1]
    assert not twice, f"{name}: {twice}"
    for flag in _flags(name):
        assert flag in res.output


def test_each_command_takes_the_options_that_take_effect():
    worker, demo, bench = (set(_flags(name)) for name in ("worker", "demo", "bench"))
    assert set(WORKER_FLAGS) <= worker and "--no-native-kernel" in worker
    assert "--clients" in demo and "--threads" in demo  # client threads vs the demo worker's CPU threads
    assert "--clients" in bench and "--strategies" in bench and "--max-batch-size" in bench
    assert not {"--max-wait-ms", "--mode"} & bench  # the strategies set them
    # an option with older names (aliases) reads their variables too, after its own
    envvars = {opt: p.envvar if isinstance(p.envvar, str) else p.envvar[0]
               for p in _command("worker").params for opt in p.opts}
    assert {flag: envvars[flag] for flag in WORKER_FLAGS} == WORKER_FLAGS


def test_option_defaults_are_the_dataclass_defaults(clean_env):
    params = _command("worker").make_context("worker", []).params
    assert build_worker_config(**params) == WorkerConfig()
    assert params["max_wait_ms"] == DynamicBatchingConfig.max_wait_ms == 50.0
    assert params["buckets"] == DynamicBatchingConfig.buckets
    assert params["reply_ttl_s"] == WorkerConfig.reply_ttl_s == 3600
    assert params["dtype"] is None and params["threads"] is None
    assert params["cache_dir"] == EngineConfig.cache_dir and params["native_kernel"] is True
    bench = _command("bench").make_context("bench", []).params
    assert bench["preset"] == "bench"  # the one default bench changes
    assert {k: v for k, v in bench.items() if k in params and k != "preset"} == \
        {k: params[k] for k in bench if k in params and k != "preset"}


def test_flags_and_env_vars_reach_the_config(clean_env, monkeypatch):
    monkeypatch.setenv("BATCHFLEET_WORKER_NAME", "w7")
    monkeypatch.setenv("BATCHFLEET_REPLY_TTL", "60")
    monkeypatch.setenv("BATCHFLEET_NATIVE_KERNEL", "0")
    monkeypatch.setenv("BATCHFLEET_BUCKETS", "16,32")
    worker = _command("worker")
    params = worker.make_context("worker", ["--max-wait-ms", "inf", "--max-seq-len", "64", "--cache-dir", "/tmp/c",
                                            "--threads", "2", "--dtype", "bfloat16"]).params
    cfg = build_worker_config(**params)
    assert (cfg.name, cfg.reply_ttl_s, cfg.engine.native_kernel) == ("w7", 60, False)
    assert cfg.batching.buckets == (16, 32) and cfg.batching.max_wait_ms == float("inf")
    assert (cfg.engine.cache_dir, cfg.engine.threads, cfg.engine.dtype) == ("/tmp/c", 2, "bfloat16")
    # what the demo and bench hand to their worker subprocesses parses back to the same values
    monkeypatch.delenv("BATCHFLEET_NATIVE_KERNEL")
    assert worker.make_context("worker", option_args(params)).params == params
    with pytest.raises(click.BadParameter):
        worker.make_context("worker", ["--buckets", "1,x"])


def test_preset_names_are_one_tuple():
    from batchfleet.common.engine_config import PRESETS
    from batchfleet.worker.engine.models import PRESETS as MODEL_SHAPES

    assert set(MODEL_SHAPES) == set(PRESETS)
    assert _command("worker").make_context("worker", []).params["preset"] in PRESETS
    assert [p.type.choices for p in _command("worker").params if p.name == "preset"] == [PRESETS]
