"""Running vLLM's CPU backend, the peer of the benchmarks, in its own venv: one offline run of a workload
(scripts/vllm_offline.py runs there; vLLM is never a project dependency)."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

import click

OFFLINE = Path(__file__).resolve().parents[1] / "vllm_offline.py"


def run_offline(python: str, spec: dict, kv_gb: float = 4) -> dict:
    """Run ``spec`` (scripts/vllm_offline.py's JSON workload) with the vLLM venv's ``python``; its result
    line as a dict. ``kv_gb``: its KV cache unless VLLM_CPU_KVCACHE_SPACE says otherwise."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", str(int(kv_gb)))}
    try:
        proc = subprocess.run([python, str(OFFLINE), f.name], capture_output=True, text=True, env=env,
                              cwd=tempfile.gettempdir(), timeout=1800)
    finally:
        os.unlink(f.name)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise click.ClickException(f"vLLM run failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(lines[-1])
