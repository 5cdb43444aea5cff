"""One bulk run per output file at a time: an OS lock on ``<output>.lock``, held for the run's life.

Two runs on one output (a cron job started twice, a restart while a stopped run still writes) would both
append every line, interleave records into invalid JSON, and take each other's replies from the run's one
inbox (so one waits for ever). The second run is refused instead (``OutputBusy``), before it reads or writes
anything.

Why ``flock`` on a lock file kept beside the output: the kernel releases it when the process ends however it
ends (kill -9, a crash, a lost container), so a stale lock never blocks a rerun, and there is no pid to check
(a pid file outlives a kill -9, and its pid may be reused). It is taken per open file description, so two runs
in one process (RQ's SimpleWorker, tests) exclude each other too, which POSIX ``fcntl`` locks would not. The
file is never deleted: a run that unlinked it at exit would let the next run lock a new file while a third
still waits on the old one. Its content (the holder's host and pid) only feeds the refusal's message. The
lock is beside the output's resolved path, so two spellings of one output (a symlink, ``./``) share it. On a
file system without locks (ENOLCK, EOPNOTSUPP: some network mounts) the run is refused, never run unlocked.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import time

from batchfleet.common.errors import BatchfleetError

LOCK_SUFFIX = ".lock"
HOLDER_WAIT_S = 1.0  # how long a refused run waits for the holder to have written who it is


class OutputBusy(BatchfleetError):
    """Another bulk run writes this output now (or its lock cannot be taken)."""


def lock_path(output_path: str) -> str:
    return os.path.realpath(output_path) + LOCK_SUFFIX


class OutputLock:
    """Held from ``acquire`` (OutputBusy when another run holds it) to ``release`` or the process' end."""

    def __init__(self, output_path: str) -> None:
        self.output_path = output_path
        self.path = lock_path(output_path)
        self.fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _holder(fd)
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise OutputBusy(f"another bulk run writes {self.output_path} now{holder}: wait for it to end "
                                 "(or stop it), then run again to resume; one run per output at a time") from None
            raise OutputBusy(f"cannot lock {self.path} ({os.strerror(exc.errno or 0)}): a bulk run writes its "
                             "output only under that lock; put the output on a local file system") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{socket.gethostname()} {os.getpid()}\n".encode(), 0)
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the last descriptor of the lock releases it
            self.fd = None

    def __enter__(self) -> OutputLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _holder(fd: int) -> str:
    """The holder's ``_read``, waiting up to HOLDER_WAIT_S for it: a run that just took the lock writes it right
    after (two runs started together: the refused one would otherwise name no holder)."""
    end = time.monotonic() + HOLDER_WAIT_S
    while not (holder := _read(fd)) and time.monotonic() < end:
        time.sleep(0.02)
    return holder


def _read(fd: int) -> str:
    """`` (host h, pid p)`` of the run that holds the lock, as it wrote it; empty if unreadable."""
    try:
        host, pid = os.pread(fd, 300, 0).decode().split()
    except (OSError, ValueError):
        return ""
    return f" (host {host}, pid {pid})"
