"""Runs that share the background class move together (issue 58 item 5): a bulk run and an OpenAI batch job
started together on one real worker both get answers all along, neither waits for a block of the other's.

Timing-free where it can be: the order of the answers, not their times, says whether one run got ahead
(``longest_streak``: one run's answers in a row while the other still had lines left; a run that queued its
whole window made the other wait for all of it). The 10-s windows are measured by scripts/background_share.py;
here the windows are generous (30 s) for a loaded machine. Also: the limit counts only the run's own jobs
not read yet, and a Redis user that may not read the group's position turns it off instead of failing.
"""

from __future__ import annotations

import asyncio

import redis

from batchfleet.common.keys import Keys
from batchfleet.common.wire.priority import BACKGROUND
from batchfleet.producer.aclient import AsyncClient
from batchfleet.producer.bulk.queued import Queued
from scripts.background_share import longest_streak, shares, side_by_side
from tests.conftest import TEST_BUCKETS
from tests.helpers.loops import silent_fleet

LINES = 128  # each run's: below the window (256), so a run that queues its whole window queues every line
MAX_BATCH = 8


def test_a_bulk_run_and_a_batch_job_side_by_side_both_progress(start_worker, redis_url, namespace):
    start_worker(max_batch_size=MAX_BATCH, max_wait_ms=5)
    times = asyncio.run(side_by_side(redis_url, namespace, LINES, 2, share=True))
    streak = longest_streak(times)
    # each run keeps at most max_batch_size (one worker) unread: the worker's read of two batches holds at most
    # a few of each run's turns (about max_batch_size in a row); queuing the whole window gives about LINES
    assert max(streak.values()) <= 48, (streak, shares(times))
    for name, got in shares(times, window_s=30.0).items():
        assert got["answers"] == LINES and got["empty_windows"] == 0, (name, got)


def test_only_the_runs_own_unread_jobs_count_and_they_stop_counting_once_read(redis_url, namespace):
    async def check() -> None:
        async with AsyncClient(redis_url, namespace, require_workers=False) as client:
            queued = Queued(client)
            stream = Keys(namespace).stream(TEST_BUCKETS[0], BACKGROUND)
            ids = [await client.submit("hello", job_id=f"share-{i}", priority=BACKGROUND, placed=queued.placed)
                   for i in range(10)]
            assert queued.unread == 10 and await queued.full()  # the silent fleet's max_batch_size: 8, one worker
            r = redis.Redis.from_url(redis_url)
            r.xadd(stream, {"id": "other", "r": "x", "p": b""})  # another producer's, after ours
            r.xreadgroup(Keys(namespace).group, "reader", {stream: ">"}, count=4)
            queued.polled = 0.0
            await queued.poll()
            # 4 read, 7 not (6 of ours, the other's): by time, the group's position is not past the poll's clock
            # (all 10 unknown), by count at most the newest 7 are unread
            assert queued.unread == 7 and not await queued.full()
            await asyncio.sleep(0.01)
            for i in range(20):  # others', stamped past every poll so far
                r.xadd(stream, {"id": f"later-{i}", "r": "x", "p": b""})
            r.xreadgroup(Keys(namespace).group, "reader", {stream: ">"}, count=8)  # ours, the other's, one later
            await queued.poll()
            assert queued.unread == 0  # by time: 19 unread, none of them ours
            queued.placed("late", stream)
            queued.settled(["late", *ids])  # settled lines count no longer
            assert queued.unread == 0
            r.close()

    with silent_fleet(redis_url, namespace):
        asyncio.run(check())
