"""Every usage example of README.md, docs/USAGE.md and docs/GATEWAY.md runs as written against a real worker on
the default (tiny) built-in model.

- Each ```python block of those documents runs unmodified; its ``Client()`` / ``AsyncClient()`` reads
  BATCHFLEET_REDIS_URL / BATCHFLEET_NAMESPACE, which the test sets to the test Redis and namespace. Two
  substitutions: the gateway's URL (a free port here) and the RQ example's queue name (one of the test's own,
  whose RQ keys are removed afterwards: tests/helpers/rq.py).
- From every "Command line:" block, ``batchfleet submit``, ``bulk`` (on a prompts.jsonl made in a temporary
  working directory) and ``status`` run as subprocesses. Not run here: ``worker`` (the in-thread worker
  stands in for it; tests/test_cli.py and the fleet tests cover workers), ``bench`` (tests/test_bench.py;
  far too slow for this), ``dashboard`` (a server until Ctrl-C: tests/test_dashboard.py serves it and
  loads it in Chromium) and ``docker compose`` (no Docker on the test machines). Every other line of those
  blocks must be one of these, so a new example cannot be silently skipped.
- docs/GATEWAY.md's Batch API polling loop, as written, also rides out a real restart of the gateway (the doc's
  own ``batchfleet serve`` line, a subprocess, stopped while the batch waits and started again).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ("README.md", "docs/USAGE.md", "docs/GATEWAY.md")  # the documents whose examples run here
TEXT = {doc: (ROOT / doc).read_text() for doc in DOCS}
RUN = {"submit", "bulk", "status"}
NOT_RUN = {"worker", "bench", "dashboard"}  # see the module docstring (dashboard: a server, tests/test_dashboard.py)


def python_blocks() -> list[tuple[str, str]]:
    """(document, code) of every ```python block, in document order."""
    return [(doc, code) for doc in DOCS for code in re.findall(r"^```python\n(.*?)^```", TEXT[doc], flags=re.S | re.M)]


def command_lines(doc: str) -> list[str]:
    """The ``batchfleet ...`` lines of every bash block of ``doc`` that follows "Command line:"."""
    blocks = re.findall(r"^Command line:\s*\n```bash\n(.*?)^```", TEXT[doc], flags=re.S | re.M)
    return [line for block in blocks for line in block.splitlines() if line.strip()]


@pytest.fixture
def readme_env(monkeypatch, redis_url: str, namespace: str) -> dict[str, str]:
    monkeypatch.setenv("BATCHFLEET_REDIS_URL", redis_url)
    monkeypatch.setenv("BATCHFLEET_NAMESPACE", namespace)
    return dict(os.environ)


def test_readme_has_examples():
    """README keeps an example for each user: a web backend's Client and AsyncClient, bulk, an operator."""
    readme = [code for doc, code in python_blocks() if doc == "README.md"]
    assert any("= Client()" in code for code in readme) and any("AsyncClient()" in code for code in readme)
    commands = {shlex.split(line, comments=True)[1] for line in command_lines("README.md")}
    assert {"worker", "submit", "bulk", "status", "dashboard"} <= commands, commands
    assert len(python_blocks()) >= 6 and len(command_lines("docs/USAGE.md")) >= 4


GATEWAY_URL = 'base_url="http://127.0.0.1:8000/v1"'  # blocks that talk to docs/GATEWAY.md's gateway
RQ_QUEUE = 'Queue("llm"'  # docs/USAGE.md's RQ example's queue


@pytest.mark.parametrize("index", range(len(python_blocks())),
                         ids=[f"{doc}-{i}" for i, (doc, _) in enumerate(python_blocks())])
def test_python_example_runs(index: int, start_worker, readme_env, redis_url, namespace, tmp_path, monkeypatch):
    start_worker(max_wait_ms=10)
    doc, code = python_blocks()[index]
    gateway = None
    if GATEWAY_URL in code:  # docs/GATEWAY.md's gateway (port 8000 there; a free one here), its key, its batch file
        from tests.helpers.gateway import GatewayThread

        key = re.search(r'--api-key (\S+)', TEXT["docs/GATEWAY.md"]).group(1)
        gateway = GatewayThread(redis_url, namespace, api_keys=(key,), files_dir=str(tmp_path / "f"))
        code = code.replace(GATEWAY_URL, f'base_url="{gateway.url}/v1"')
        monkeypatch.chdir(tmp_path)
        (tmp_path / "batch.jsonl").write_text("".join(json.dumps(
            {"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"messages": [{"role": "user", "content": f"Hi {i}"}], "max_tokens": 4}}) + "\n"
            for i in range(3)))
    rq_queue = None
    if "from rq import" in code:  # RQ's keys lie outside the test namespace: a queue of the test's own
        rq_queue = f"llm-{namespace}"
        assert RQ_QUEUE in code, f"{doc}: the RQ example no longer makes {RQ_QUEUE}"
        code = code.replace(RQ_QUEUE, f'Queue("{rq_queue}"')
    try:
        scope: dict = {"__name__": "readme_example"}
        exec(compile(code, f"{doc} python block {index}", "exec"), scope)
    finally:
        if gateway is not None:
            gateway.stop()
        if rq_queue is not None:
            from tests.helpers.rq import remove_rq_keys

            remove_rq_keys(redis_url, rq_queue)
    if gateway is not None and "client.batches" in code:
        assert scope["batch"].status == "completed" and len(scope["answers"].splitlines()) == 3


def test_command_line_examples_run(start_worker, readme_env, tmp_path: Path):
    start_worker(max_wait_ms=10)
    (tmp_path / "prompts.jsonl").write_text(
        "\n".join(json.dumps({"prompt": p, "max_new_tokens": 8}) for p in ("Hello", "Bonjour", "Hallo")) + "\n"
        + json.dumps({"prompt": "with defaults"}) + "\n")
    ran = set()
    for line in [line for doc in DOCS for line in command_lines(doc)]:
        argv = shlex.split(line, comments=True)
        assert argv[0] == "batchfleet", line
        if argv[1] in NOT_RUN:
            continue
        assert argv[1] in RUN, f"documented command not covered by this test: {line}"
        proc = subprocess.run([sys.executable, "-m", "batchfleet.common.cli", *argv[1:]], cwd=tmp_path,
                              env=readme_env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"{line}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        ran.add(argv[1])
        if argv[1] == "submit":
            assert "finish=" in proc.stderr, proc.stderr[-2000:]
        elif argv[1] == "bulk":
            out = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
            assert [o["index"] for o in out] == [0, 1, 2, 3] and all("result" in o for o in out), out
        elif argv[1] == "status":
            assert "buckets" in proc.stdout and "worker " in proc.stdout, proc.stdout
    assert ran == RUN


def batch_example() -> str:
    """docs/GATEWAY.md's Batch API example (the one python block that polls a batch)."""
    (code,) = [code for doc, code in python_blocks() if doc == "docs/GATEWAY.md" and "client.batches" in code]
    return code


def serve_as_documented(port: int, env: dict[str, str], cwd: Path) -> subprocess.Popen:
    """docs/GATEWAY.md's ``batchfleet serve`` line on ``port`` (files in ``cwd``), once /health answers."""
    import httpx

    (line,) = re.findall(r"^batchfleet serve .*$", TEXT["docs/GATEWAY.md"], flags=re.M)
    argv = shlex.split(line, comments=True)
    argv[argv.index("--port") + 1] = str(port)
    proc = subprocess.Popen([sys.executable, "-m", "batchfleet.common.cli", *argv[1:]], env=env, cwd=cwd,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, f"batchfleet serve exited with {proc.returncode}"
        try:
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
            return proc
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "batchfleet serve did not come up"
        time.sleep(0.1)


def wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_batch_polling_example_rides_out_a_gateway_restart(start_worker, readme_env, tmp_path: Path, monkeypatch):
    """The example's loop, as written, polls through a restart of the gateway: its retrieve fails with a connection
    error while no gateway listens, and the loop polls again until the batch, resumed by the new gateway, completes.
    No worker runs until the restart (the fleet scales to zero), so the batch cannot end before it."""
    from batchfleet.worker.devtools import free_port

    start_worker(scale_to_zero=True).stop()  # the fleet is described, no worker serves it: the batch waits
    port = free_port()
    code = batch_example().replace(GATEWAY_URL, f'base_url="http://127.0.0.1:{port}/v1"')
    (tmp_path / "batch.jsonl").write_text("".join(json.dumps(
        {"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": f"Hi {i}"}], "max_tokens": 4}}) + "\n" for i in range(3)))
    monkeypatch.chdir(tmp_path)  # the example opens batch.jsonl from the working directory
    printed: list[str] = []  # what the example prints: only its except branch does
    scope: dict = {"__name__": "gateway_doc_example", "print": lambda *a, **_: printed.append(" ".join(map(str, a)))}
    failed: list[BaseException] = []

    def run() -> None:
        try:
            exec(compile(code, "docs/GATEWAY.md Batch API example", "exec"), scope)
        except BaseException as exc:
            failed.append(exc)

    gateway = serve_as_documented(port, readme_env, tmp_path)
    example = threading.Thread(target=run, daemon=True)
    try:
        example.start()
        wait_for(lambda: "batch" in scope or failed, 120, "the example created no batch")
        assert not failed, failed
        gateway.terminate()  # a restart: SIGTERM, then a new process on the same port
        gateway.wait(60)
        wait_for(lambda: printed or failed, 120, "the example never polled the stopped gateway")
        assert not failed, failed
        assert "Connection error" in printed[0], printed
        gateway = serve_as_documented(port, readme_env, tmp_path)
        start_worker(scale_to_zero=True, max_wait_ms=10)
        example.join(300)
        assert not example.is_alive(), "the example still polls"
        assert not failed, failed
    finally:
        gateway.terminate()
        gateway.wait(60)
    batch = scope["batch"]
    assert batch.status == "completed" and batch.request_counts.completed == 3, batch
    answers = [json.loads(line) for line in scope["answers"].splitlines()]
    assert sorted(a["custom_id"] for a in answers) == ["q0", "q1", "q2"]
