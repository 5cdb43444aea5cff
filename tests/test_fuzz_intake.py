"""Property-based fuzzing of worker intake: >= 1,000 malformed stream entries interleaved with good
requests, against a real worker (tiny model) on the shared Redis.

Every malformed entry that names a usable job id must be answered with an Error; every other one must be
dead-lettered; every good request must get a Result; the worker must stay alive throughout.
"""

from __future__ import annotations

import math
import uuid

import msgpack
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchfleet.common.keys import Keys
from batchfleet.common.wire.protocol import MAX_TIMEOUT_MS, MAX_TOKENS, SCHEMA_VERSION, Error, Result
from tests.conftest import TEST_BUCKETS
from tests.helpers.loops import inbox_replies, raw_inbox, request_fields, wait_until

VOCAB = 320  # the tiny preset
EXAMPLES = 24
PER_EXAMPLE = (44, 56)
GOOD_PER_EXAMPLE = 3

_bad_value = {
    "id": st.one_of(st.integers(-(2**63), 2**64 - 1), st.none(), st.text(alphabet=" !@#/", min_size=1, max_size=8)),
    "prompt": st.one_of(
        st.just([]), st.lists(st.integers(max_value=-1), min_size=1, max_size=4),
        st.lists(st.integers(min_value=VOCAB, max_value=2**40), min_size=1, max_size=4),
        st.lists(st.floats(allow_nan=True), min_size=1, max_size=3), st.text(max_size=5), st.none(),
        st.lists(st.lists(st.integers(0, 5), max_size=2), min_size=1, max_size=2),
        st.just([1] * 300),  # longer than the largest bucket
    ),
    "max_new_tokens": st.one_of(st.integers(max_value=0), st.integers(min_value=MAX_TOKENS + 1, max_value=2**62),
                                st.floats(), st.booleans(), st.text(max_size=3), st.none()),
    "temperature": st.one_of(st.floats(max_value=-1e-9), st.floats(min_value=100.5), st.just(math.nan),
                             st.just(math.inf), st.text(max_size=3), st.none(), st.booleans()),
    "top_p": st.one_of(st.floats(max_value=0.0), st.floats(min_value=1.01), st.just(math.nan), st.text(max_size=2)),
    "top_k": st.one_of(st.integers(max_value=-1), st.integers(min_value=2**20 + 1, max_value=2**62), st.floats()),
    "seed": st.one_of(st.integers(min_value=-(2**62), max_value=-1), st.floats(), st.text(max_size=3)),
    "stop": st.one_of(st.text(min_size=1, max_size=4), st.just([""]), st.lists(st.just("x"), min_size=17, max_size=20),
                      st.just(["y" * 300]), st.lists(st.integers(-(2**63), 2**64 - 1), min_size=1, max_size=2)),
    "timeout_ms": st.one_of(st.integers(min_value=-(2**62), max_value=-1), st.floats(), st.text(max_size=3),
                            st.booleans(),
                            st.integers(min_value=MAX_TIMEOUT_MS + 1, max_value=2**62),
                            st.just(0)),  # 0: valid, answered deadline_exceeded
    "stream": st.one_of(st.integers(-(2**62), 2**62), st.text(max_size=3), st.none()),
    # integers msgpack can pack (past 64 bits the generator itself would fail)
    "reply_key": st.one_of(st.text(max_size=10), st.just("other:inbox:x"), st.integers(-(2**63), 2**64 - 1)),
    # every version but this side's own (a literal list went stale when the schema moved to 3)
    "v": st.sampled_from([0, SCHEMA_VERSION - 1, SCHEMA_VERSION + 1, 99, -1, str(SCHEMA_VERSION), None,
                          [SCHEMA_VERSION], float(SCHEMA_VERSION), True]),
}
_required = ["id", "prompt", "max_new_tokens", "reply_key", "v"]


def _valid(keys: Keys, job_id: str) -> dict:
    return {"v": SCHEMA_VERSION, "id": job_id, "prompt": [5, 6, 7], "max_new_tokens": 2,
            "reply_key": raw_inbox(keys), "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None, "stop": [],
            "timeout_ms": None, "stream": False}


@st.composite
def bad_entry(draw, keys: Keys) -> tuple[dict, bool]:
    """(entry fields, whether it names a usable id and so must be answered with an Error)."""
    job_id = f"fz-{uuid.uuid4().hex}"
    kind = draw(st.sampled_from(["field", "missing", "raw", "bomb", "utf8", "noid", "badid", "junk", "bin",
                                 "huge", "mismatch", "badreply"]))
    inbox = raw_inbox(keys).encode()
    obj = _valid(keys, job_id)
    if kind == "field":
        key = draw(st.sampled_from(sorted(_bad_value)))
        obj[key] = draw(_bad_value[key])
        payload = msgpack.packb(obj, use_bin_type=True)
    elif kind == "missing":
        del obj[draw(st.sampled_from(_required))]
        payload = msgpack.packb(obj, use_bin_type=True)
    elif kind == "raw":
        payload = draw(st.binary(max_size=64))
    elif kind == "bomb":
        payload = draw(st.sampled_from([b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\x91" * 100_000,
                                        b"\xdb\xff\xff\xff\xff" + b"a" * 8, b"\xc1", b"\x81\xa1v\x01" * 3]))
    elif kind == "utf8":  # a stop string (or the id) that is not UTF-8: packed as raw str bytes
        field = draw(st.sampled_from(["stop", "reply_key"]))
        obj[field] = [b"\xff\xfe\xfd"] if field == "stop" else b"\xc3\x28"
        payload = msgpack.packb(obj, use_bin_type=False)
    elif kind == "bin":
        obj["prompt"] = b"\x01\x02"
        payload = msgpack.packb(obj, use_bin_type=True)
    elif kind == "huge":
        obj["prompt"] = [1] * draw(st.sampled_from([MAX_TOKENS + 1, 70_000]))
        payload = msgpack.packb(obj, use_bin_type=True)
    elif kind == "mismatch":
        obj["id"] = f"other-{uuid.uuid4().hex[:8]}"
        payload = msgpack.packb(obj, use_bin_type=True)
    elif kind == "noid":
        return {"r": inbox, "p": msgpack.packb(obj, use_bin_type=True)}, False
    elif kind == "badid":
        bad = draw(st.sampled_from([b"", b"\xff\xfe", b"has space", b"x" * 129, b"a/b", b"\x00", b"abc\n"]))
        return {"id": bad, "r": inbox, "p": msgpack.packb(obj, use_bin_type=True)}, False
    elif kind == "badreply":  # no inbox to answer on: dead-lettered
        bad = draw(st.sampled_from([b"", b"\xff", inbox + b"\n", keys.inbox("short").encode(), b"bf:reply:x"]))
        return {"id": job_id.encode(), "r": bad, "p": msgpack.packb(obj, use_bin_type=True)}, False
    else:  # junk fields, never a usable id
        fields = draw(st.dictionaries(st.binary(min_size=1, max_size=6).filter(lambda k: k != b"id"),
                                      st.binary(max_size=24), max_size=4))
        return fields or {"x": b""}, False
    return {"id": job_id.encode(), "r": inbox, "p": payload}, True


def test_fuzzed_entries_all_answered_or_dead_lettered(start_worker, redis_url, namespace):
    w = start_worker(max_wait_ms=5, max_batch_size=16)
    keys = Keys(namespace)
    r = redis.Redis.from_url(redis_url)
    totals = {"bad": 0, "answered": 0, "dead": 0, "good": 0}

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(batch=st.lists(bad_entry(keys), min_size=PER_EXAMPLE[0], max_size=PER_EXAMPLE[1]),
           buckets=st.lists(st.sampled_from(TEST_BUCKETS), min_size=PER_EXAMPLE[1], max_size=PER_EXAMPLE[1]))
    def run(batch, buckets):
        # interleave: a good request after every len/GOOD_PER_EXAMPLE bad ones
        plan: list[tuple[int, dict, str]] = []  # (bucket, fields, "answer" | "dead" | "good")
        step = len(batch) // GOOD_PER_EXAMPLE
        for i, (fields, answerable) in enumerate(batch):
            plan.append((buckets[i], fields, "answer" if answerable else "dead"))
            if i % step == 0:
                gid = f"good-{uuid.uuid4().hex}"
                plan.append((32, request_fields(keys, gid, [5, 6, 7]), "good"))
        pipe = r.pipeline(transaction=False)
        for bucket, fields, _ in plan:
            pipe.xadd(keys.stream(bucket), fields)
        added = pipe.execute()
        must_answer = [f["id"].decode() for _, f, kind in plan if kind == "answer"]
        good = [f["id"].decode() for _, f, kind in plan if kind == "good"]
        must_dead = [eid for (_, _, kind), eid in zip(plan, added) if kind == "dead"]

        def settled() -> bool:
            p = r.pipeline(transaction=False)
            for j in must_answer + good:
                p.exists(keys.done(j, raw_inbox(keys)))
            return all(p.execute()) and not (set(must_dead) - dead_seen())

        def dead_seen() -> set[bytes]:
            return {f[b"entry_id"] for _, f in r.xrange(keys.dead)}

        wait_until(settled, 30, "every fuzzed entry handled")
        answers = inbox_replies(r, keys)
        assert all(len(answers[j]) == 1 for j in must_answer + good), "each answered exactly once"
        assert all(isinstance(answers[j][0], Error) for j in must_answer)
        assert all(isinstance(answers[j][0], Result) for j in good)
        r.delete(raw_inbox(keys))
        assert w.thread.is_alive()
        totals["bad"] += len(batch)
        totals["answered"] += len(must_answer)
        totals["dead"] += len(must_dead)
        totals["good"] += len(good)

    run()
    print(f"\nfuzz: {totals}")
    assert totals["bad"] >= 1000 and totals["answered"] and totals["dead"]
    assert w.thread.is_alive() and w.loop.ledger["internal_errors"] == 0
    assert sum(r.xlen(keys.stream(b)) for b in TEST_BUCKETS) == 0

