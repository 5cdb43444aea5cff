"""The benchmark entry points run (tiny model, tiny load) so they cannot rot. Not timed tests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from batchfleet.common.cli import main
from batchfleet.worker.benchmark.loadgen import Run, Sample, make_workload, percentile, summarize
from batchfleet.worker.benchmark.report import markdown_table
from batchfleet.worker.benchmark.strategies import parse_strategies

ROOT = Path(__file__).resolve().parent.parent


def test_strategies_parse():
    s = {x.name: x for x in parse_strategies("static1,static8,dynamic10,dynamic50,dynamic200,fixed10,continuous")}
    assert s["static8"].static and s["static8"].max_batch_size == 8
    assert s["dynamic200"].max_wait_ms == 200 and s["dynamic200"].max_batch_size == 32
    assert (s["continuous"].mode, s["continuous"].window, s["continuous"].max_wait_ms) == ("continuous", "adaptive", 50)
    assert (s["fixed10"].mode, s["fixed10"].window, s["fixed10"].max_wait_ms) == ("continuous", "fixed", 10)
    assert s["static8"].worker_values() == {"max_wait_ms": float("inf"), "max_batch_size": 8, "mode": "dynamic",
                                            "window": "fixed"}


def test_workload_is_deterministic_and_in_range():
    a, b = make_workload(20, (32, 512), (16, 256), seed=3), make_workload(20, (32, 512), (16, 256), seed=3)
    assert a == b
    assert all(32 <= len(p) <= 512 for p in a.prompts) and all(16 <= n <= 256 for n in a.max_new_tokens)


def test_summary_and_table():
    run = Run([Sample(10, 5.0, 20.0, 2, 19.0), Sample(30, 15.0, 40.0, 4, 38.0)], wall_s=2.0, errors=0)
    row = summarize("dynamic50", run)
    assert row["throughput_tok_s"] == 20.0 and row["mean_batch_size"] == 3.0
    assert row["ttft_p50_ms"] == 10.0 and percentile([1, 2, 3, 4], 50) == 2.5
    table = markdown_table([{**row, "strategy": "static1"}, row])
    assert "| dynamic50 |" in table and "1.0x" in table


def test_bench_command_end_to_end(redis_url, cache_dir, tmp_path):
    out_json, out_png = tmp_path / "b.json", tmp_path / "b.png"
    res = CliRunner().invoke(main, [
        "bench", "--redis-url", redis_url, "--preset", "tiny", "--dtype", "float32", "--cache-dir", str(cache_dir),
        "--strategies", "static2,dynamic20", "--requests", "6", "--clients", "3", "--prompt-len", "8-60",
        "--max-new-tokens", "2-6", "--json", str(out_json), "--plot", str(out_png), "--overhead-strategy",
        "dynamic20"])
    assert res.exit_code == 0, res.output
    doc = json.loads(out_json.read_text())
    rows = {r["strategy"]: r for r in doc["rows"]}
    assert set(rows) == {"static2", "dynamic20"}
    for r in rows.values():
        assert {"throughput_tok_s", "ttft_p50_ms", "ttft_p99_ms", "mean_batch_size"} <= set(r)
        assert r["requests"] == 6 and r["errors"] == 0
    assert doc["overhead"]["throughput_ratio"] > 0
    assert out_png.read_bytes()[:4] == b"\x89PNG"


def test_gpu_bench_script_runs_on_cpu(tmp_path):
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, "scripts/bench_gpu.py", "--device", "cpu", "--shape", "tiny",
                           "--engine", "hf", "--requests", "4", "--clients", "2", "--new-tokens", "4",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["rows"][0]["throughput_tok_s"] > 0 and "roofline_share" in doc["rows"][0]


def test_gpu_bench_phases_run_on_cpu(tmp_path):
    """scripts/bench_gpu.sh's phases on this CPU (tiny shape, tiny counts) so they cannot rot before a GPU runs
    them: correctness (the graph path run eagerly, the eager path and the CPU reference agree), the profile of one
    decode step and the summary table of both."""
    def phase(*args: str) -> subprocess.CompletedProcess:
        proc = subprocess.run([sys.executable, "scripts/bench_gpu.py", "--device", "cpu", "--shape", "tiny", *args],
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc

    phase("--phase", "correctness", "--prompts", "3", "--check-tokens", "3", "--json", str(tmp_path / "c.json"))
    rows = json.loads((tmp_path / "c.json").read_text())["rows"]
    assert [r["dtype"] for r in rows] == ["bfloat16", "float32"]
    assert all(r["graph_vs_eager"] == {"identical": 3, "of": 3, "first_difference_at": []} for r in rows), rows
    assert rows[1]["graph_vs_cpu"]["of"] == 3
    phase("--phase", "profile", "--batch", "2", "--json", str(tmp_path / "p.json"))
    prof = json.loads((tmp_path / "p.json").read_text())
    assert prof["eager_ms_per_step"] > 0 and prof["ops"] and prof["graph_ms_per_step"] is None  # no graphs on CPU
    table = phase("--phase", "summary", "--out-dir", str(tmp_path)).stdout
    assert "graph = eager: 3/3" in table and "decode step, 2 seqs" in table
    assert (tmp_path / "summary.json").exists()


def test_gpu_bench_invariance_check_runs_on_cpu(tmp_path):
    """bench_gpu.py --invariance (the GPU session's batch-invariance check) on this CPU, on the path a GPU runs
    (--no-native-kernel; the tiny shape: head dim 32, MHA, gate/up 352 wide), bf16 and fp32: 0 of the flood's
    batch requests differ from themselves alone."""
    out = tmp_path / "inv.json"
    proc = subprocess.run([sys.executable, "scripts/bench_gpu.py", "--device", "cpu", "--shape", "tiny",
                           "--invariance", "--no-native-kernel", "--json", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["invariance"]
    assert [r["dtype"] for r in rows] == ["bfloat16", "float32"]
    assert all(r["targets"] == 9 and r["differ"] == 0 and r["preemptions"] > 0 and r["attention"] == "gather"
               for r in rows), rows


def test_kv_fetch_bench_runs_the_kernel_against_a_plain_read(tmp_path, cache_dir):
    """bench_kv_fetch.py on the tiny preset: the kernel over a real engine's pool and a read of as many bytes, timed
    in turn, both positive; the bytes are what the sequences attend (2 x tokens x Hkv x D x 2 bytes x layers)."""
    out = tmp_path / "kvf.json"
    proc = subprocess.run([sys.executable, "scripts/bench_kv_fetch.py", "--preset", "tiny", "--dtype", "bfloat16",
                           "--batch", "4", "--context", "40", "--rounds", "3", "--kv-cache-gb", "0.05",
                           "--cache-dir", str(cache_dir), "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 and "no C decode kernel" in proc.stderr:
        pytest.skip("no C compiler here: the kernel is not built")
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["batch"] == 4 and doc["rounds"] == 3 and doc["kernel_ms"] > 0 and doc["read_ms"] > 0
    # each of the 4 sequences attends at least its 40 prompt tokens, in every one of the 2 layers
    assert doc["bytes"] >= 2 * 4 * 40 * 4 * 32 * 2 * 2
    assert doc["kernel_vs_read_median"] > 0 and "kernel / read" in proc.stdout


def test_request_cost_bench_measures_a_real_worker(tmp_path, cache_dir):
    out = tmp_path / "cost.jsonl"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_request_cost.py"), "--requests", "40",
                    "--threads", "8", "--label", "test", "--cache-dir", str(cache_dir), "--json", str(out)],
                   check=True, timeout=300)
    row = json.loads(out.read_text())
    assert row["label"] == "test" and row["requests"] == 40
    # <= 12: issue 29's <= 10, plus the tenants' usage counts (worker/transport/settle.py ``_count_usage``): one
    # HINCRBY per tenant and count in the total and today's hash, and one EXPIREAT, per batch of replies, not per reply
    assert 3 <= row["calls_per_req"] <= 12 and row["usec_per_req"] > 0 and "xadd" in row["by_command"]
