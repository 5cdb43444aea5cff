"""Start worker processes from Python (demo, bench, tests) and wait until they serve."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import redis

from batchfleet.common.keys import Keys


@dataclass
class WorkerProcess:
    name: str
    proc: subprocess.Popen
    keys: Keys

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM (graceful: finish the running batch), then SIGKILL after timeout_s."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def spawn_worker(redis_url: str, namespace: str, args: Sequence[str] = (), name: str | None = None,
                 log_path: str | None = None, wait_s: float = 180.0) -> WorkerProcess:
    """Run ``python -m batchfleet.worker`` with the given extra CLI args and wait for its first heartbeat."""
    name = name or f"w-{uuid.uuid4().hex[:8]}"
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115 (owned by the child)
    cmd = [sys.executable, "-m", "worker", "--redis-url", redis_url, "--namespace", namespace, "--name", name,
           *args]
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if log_path else subprocess.DEVNULL)
    wp = WorkerProcess(name, proc, Keys(namespace))
    wait_for_heartbeat(redis_url, wp, wait_s)
    return wp


def wait_for_heartbeat(redis_url: str, wp: WorkerProcess, wait_s: float) -> None:
    client = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + wait_s
    try:
        while not client.exists(wp.keys.worker(wp.name)):
            if wp.proc.poll() is not None:
                raise RuntimeError(f"worker {wp.name} exited with {wp.proc.returncode} before serving")
            if time.monotonic() > deadline:
                wp.kill()
                raise TimeoutError(f"worker {wp.name} did not start within {wait_s} s")
            time.sleep(0.1)
    finally:
        client.close()


def delete_namespace(redis_url: str, keys: Keys) -> int:
    """Remove every key of a namespace (demo and test cleanup)."""
    client = redis.Redis.from_url(redis_url)
    try:
        names = list(client.scan_iter(match=keys.pattern, count=500))
        for i in range(0, len(names), 500):
            client.delete(*names[i:i + 500])
        return len(names)
    finally:
        client.close()
