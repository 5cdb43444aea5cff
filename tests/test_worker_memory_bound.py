"""A worker's memory does not follow hostile entry sizes (issue #12, point 5), and ids with a newline are
never answered on a key (point 4), end to end with a worker process.

Raw XADDs (a producer may bypass the enqueue function) of 26 entries of 40 MB, plus ones without a
usable id, and 10 cancel entries and a cancel marker of 40 MB each (the cancel path is read the same bounded
way): the worker's peak RSS (VmHWM) stays within ``RSS_BOUND_MB`` of its idle RSS, each entry with
an id is answered ``invalid_request`` exactly once, each without one is dead-lettered exactly once, and
no key holding a newline appears. On a private redis-server (1 GB of entries stays off the shared one).
"""

from __future__ import annotations

import time

import redis

from batchfleet.common.errors import INVALID_REQUEST
from batchfleet.common.keys import Keys
from batchfleet.common.wire.protocol import Error
from batchfleet.worker.devtools import PrivateRedis, free_port, spawn_worker
from tests.helpers.loops import inbox_replies, wait_until

RSS_BOUND_MB = 250  # docs/RELIABILITY.md states it; before the bounded reads, 2.5 GB
ENTRY_MB = 40
N_BIG = 26
ARGS = ["--engine", "hf", "--mode", "dynamic", "--dtype", "float32", "--max-seq-len", "512",
        "--buckets", "32,64,128,256", "--threads", "1"]


def _mem_kb(pid: int) -> dict[str, int]:
    with open(f"/proc/{pid}/status") as f:
        return {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f) if k in ("VmHWM", "VmRSS")}


def test_worker_rss_stays_bounded_under_huge_raw_entries_each_answered_once(tiny_model_dir, cache_dir, tmp_path):
    server = PrivateRedis(port=free_port()).start()
    ns = "mem"
    keys = Keys(ns)
    w = None
    try:
        w = spawn_worker(server.url, ns, [*ARGS, "--model", str(tiny_model_dir), "--cache-dir", str(cache_dir)],
                         log_path=str(tmp_path / "worker.log"))
        r = redis.Redis.from_url(server.url)
        time.sleep(1.0)  # let start-up allocations settle
        idle = _mem_kb(w.proc.pid)
        inbox = keys.inbox("m" * 22)
        big = b"\x00" * (ENTRY_MB * 1_000_000)
        jobs = [f"big{i}" for i in range(N_BIG)]
        t0 = time.monotonic()
        for i, job in enumerate(jobs):
            fields = {"id": job, "r": inbox, "p": big} if i % 3 else {"junk": big, "id": job, "r": inbox}
            r.xadd(keys.stream((32, 64, 128, 256)[i % 4]), fields)
        nameless = [r.xadd(keys.stream(32), {"p": big}),  # no id: nobody to answer
                    r.xadd(keys.stream(64), {"id": "abc\n", "r": inbox, "p": b"x"})]  # not a valid id either
        for _ in range(10):  # hostile cancels: neither a job id nor a reply key of that size exists
            r.xadd(keys.cancels, {"id": big, "r": big})
        r.set(keys.cancel(jobs[1]), big)  # a marker no reply key matches: the job is answered as usual
        del big

        def settled() -> bool:
            return all(r.xlen(keys.stream(b)) == 0 for b in (32, 64, 128, 256))

        wait_until(settled, 120, "every entry answered or dead-lettered")
        took = time.monotonic() - t0
        peak = _mem_kb(w.proc.pid)
        grew_mb = (peak["VmHWM"] - idle["VmRSS"]) / 1024
        print(f"\nworker RSS idle {idle['VmRSS'] / 1024:.0f} MB, peak {peak['VmHWM'] / 1024:.0f} MB "
              f"(+{grew_mb:.0f} MB) over {N_BIG} x {ENTRY_MB} MB raw entries; all settled in {took:.1f}s")
        assert grew_mb < RSS_BOUND_MB

        replies = inbox_replies(r, keys, inbox)
        assert sorted(replies) == sorted(jobs)
        for job, got in replies.items():
            assert len(got) == 1 and isinstance(got[0], Error) and got[0].code == INVALID_REQUEST, (job, got)
            assert "too large" in got[0].message
        dead = [f for _, f in r.xrange(keys.dead)]
        assert sorted(f[b"entry_id"] for f in dead) == sorted(nameless)  # each exactly once
        assert all(len(v) <= 4096 for f in dead for v in f.values())  # bounded copies
        assert not [k for k in r.scan_iter(match=f"{ns}:*") if b"\n" in k]  # no key made from "abc\n"
        assert w.proc.poll() is None
    finally:
        if w is not None:
            w.stop()
        server.stop()
