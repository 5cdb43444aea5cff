"""A new structured-output guide is checked off the worker loop's thread (worker/requests/guidecheck.py): a real
WorkerLoop (native engine, continuous mode, tiny model), ticked by hand on real Redis, keeps decoding the
requests it runs while a burst of distinct, deliberately slow guides is being judged (entries a producer
wrote to the streams directly, past the clients' own check). Each bad-guide request gets exactly one
INVALID_REQUEST, each good one its answer; a request waiting for its verdict (stage VALIDATING) is
leased, can be cancelled, expires, and is handed back on shutdown.

Where the order of events must be certain, the guide-check thread is held by a gate (a task submitted to
it first): every check then waits behind it, whatever the machine's load."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator

import pytest
import redis

from batchfleet.common.errors import CANCELLED, DEADLINE_EXCEEDED, INVALID_REQUEST
from batchfleet.common.keys import Keys
from batchfleet.common.redis.functions import BODIES
from batchfleet.common.wire.guided import Guide
from batchfleet.common.wire.protocol import Error, Result
from batchfleet.worker.compose import build_worker
from batchfleet.worker.loop import WorkerLoop
from batchfleet.worker.requests.table import Stage
from tests.conftest import worker_config
from tests.helpers.loops import inbox_replies, raw_inbox, request_fields

pytestmark = pytest.mark.integration

# llguidance's lexer gives up on it after about half a second of work (tests/test_guide_checks.py): each
# distinct count is a new guide, so none is answered from the verdict cache
SLOW_BAD = "a{%d}"


@pytest.fixture
def loop(redis_url, namespace, tiny_model_dir, cache_dir) -> Iterator[WorkerLoop]:
    cfg = worker_config(redis_url, namespace, tiny_model_dir, engine="native", mode="continuous",
                        max_wait_ms=5, max_batch_size=32, kv_cache_gb=0.02)
    w = build_worker(cfg)
    yield w
    w.stopping.set()
    w.intake.guides.stop()
    w.transport.close()


@pytest.fixture
def r(redis_url) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def enqueue(r: redis.Redis, keys: Keys, job_id: str, guide: Guide | None = None, **kw) -> None:
    """Written straight to the stream, as a producer that skips the clients' check would."""
    r.xadd(keys.stream(32), request_fields(keys, job_id, [1, 10, 11], guide=guide, **kw))


def gate(w: WorkerLoop) -> threading.Event:
    """Holds the guide-check thread until set: every check submitted after it waits (VALIDATING)."""
    opened = threading.Event()
    w.intake.guides._pool.submit(opened.wait, 120)  # its one thread, busy with this first
    return opened


def tick_until(w: WorkerLoop, cond, limit: int = 3000) -> None:
    for _ in range(limit):
        w.tick()
        if cond():
            return
    raise AssertionError("condition not reached")


def replies(r: redis.Redis, keys: Keys) -> dict[str, list[Result | Error]]:
    return inbox_replies(r, keys)


def decoded(w: WorkerLoop, job_id: str) -> int:
    return len(w.engine.progress([job_id]).get(job_id, []))


def test_running_requests_keep_decoding_while_a_burst_of_slow_guides_is_checked(loop, r, namespace):
    keys = Keys(namespace)
    base = 500_000 + uuid.uuid4().int % 10_000 * 16
    bad = {f"bad{i}": Guide("regex", SLOW_BAD % (base + i)) for i in range(6)}
    n = uuid.uuid4().int % 1000 + 2
    good = {"good0": Guide("regex", f"(ab|cd){{1,{n}}}e"), "good1": Guide("choice", f'["yes{n}", "no{n}"]')}
    enqueue(r, keys, "plain", max_new_tokens=400, ignore_eos=True)
    tick_until(loop, lambda: decoded(loop, "plain") > 0)

    # held: the loop goes on ticking; the requests wait VALIDATING and "plain" decodes, token by token
    opened = gate(loop)
    try:
        for job, guide in (*bad.items(), *good.items()):
            enqueue(r, keys, job, guide, max_new_tokens=8)
        tick_until(loop, lambda: loop.requests.count(Stage.VALIDATING) == len(bad) + len(good))
        before = decoded(loop, "plain")
        for _ in range(5):
            loop.tick()
        assert decoded(loop, "plain") == before + 5  # one decode step per tick, none waits for a verdict
        assert {e.fields[b"id"].decode() for e in loop.requests.snapshot} >= set(bad) | set(good)  # leased
    finally:
        opened.set()

    # the real checks (about half a second each): decode steps come while one is in flight
    seen: list[tuple[frozenset[str], int]] = []  # after each tick: the requests checked, tokens of "plain"

    def burst_judged() -> bool:
        seen.append((frozenset(a.gen.id for a in loop.requests.of(Stage.VALIDATING)), decoded(loop, "plain")))
        return not seen[-1][0]

    tick_until(loop, burst_judged)
    during = [(ids, tokens) for ids, tokens in seen if ids & set(bad)]
    assert any(a[0] & b[0] and b[1] > a[1] for a, b in zip(during, during[1:])), \
        "no decode step of the running request while a slow guide was being checked"

    tick_until(loop, lambda: all(j in replies(r, keys) for j in ("plain", *bad, *good)))
    got = replies(r, keys)
    assert all(len(got[j]) == 1 for j in ("plain", *bad, *good)), "answered more than once"
    for job in bad:
        reply = got[job][0]
        assert isinstance(reply, Error) and reply.code == INVALID_REQUEST and "lexer error" in reply.message
    for job in ("plain", *good):
        assert isinstance(got[job][0], Result), got[job][0]
    assert got["good1"][0].text in (f"yes{n}", f"no{n}")
    assert all(loop.engine.guides.warmed(g) for g in good.values())  # compiled off the loop's thread too
    assert loop.ledger["internal_errors"] == 0


def test_a_request_waiting_for_its_verdict_can_be_cancelled_and_expires(loop, r, namespace):
    keys = Keys(namespace)
    base = 600_000 + uuid.uuid4().int % 10_000 * 16
    opened = gate(loop)
    try:
        enqueue(r, keys, "cancelled", Guide("regex", SLOW_BAD % base))
        enqueue(r, keys, "late", Guide("regex", SLOW_BAD % (base + 1)), timeout_ms=300)
        fine = Guide("regex", f"(x|y){{{base % 50 + 1}}}")
        fine.check()  # its verdict is known (as after the clients' check in this process): not compiled yet
        enqueue(r, keys, "fine", fine)
        tick_until(loop, lambda: loop.requests.count(Stage.VALIDATING) == 3)
        r.eval(BODIES["cancel"], 2, keys.cancel("cancelled"), keys.cancels, "cancelled", raw_inbox(keys), 60, 100)
        tick_until(loop, lambda: {"cancelled", "late"} <= set(replies(r, keys)))  # late: 300 ms after enqueue
        assert loop.requests.stage("fine") is Stage.VALIDATING
    finally:
        opened.set()
    # their verdicts come back after they were answered: ignored, never a second reply
    tick_until(loop, lambda: "fine" in replies(r, keys))
    got = replies(r, keys)
    assert [x.code for x in got["cancelled"]] == [CANCELLED]
    assert [x.code for x in got["late"]] == [DEADLINE_EXCEEDED]
    assert [type(x) for x in got["fine"]] == [Result]
    # one check thread, verdicts drained in order: cancelled's and late's were acted on before fine's
    assert {j: len(v) for j, v in got.items()} == {"cancelled": 1, "late": 1, "fine": 1}
    assert loop.requests.count(Stage.VALIDATING) == 0 and loop.ledger["internal_errors"] == 0
    assert loop.engine.guides.warmed(fine)  # compiled on the check thread: the same guide now runs at once
    enqueue(r, keys, "again", fine)
    tick_until(loop, lambda: loop.requests.stage("again") is not None or "again" in replies(r, keys))
    assert loop.requests.stage("again") is not Stage.VALIDATING
    tick_until(loop, lambda: "again" in replies(r, keys))


def test_requests_waiting_for_their_verdict_are_handed_back_on_shutdown(loop, r, namespace):
    keys = Keys(namespace)
    base = 700_000 + uuid.uuid4().int % 10_000 * 16
    opened = gate(loop)
    try:
        enqueue(r, keys, "waiting", Guide("regex", SLOW_BAD % base))
        tick_until(loop, lambda: loop.requests.stage("waiting") is Stage.VALIDATING)
        assert r.xpending(keys.stream(32), keys.group)["pending"] == 1
        loop.stopping.set()
        loop.run()  # stopping already: hands back what it holds, then returns
    finally:
        opened.set()
    assert r.xpending(keys.stream(32), keys.group)["pending"] == 0  # acked: the copy is back in the stream
    again = [f for _, f in r.xrange(keys.stream(32)) if f[b"id"] == b"waiting"]
    assert len(again) == 1 and replies(r, keys) == {}
