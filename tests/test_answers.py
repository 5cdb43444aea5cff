"""Replies stored under the inbox and rung for (protocol v5, producer/answers.py, worker/transport/settle.py), on real
Redis with a real worker and the real client: a writer that died between storing an answer and ringing is
covered by the next copy's ring; the client takes each answer once however often it is rung for, and empties
it once taken; an answer lives under the request's own inbox, so a request naming another inbox's job id
gets its own answer and leaves the other's alone."""

from __future__ import annotations

import threading

import pytest
import redis

from batchfleet.common.errors import ANSWER_EXPIRED, INVALID_REQUEST, AnswerExpired, JobFailed, Timeout
from batchfleet.common.keys import Keys
from batchfleet.common.wire.protocol import Result
from batchfleet.producer import Client
from tests.helpers.loops import (
    TEST_INBOX,
    inbox_replies,
    raw_inbox,
    request_fields,
    wait_inbox_holds_nothing,
    wait_until,
)


def test_a_copy_of_a_job_answered_but_never_rung_for_rings_and_the_client_gets_it(start_worker, redis_url,
                                                                                 namespace):
    """The first writer stored the answer and died before its ring: the copy a worker reads later (reclaimed or
    enqueued again) is not run again; it rings, and the waiting client gets the stored answer."""
    w = start_worker(max_wait_ms=5)
    keys, r = Keys(namespace), redis.Redis.from_url(redis_url)
    stored = Result("lost-ring", [7, 8], "stored answer", "length", 2, 2, 0.0, 0.0, 0.0, "dead-worker", 1)
    r.set(keys.done("lost-ring", raw_inbox(keys)), stored.encode(), ex=60)  # the answer, and no ring
    with Client(redis_url, namespace, inbox=TEST_INBOX) as client:
        r.xadd(keys.stream(32), request_fields(keys, "lost-ring", [1, 10, 11]))
        got = client.result("lost-ring", timeout=30)
        assert got.text == "stored answer" and got.worker == "dead-worker"
        wait_until(lambda: r.get(keys.done("lost-ring", raw_inbox(keys))) == b"", 10, "the answer emptied")
    assert w.loop.ledger["duplicates"] == 1 and w.loop.ledger["batches"] == 0
    assert r.ttl(keys.done("lost-ring", raw_inbox(keys))) > 0  # emptied, not deleted: still rules out a 2nd


def test_every_ring_of_one_job_gives_the_client_one_answer_and_leaves_nothing(start_worker, redis_url, namespace):
    start_worker(max_wait_ms=5)
    keys, r = Keys(namespace), redis.Redis.from_url(redis_url)
    with Client(redis_url, namespace, inbox=TEST_INBOX) as client:
        job = client.submit([1, 10, 11], max_new_tokens=2)
        first = client.result(job, timeout=30)
        answer = keys.done(job, client.reply_key)
        wait_until(lambda: r.get(answer) == b"" and r.xlen(client.reply_key) == 0, 10, "ring deleted, answer emptied")
        for _ in range(3):  # late rings (copies of the job answered already) for a job the caller has taken
            r.xadd(client.reply_key, {"id": job, "done": "1"})
        wait_until(lambda: r.xlen(client.reply_key) == 0, 10, "the late rings deleted unread")
        wait_inbox_holds_nothing(client._async.inbox)
    assert first.completion_tokens == 2 and r.get(answer) == b""


def test_an_answer_lives_under_its_own_inbox(start_worker, redis_url, namespace):
    """A request that names a job id another client uses, with its own inbox, is answered into its own inbox
    and does not block the other's answer (before v5 the first answered copy won the job id fleet-wide)."""
    start_worker(max_wait_ms=5)
    keys, r = Keys(namespace), redis.Redis.from_url(redis_url)
    r.xadd(keys.stream(32), request_fields(keys, "shared-id", [1, 12, 13]))  # a raw producer, its own inbox
    wait_until(lambda: "shared-id" in inbox_replies(r, keys), 30, "the raw request answered")
    with Client(redis_url, namespace) as client:
        got = client.result(client.submit([1, 10, 11], max_new_tokens=2, job_id="shared-id"), timeout=30)
        assert got.id == "shared-id" and got.completion_tokens == 2
        assert r.exists(keys.done("shared-id", client.reply_key), keys.done("shared-id", raw_inbox(keys))) == 2



def test_a_request_reusing_a_job_id_answered_in_its_inbox_gets_an_error_instead_of_waiting(start_worker, redis_url,
                                                                                          namespace):
    """A job id gets one answer per inbox until the reply TTL passes: a second request under the id of a job whose
    answer was taken is rung for with that taken (emptied) answer, and its caller gets a clear error at once
    (it waited for ever before, with no timeout)."""
    start_worker(max_wait_ms=5)
    keys, r = Keys(namespace), redis.Redis.from_url(redis_url)
    with Client(redis_url, namespace) as client:
        assert client.result(client.submit([1, 10, 11], max_new_tokens=2, job_id="used-once"), timeout=30).text
        answer = keys.done("used-once", client.reply_key)
        wait_until(lambda: r.get(answer) == b"", 10, "the first answer taken and emptied")
        job = client.submit([1, 10, 12], max_new_tokens=3, job_id="used-once")
        with pytest.raises(JobFailed) as err:
            client.result(job, timeout=30)
        assert err.value.code == INVALID_REQUEST and "new job id" in err.value.message
        wait_until(lambda: r.xlen(client.reply_key) == 0, 10, "the ring taken with the error")
        wait_inbox_holds_nothing(client._async.inbox)
        fresh = client.result(client.submit([1, 10, 12], max_new_tokens=3), timeout=30)  # the client goes on
    assert fresh.completion_tokens == 3 and r.get(answer) == b""


def _store(r: redis.Redis, keys: Keys, job: str) -> None:
    """An answer stored for ``job`` in the raw test inbox, as a worker stores it (no ring)."""
    stored = Result(job, [7, 8], "stored answer", "length", 2, 2, 0.0, 0.0, 0.0, "some-worker", 1)
    r.set(keys.done(job, raw_inbox(keys)), stored.encode(), ex=60)


def test_a_second_ring_read_before_the_taken_answer_is_emptied_is_no_second_answer(redis_url, namespace):
    """Two writers ring for one job (a rewrite after a lost connection or an unmet WAIT, a copy run by another
    worker): the second ring, read while the first one's deletion is still on its way (the answer not emptied
    yet), must not hand the answer over again (it was kept as an unclaimed answer: a second result() got it)."""
    keys, r = Keys(namespace), redis.Redis.from_url(redis_url)
    inbox = raw_inbox(keys)
    with Client(redis_url, namespace, inbox=TEST_INBOX) as client:
        _store(r, keys, "twice-rung")
        r.xadd(inbox, {"id": "twice-rung", "done": "1"})
        assert client.result("twice-rung", timeout=10).text == "stored answer"
        r.xadd(inbox, {"id": "twice-rung", "done": "1"})  # at once: the client empties the answer ~20 ms later
        wait_until(lambda: r.xlen(inbox) == 0, 10, "both rings deleted")
        wait_inbox_holds_nothing(client._async.inbox)
        with pytest.raises(Timeout):
            client.result("twice-rung", timeout=0.5)
        assert r.get(keys.done("twice-rung", inbox)) == b""


def test_two_rings_of_an_answer_nobody_waits_for_yet_are_both_deleted_once_it_is_taken(redis_url, namespace):
    """Rings read before anyone asks (a reused inbox: a resumed bulk run) keep the answer for a later result(); a
    second ring of it is deleted without emptying the answer, and the first one once the answer is taken (the
    second used to replace the first, which then stayed in the inbox, and in the client's memory, for good)."""
    keys, r = Keys(namespace), redis.Redis.from_url(redis_url)
    inbox = raw_inbox(keys)
    with Client(redis_url, namespace, inbox=TEST_INBOX) as client:
        with pytest.raises(Timeout):
            client.result("warm-up", timeout=0.2)  # the inbox reader runs
        _store(r, keys, "unclaimed")
        r.xadd(inbox, {"id": "unclaimed", "done": "1"})
        r.xadd(inbox, {"id": "unclaimed", "done": "1"})
        wait_until(lambda: r.xlen(inbox) == 1, 10, "the second ring deleted")
        assert r.get(keys.done("unclaimed", inbox)) != b""  # still to be taken
        assert client.result("unclaimed", timeout=10).text == "stored answer"
        wait_until(lambda: r.xlen(inbox) == 0 and r.get(keys.done("unclaimed", inbox)) == b"", 10, "all gone")
        assert client._async.inbox._answers._keys == {}


def test_a_reply_redis_refuses_for_memory_leaves_its_entry_pending():
    """A full Redis (``maxmemory``, ``noeviction``: what deploy/ runs) refuses the answer's SET and the ring's XADD
    (OOM) but not XACK or XDEL: a reply pipeline that went on to its acks settled entries whose answers were never
    stored, so a worker that died before Redis had room again lost those jobs (nothing left to reclaim)."""
    from batchfleet.common.config import ConnectionConfig
    from batchfleet.common.wire.protocol import Error
    from batchfleet.worker.devtools import PrivateRedis, free_port
    from batchfleet.worker.transport.base import Reply
    from batchfleet.worker.transport.consumer import StreamConsumer

    server = PrivateRedis(port=free_port()).start()
    try:
        consumer = StreamConsumer(ConnectionConfig(server.url, "oom"), (32,), "w-oom", 60)
        consumer.setup()
        keys, r = consumer.keys, redis.Redis.from_url(server.url)
        r.xadd(keys.stream(32), request_fields(keys, "job-oom", [1, 2]))
        (entry,) = consumer.read(count=1, block_ms=None)
        r.config_set("maxmemory", 1)  # from now on every command that may grow memory is refused (OOM)
        with pytest.raises(redis.ResponseError, match="maxmemory"):
            consumer.settler.write_replies([Reply.to(entry, "job-oom", Error("job-oom", "engine_error", "x"),
                                              raw_inbox(keys))])
        r.config_set("maxmemory", 0)
        assert r.xpending(keys.stream(32), keys.group)["pending"] == 1 and r.xlen(keys.stream(32)) == 1
        consumer.close()
    finally:
        server.stop()


def test_a_caller_waiting_without_a_timeout_on_an_answer_that_expired_unread_gets_answer_expired(
        start_worker, redis_url, namespace):
    """Issue 54 item 10: the answer of a job expired (the reply TTL) before its client read it, while its ring
    stayed (later writes to the inbox kept the inbox alive). A caller waiting without a timeout waited for ever:
    the ring was deleted unread. It gets AnswerExpired, a JobFailed."""
    start_worker(max_wait_ms=5, reply_ttl_s=2)
    keys, r = Keys(namespace), redis.Redis.from_url(redis_url)
    with Client(redis_url, namespace, inbox=TEST_INBOX) as client:  # a process that submits, then stops reading
        job = client.submit([1, 10, 11], max_new_tokens=2, job_id="read-too-late")
    inbox, answer = raw_inbox(keys), keys.done(job, raw_inbox(keys))
    wait_until(lambda: r.exists(answer), 30, "the answer stored")
    r.persist(inbox)  # what later answers to other jobs of this inbox do: its ring stays
    wait_until(lambda: not r.exists(answer), 10, "the answer expired")
    assert r.xlen(inbox) == 1
    with Client(redis_url, namespace, inbox=TEST_INBOX) as client:  # back, it waits without a timeout
        outcome: list = []
        waiting = threading.Thread(target=lambda: outcome.append(_outcome(lambda: client.result(job))), daemon=True)
        waiting.start()
        waiting.join(30)
        assert outcome and isinstance(outcome[0], AnswerExpired) and outcome[0].code == ANSWER_EXPIRED, outcome
        assert isinstance(outcome[0], JobFailed) and "expired" in str(outcome[0])
        wait_until(lambda: r.xlen(inbox) == 0, 10, "the ring deleted")
        wait_inbox_holds_nothing(client._async.inbox)


def test_an_answer_stored_again_soon_after_a_ring_that_found_none_is_still_handed_over(redis_url, namespace):
    """A worker whose answer write was refused (Redis full) while its ring was taken writes both again from its
    outbox: the waiter gets that answer, not AnswerExpired (which waits for EXPIRED_GRACE_S)."""
    keys, r = Keys(namespace), redis.Redis.from_url(redis_url)
    inbox = raw_inbox(keys)
    with Client(redis_url, namespace, inbox=TEST_INBOX) as client:
        outcome: list = []
        waiting = threading.Thread(target=lambda: outcome.append(_outcome(lambda: client.result("late"))),
                                   daemon=True)
        waiting.start()
        r.xadd(inbox, {"id": "late", "done": "1"})  # the ring whose answer was refused
        wait_until(lambda: r.xlen(inbox) == 0, 10, "the ring read")
        stored = Result("late", [7], "written again", "length", 1, 1, 0.0, 0.0, 0.0, "w", 1)
        r.set(keys.done("late", inbox), stored.encode(), nx=True, ex=60)
        r.xadd(inbox, {"id": "late", "done": "1"})
        waiting.join(30)
        assert outcome and isinstance(outcome[0], Result) and outcome[0].text == "written again", outcome


def _outcome(call):
    try:
        return call()
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return exc


def test_an_answer_is_recorded_taken_in_redis_before_the_call_returns_it(redis_url, namespace):
    """The fault test's new.A: the answer used to be emptied ~20 ms after result() returned it, so a process
    killed in between (or whose emptying Redis refused) left it to be handed again to the inbox's next process."""
    keys, r = Keys(namespace), redis.Redis.from_url(redis_url)
    with Client(redis_url, namespace, inbox=TEST_INBOX) as client:
        _store(r, keys, "taken-first")
        r.xadd(raw_inbox(keys), {"id": "taken-first", "done": "1"})
        assert client.result("taken-first", timeout=10).text == "stored answer"
        assert r.get(keys.done("taken-first", raw_inbox(keys))) == b""  # at once: no wait
        wait_until(lambda: r.xlen(raw_inbox(keys)) == 0, 10, "the ring deleted")


def test_a_job_id_taken_by_a_process_killed_at_once_is_refused_to_the_inbox_next_process(start_worker, redis_url,
                                                                                         namespace, tmp_path):
    """new.A end to end: a process takes its answer and dies at once (os._exit: no deletion after it); the
    inbox's next process (same token: the documented way to collect after a restart) submits the id again and
    must get invalid_request, not the answer a second time."""
    import subprocess
    import sys

    start_worker(max_wait_ms=5)
    keys, r = Keys(namespace), redis.Redis.from_url(redis_url)
    token = "killedatonce0123456789"
    code = (
        "import os, sys\n"
        "from batchfleet.producer import Client\n"
        f"c = Client({redis_url!r}, {namespace!r}, inbox={token!r})\n"
        "res = c.result(c.submit([1, 10, 11], max_new_tokens=2, job_id='once'), timeout=60)\n"
        "sys.stdout.write(res.text); sys.stdout.flush()\n"
        "os._exit(0)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout, done.stderr
    assert r.get(keys.done("once", keys.inbox(token))) == b""
    with Client(redis_url, namespace, inbox=token) as again:
        job = again.submit([1, 10, 11], max_new_tokens=2, job_id="once")
        with pytest.raises(JobFailed) as err:
            again.result(job, timeout=30)
        assert err.value.code == INVALID_REQUEST and "answered in this inbox" in str(err.value)
