"""Replies survive a Redis crash (issue 12, point 1): a private Redis 7 (AOF, ``appendfsync always``) is
killed -9 and restarted on its AOF twice under load from sync (``Client``, 16 threads) and async
(``AsyncClient``, 16 tasks) clients, with its fsync slowed by strace and each kill timed to land inside
the fsync of a write that holds a worker's final reply (durable, not yet sent to anyone).

0 lost (every call returns its Result, with the text the same prompt got before the crashes), 0 answered
twice (no job id received twice, at most one final reply per job in the AOF), and the AOF shows no job
answered but never received. The harness is scripts/benchlib/redis_crash.py; scripts/bench_redis_crash.py
runs 20 cycles.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from scripts.benchlib.redis_crash import CrashPlan, run_crash

SYSTEM_REDIS = "/usr/bin/redis-server"

pytestmark = [
    pytest.mark.skipif(not Path(SYSTEM_REDIS).exists(), reason="needs the machine's Redis 7"),
    pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace to slow Redis' fsync"),
    pytest.mark.timeout(300),
]


def test_redis_kill9_under_load_loses_nothing_and_answers_once(tiny_model_dir: Path, tmp_path: Path) -> None:
    # 30 s per call: a restart costs ~1-5 s, so only a reply that never comes can run it out
    plan = CrashPlan(requests=192, cycles=2, fsync_delay_ms=200, timeout_s=30.0, redis_binary=SYSTEM_REDIS)
    report = run_crash(plan, tiny_model_dir, tmp_path)
    summary = report.summary()
    print("\n" + json.dumps({k: v for k, v in summary.items() if k != "plan"}, indent=1))
    assert len(report.cycles) == 2
    assert all(c.in_fsync for c in report.cycles), f"a kill missed the fsync window: {summary['cycles']}"
    assert not report.lost, (f"{len(report.lost)} of {len(report.outcomes)} lost, e.g. "
                             f"{[o.error for o in report.lost[:3]]}; worker log tail:\n{report.worker_log}")
    assert not report.duplicated, f"answered twice: {report.duplicated[:10]}"
    assert not report.mismatched, f"wrong text: {[(o.index, o.text) for o in report.mismatched[:5]]}"
    assert summary["aof_answered_never_received"] == 0
    assert summary["aof_enqueued_never_answered"] == 0
    assert summary["completed"] == plan.requests


def test_aof_reading_and_reply_audit_helpers(tmp_path: Path) -> None:
    """The audit's parsing on a hand-written AOF: options of XADD skipped, v1 and v2 replies counted,
    deltas and requests not, a torn last command ignored (as Redis does on load)."""
    import msgpack

    from scripts.benchlib.faults import aof_commands, audit_aof, xadd_fields

    def resp(*args: bytes) -> bytes:
        return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)

    def pack(**obj) -> bytes:
        return msgpack.packb(obj, use_bin_type=True)

    folder = tmp_path / "appendonlydir"
    folder.mkdir()
    (folder / "appendonly.aof.manifest").write_text("file appendonly.aof.1.base.rdb seq 1 type b\n"
                                                    "file appendonly.aof.1.incr.aof seq 1 type i\n")
    (folder / "appendonly.aof.1.incr.aof").write_bytes(b"".join([
        resp(b"SELECT", b"0"),
        resp(b"XADD", b"ns:stream:32", b"MAXLEN", b"~", b"100", b"1-0", b"id", b"a", b"r", b"ns:inbox:x",
             b"p", pack(id="a", prompt=[1])),
        resp(b"XADD", b"ns:inbox:x", b"2-0", b"id", b"a", b"p", pack(kind="delta", id="a", seq=0)),
        resp(b"XADD", b"ns:inbox:x", b"3-0", b"id", b"a", b"p", pack(kind="result", id="a")),
        resp(b"RPUSH", b"ns:reply:b", pack(kind="error", id="b")),
        resp(b"XADD", b"other:inbox:x", b"4-0", b"id", b"c", b"p", pack(kind="result", id="c")),
        resp(b"XADD", b"ns:inbox:x", b"5-0", b"id", b"a", b"p", pack(kind="result", id="a"))[:-7],  # torn
    ]))
    commands = list(aof_commands(tmp_path))
    assert len(commands) == 6 and commands[0] == [b"SELECT", b"0"]
    assert xadd_fields(commands[1])[b"id"] == b"a" and xadd_fields(commands[1])[b"r"] == b"ns:inbox:x"
    enqueued, replies = audit_aof(tmp_path, "ns")
    assert enqueued == {"a"} and dict(replies) == {"a": 1, "b": 1}
