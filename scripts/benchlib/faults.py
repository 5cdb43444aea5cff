"""Redis fault injection for the crash tests and benchmarks: slow fsync (strace), kills timed inside it,
and the AOF read back as the record of every write Redis made durable.

- ``SlowFsync``: strace attached to a redis-server delays the exit of every ``fdatasync``/``fsync``. With
  ``appendfsync always`` Redis writes the AOF, fsyncs, and only then sends its replies, so the delay opens
  a wide window in which a write is durable but nobody has heard of it yet.
- ``wait_in_fsync``: block until the server's main thread sits in such a delayed fsync, so a kill lands
  in that window rather than anywhere; ``wait_for_durable``: until it sits in the fsync of a write that
  holds a given command (read from the AOF's tail, which Redis wrote just before that fsync).
- ``aof_commands``: every command of a Redis 7 multi-part AOF (``appendonlydir``), in order;
  ``audit_aof``: from it, the job ids enqueued and the final replies (result/error) written per job id.

Needs Linux (/proc) and strace; imports nothing from the producer or the worker.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import msgpack


def strace_binary() -> str:
    """Path of strace; RuntimeError when there is none."""
    found = shutil.which("strace")
    if not found:
        raise RuntimeError("strace is not installed (apt-get install strace)")
    return found


def _thread_state(pid: int) -> str | None:
    """One-letter state of a thread (``t`` = stopped by its tracer), None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2]  # the command name may hold spaces or parentheses


def _tracer(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("TracerPid:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


class SlowFsync:
    """strace on every thread of ``pid``, delaying the return of each fsync/fdatasync by ``delay_ms``.

    It ends by itself when the traced process dies (kill -9); ``stop()`` detaches it from a live one.
    """

    def __init__(self, pid: int, delay_ms: int, attach_timeout_s: float = 10.0) -> None:
        self.pid = pid
        self.delay_ms = delay_ms
        # strace 6 reads a bare number as microseconds; the unit suffix says what is meant
        self.proc = subprocess.Popen(
            [strace_binary(), "-f", "-qq", "-p", str(pid), "-e", "trace=fdatasync,fsync",
             "-e", f"inject=fdatasync,fsync:delay_exit={int(delay_ms)}ms", "-o", "/dev/null"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + attach_timeout_s
        while _tracer(pid) != self.proc.pid:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"strace could not attach to {pid}: {err.strip()}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"strace did not attach to {pid} within {attach_timeout_s} s")
            time.sleep(0.01)

    def stop(self) -> None:
        """Detach (SIGTERM makes strace let go of the tracee) and reap strace."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.proc.stderr:
            self.proc.stderr.close()


def wait_in_fsync(pid: int, min_stop_ms: float, timeout_s: float) -> bool:
    """Return True once the main thread of ``pid`` has been stopped by its tracer for ``min_stop_ms`` in a
    row (ordinary syscall stops last microseconds: only an injected delay lasts that long); False when
    ``timeout_s`` passes first or the process is gone."""
    deadline = time.monotonic() + timeout_s
    since: float | None = None
    while time.monotonic() < deadline:
        state = _thread_state(pid)
        if state is None:
            return False
        now = time.monotonic()
        if state == "t":
            since = since if since is not None else now
            if (now - since) * 1000 >= min_stop_ms:
                return True
        else:
            since = None
        time.sleep(0.002)
    return False


def wait_for_durable(pid: int, redis_dir: str | Path, wanted: Callable[[list[bytes]], bool], min_stop_ms: float,
                     timeout_s: float) -> bool:
    """Return True once Redis (``pid``) sits in a delayed fsync of an AOF write holding a command for which
    ``wanted(args)`` is true: durable, and not yet answered to anyone. False after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    path = current_aof(redis_dir)
    seen = path.stat().st_size
    while time.monotonic() < deadline:
        if not wait_in_fsync(pid, min_stop_ms, deadline - time.monotonic()):
            return False
        with path.open("rb") as f:
            f.seek(seen)
            tail = f.read()
        seen += len(tail)
        if any(wanted(args) for args in _resp_commands(tail)) and _thread_state(pid) == "t":
            return True
        while _thread_state(pid) == "t" and time.monotonic() < deadline:  # let this fsync end
            time.sleep(0.002)
    return False


def _resp_commands(data: bytes) -> Iterator[list[bytes]]:
    """Commands of an AOF file (RESP arrays of bulk strings); a torn command at the end is skipped, as
    Redis does with ``aof-load-truncated yes``."""
    pos, end = 0, len(data)
    while pos < end:
        if data[pos:pos + 1] != b"*":
            return
        eol = data.find(b"\r\n", pos)
        if eol < 0:
            return
        count, pos = int(data[pos + 1:eol]), eol + 2
        args = []
        for _ in range(count):
            eol = data.find(b"\r\n", pos)
            if eol < 0 or data[pos:pos + 1] != b"$":
                return
            size = int(data[pos + 1:eol])
            start = eol + 2
            if start + size + 2 > end:
                return
            args.append(data[start:start + size])
            pos = start + size + 2
        yield args


def _incr_files(redis_dir: str | Path) -> list[Path]:
    """The incremental AOF files of a Redis 7 ``appendonlydir``, in manifest order."""
    folder = Path(redis_dir) / "appendonlydir"
    manifests = list(folder.glob("*.manifest"))
    if not manifests:
        raise FileNotFoundError(f"no AOF manifest in {folder}")
    out = []
    for line in manifests[0].read_text().splitlines():
        parts = line.split()
        info = dict(zip(parts[::2], parts[1::2]))
        if info.get("type") == "i":
            out.append(folder / info["file"])
    return out


def current_aof(redis_dir: str | Path) -> Path:
    """The AOF file Redis appends to now."""
    return _incr_files(redis_dir)[-1]


def aof_commands(redis_dir: str | Path) -> Iterator[list[bytes]]:
    """Every command in the incremental AOF files of a Redis 7 ``appendonlydir``, in order.

    Start the server with ``--auto-aof-rewrite-percentage 0`` so no rewrite folds history into a base
    file (a base file is not read here)."""
    for path in _incr_files(redis_dir):
        yield from _resp_commands(path.read_bytes())


def xadd_fields(args: list[bytes]) -> dict[bytes, bytes]:
    """The field/value pairs of an ``XADD key [NOMKSTREAM] [MAXLEN|MINID [=|~] n [LIMIT c]] id f v ...``."""
    i = 2
    while i < len(args):
        word = args[i].upper()
        if word == b"NOMKSTREAM":
            i += 1
        elif word in (b"MAXLEN", b"MINID"):
            i += 3 if args[i + 1] in (b"=", b"~") else 2
        elif word == b"LIMIT":
            i += 2
        else:
            break
    rest = args[i + 1:]
    return dict(zip(rest[::2], rest[1::2]))


FINAL_KINDS = ("result", "error")


def final_replies(args: list[bytes], namespace: str) -> list[str]:
    """Job ids of the final replies (result/error) a command writes in ``namespace``: a SET of an answer under
    an inbox (protocol v5; only a first write is propagated: a refused SET NX is not), an XADD to an inbox
    stream (protocol v2-v4) or an RPUSH/LPUSH to a reply list (protocol v1)."""
    name = args[0].upper()
    if len(args) < 3 or not args[1].startswith(f"{namespace}:".encode()):
        return []
    if name == b"SET":
        payloads = [args[2]] if b":done:" in args[1] else []
    elif name == b"XADD":
        payloads = [p] if (p := xadd_fields(args).get(b"p")) is not None else []
    elif name in (b"RPUSH", b"LPUSH"):
        payloads = args[2:]
    else:
        return []
    out = []
    for raw in payloads:
        try:
            obj = msgpack.unpackb(raw, raw=False)
        except Exception:  # noqa: BLE001 (a request or foreign payload: not a reply)
            continue
        if isinstance(obj, dict) and obj.get("kind") in FINAL_KINDS and isinstance(obj.get("id"), str):
            out.append(obj["id"])
    return out


def audit_aof(redis_dir: Path, namespace: str) -> tuple[set[str], Counter]:
    """(job ids enqueued, final replies written per job id) in the AOF of ``namespace``."""
    enqueued: set[str] = set()
    replies: Counter = Counter()
    stream_prefix = f"{namespace}:stream:".encode()
    for args in aof_commands(redis_dir):
        if args[0].upper() == b"XADD" and len(args) > 2 and args[1].startswith(stream_prefix):
            if (job := xadd_fields(args).get(b"id")) is not None:
                enqueued.add(job.decode())
        replies.update(final_replies(args, namespace))
    return enqueued, replies
