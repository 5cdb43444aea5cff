"""The request table (worker/requests/table.py): stages, duplicate check, outbox, lease snapshot, hand-back set.
Pure: no Redis, no engine."""

from __future__ import annotations

from dataclasses import replace

import msgpack
import pytest

from batchfleet.common.keys import Keys
from batchfleet.common.wire.params import Params
from batchfleet.common.wire.priority import LEVEL, PRIORITIES
from batchfleet.common.wire.protocol import Error, Request
from batchfleet.worker.batching.batcher import Batcher
from batchfleet.worker.requests.table import RequestTable, Stage
from batchfleet.worker.requests.validate import Accepted, Limits, accept
from batchfleet.worker.transport.base import Entry, Reply

pytestmark = pytest.mark.unit  # pure: no Redis, no model, no subprocess

KEYS = Keys("t")
INBOX = KEYS.inbox("client0123456789")
LATER = 1e12  # every batch has closed by age
ROOM = {"interactive": 8, "background": 8}


def acc(job_id: str, bucket: int = 32, entry_id: str | None = None, inbox: str = INBOX) -> Accepted:
    req = Request(id=job_id, prompt=[1, 2], reply_key=inbox, params=Params(max_new_tokens=2))
    entry = Entry(bucket, entry_id or f"{job_id}-0", {b"id": job_id.encode(), b"r": inbox.encode(), b"p": req.encode()})
    out = accept(entry, KEYS, Limits(max_seq_len=64, vocab_size=320), now=2.0)
    assert isinstance(out, Accepted)
    return out


def test_the_class_is_the_stream_an_entry_came_from():
    req = Request(id="j", prompt=[1, 2], reply_key=INBOX, params=Params(max_new_tokens=2))
    assert "priority" not in msgpack.unpackb(req.encode())  # carried once: by the stream
    older = msgpack.packb({**msgpack.unpackb(req.encode()), "priority": "interactive"})  # an older producer's
    for payload in (req.encode(), older):
        for priority in PRIORITIES:
            entry = Entry(32, "1-0", {b"id": b"j", b"r": INBOX.encode(), b"p": payload}, priority=priority)
            out = accept(entry, KEYS, Limits(max_seq_len=64, vocab_size=320), now=2.0)
            assert isinstance(out, Accepted) and out.gen.priority == LEVEL[priority]
            assert out.gen.params == req.params  # embedded as decoded, not copied field by field


def table() -> RequestTable:
    return RequestTable(Batcher((32, 64), 8, 50))


def ids(accs: list[Accepted]) -> list[str]:
    return [a.gen.id for a in accs]


def snap(table: RequestTable) -> list[tuple[int, str]]:
    return [(e.bucket, e.entry_id) for e in table.snapshot]


def reply(job_id: str, bucket: int = 32) -> Reply:
    return Reply(job_id, Error(job_id, "cancelled", "test"), bucket, f"{job_id}-0", INBOX)


def test_stages_follow_a_request_from_queue_to_answer():
    t = table()
    a, b, c = acc("a"), acc("b", bucket=64), acc("c")
    t.queue(a)
    t.queue(b)
    t.queue(c, alone=True)
    assert [t.stage(j) for j in "abcx"] == [Stage.QUEUED, Stage.QUEUED, Stage.SOLO, None]
    assert [t.count(s) for s in Stage] == [0, 2, 1, 0, 0]  # validating, queued, solo, running, outbox
    assert snap(t) == [(32, "a-0"), (64, "b-0"), (32, "c-0")]
    assert ids(t.take_batch(LATER, ROOM)) == ["a"] and ids(t.take_batch(LATER, ROOM)) == ["b"]  # buckets never mix
    assert t.take_batch(LATER, ROOM) is None
    assert ids(t.of(Stage.RUNNING)) == ["a", "b"] and ids(t.of(Stage.QUEUED)) == []
    assert t.finish("a") is a and t.stage("a") is None
    t.answer([reply("a")])
    assert t.stage("a") is Stage.OUTBOX and t.outbox == (reply("a"),)
    assert [t.count(s) for s in Stage] == [0, 0, 1, 1, 1]
    assert snap(t) == [(32, "c-0"), (64, "b-0"), (32, "a-0")]  # held (queued, solo, running), then outbox
    t.written(1)
    assert t.outbox == () and t.stage("a") is None and snap(t) == [(32, "c-0"), (64, "b-0")]


def test_duplicate_check_covers_held_stages_but_not_the_outbox():
    t = table()
    t.queue(acc("q"))
    t.queue(acc("s"), alone=True)
    t.queue(acc("r"))
    t.drop("q")
    assert ids(t.take_batch(LATER, ROOM)) == ["r"]
    t.queue(acc("q"))
    t.answer([reply("o")])
    assert [t.holds(j) for j in ("q", "s", "r", "o", "x")] == [True, True, True, False, False]
    assert t.take_alone().gen.id == "s"  # a request running alone is still held
    assert t.holds("s") and t.stage("s") is Stage.RUNNING and t.take_alone() is None


def test_a_job_is_named_by_its_inbox_and_its_id_and_runs_under_a_run_id_of_its_own():
    # two inboxes chose one job id: each is a job of its own, held at once (issue 54 item 1)
    t = table()
    other = KEYS.inbox("other0123456789abc")
    a = acc("j")
    t.queue(a)
    assert t.run_of(INBOX, "j") == "j" and t.run_of(other, "j") is None
    run = t.free_run_id("j")
    assert run == "j~1" and not t.holds(run)
    b = acc("j", entry_id="b-0", inbox=other)
    b = replace(b, gen=replace(b.gen, id=run))
    t.queue(b)
    assert t.run_of(other, "j") == "j~1" and t.free_run_id("j") == "j~2" and t.free_run_id("k") == "k"
    assert ids(t.take_batch(LATER, ROOM)) == ["j", "j~1"]
    assert t.finish("j") is a and t.run_of(INBOX, "j") is None and t.run_of(other, "j") == "j~1"
    assert t.free_run_id("j") == "j"  # free again: the other inbox's request keeps its own
    assert t.drop("j~1") is b and t.run_of(other, "j") is None and t.snapshot == ()


def test_failed_batch_members_run_alone_in_start_order():
    t = table()
    batch = [acc("x"), acc("y"), acc("z")]
    t.queue(acc("w"), alone=True)
    for a in batch:
        t.queue(a)
    assert ids(t.take_batch(LATER, ROOM)) == ["x", "y", "z"]
    t.run_alone(t.of(Stage.RUNNING))
    assert ids(t.of(Stage.SOLO)) == ["w", "x", "y", "z"] and t.count(Stage.RUNNING) == 0
    assert t.drop("y").gen.id == "y" and t.drop("y") is None
    assert ids(t.of(Stage.SOLO)) == ["w", "x", "z"]


def test_unstarted_entries_are_handed_back_queued_first_then_solo_then_validating():
    t = table()
    t.validate(acc("v1"))
    t.queue(acc("s1"), alone=True)
    t.queue(acc("q1"))
    t.queue(acc("r1"))
    t.queue(acc("q2", bucket=64))
    t.drop("q1")
    assert ids(t.take_batch(LATER, {"interactive": 1})) == ["r1"]
    t.queue(acc("q1"))
    t.answer([reply("done")])
    assert [(e.bucket, e.entry_id) for e in t.unstarted()] == [(64, "q2-0"), (32, "q1-0"), (32, "s1-0"),
                                                                (32, "v1-0")]
    t.forget_unstarted()
    assert t.unstarted() == [] and {s: t.count(s) for s in Stage if t.count(s)} == {Stage.RUNNING: 1,
                                                                                     Stage.OUTBOX: 1}
    assert snap(t) == [(32, "r1-0"), (32, "done-0")]


def test_snapshot_is_replaced_never_mutated():
    t = table()
    t.queue(acc("a"))
    before = t.snapshot
    t.take_batch(LATER, ROOM)
    t.finish("a")
    assert before == (acc("a").entry,) and t.snapshot == () and before is not t.snapshot
    assert isinstance(t.snapshot, tuple)


def test_outbox_may_hold_several_replies_for_one_job_and_forgets_only_what_was_written():
    t = table()
    t.answer([reply("j"), reply("k")])
    t.answer([reply("j", bucket=64)])
    assert [(r.job_id, r.bucket) for r in t.outbox] == [("j", 32), ("k", 32), ("j", 64)]
    written = t.outbox
    t.answer([reply("late")])  # arrives while the first three are being written
    t.written(len(written))
    assert [r.job_id for r in t.outbox] == ["late"] and t.count(Stage.OUTBOX) == 1


def test_queued_requests_and_their_batches_change_together():
    t = table()
    a, b, c, d = acc("a"), acc("b"), acc("c"), acc("d", bucket=64)
    for x in (a, b, c, d):
        t.queue(x)
    assert t.drop("b") is b and t.stage("b") is None  # dropped from its batch too
    assert t.expire(lambda x: x.gen.id == "c") == [c] and t.count(Stage.QUEUED) == 2
    assert ids(t.take_batch(LATER, ROOM)) == ["a"]
    t.requeue([a])  # a bystander of a failed step: back in its batch
    assert t.stage("a") is Stage.QUEUED and ids(t.take_batch(LATER, ROOM)) == ["a"]
    assert ids(t.take_batch(LATER, ROOM)) == ["d"] and t.take_batch(LATER, ROOM) is None
    t.queue(acc("e"))
    t.forget_unstarted()
    assert t.take_batch(LATER, ROOM) is None and t.next_deadline() is None


def test_a_request_whose_guide_is_checked_is_held_leased_and_leaves_once():
    t = table()
    v, w, x, y = acc("v"), acc("w"), acc("x"), acc("y")
    t.validate(v)
    t.validate(w, alone=True)
    t.validate(x)
    t.validate(y)
    assert [t.stage(j) for j in "vwxy"] == [Stage.VALIDATING] * 4 and t.holds("v")
    assert snap(t) == [(32, "v-0"), (32, "w-0"), (32, "x-0"), (32, "y-0")]  # leased while checked
    assert t.waiting("interactive") == 4 and t.take_batch(LATER, ROOM) is None  # held, never in a batch
    assert t.validated(v) and t.stage("v") is Stage.QUEUED
    assert t.validated(w) and t.stage("w") is Stage.SOLO  # it came to run alone: it still does
    assert t.drop("x") is x and not t.validated(x)  # cancelled while checked: its verdict changes nothing
    assert t.expire(lambda a: a.gen.id == "y") == [y] and not t.validated(y) and t.stage("y") is None
    t.validate(acc("x"))  # a later copy of the job: the first copy's verdict is not its
    assert not t.validated(x) and t.stage("x") is Stage.VALIDATING
    assert ids(t.take_batch(LATER, ROOM)) == ["v"]
