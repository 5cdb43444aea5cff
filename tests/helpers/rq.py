"""RQ's keys of one queue in the test Redis (no tests here). RQ names its keys itself (``rq:...``), outside the
test namespaces, so whatever runs RQ in a test (tests/test_rq.py, the RQ example of docs/USAGE.md) removes them
afterwards and checks that none is left: a run of the suite leaves no ``rq:*`` key behind."""

from __future__ import annotations

import redis


def rq_prefix() -> str:
    """What RQ's key names start with: "rq" (newer RQ reads another from RQ_KEY_PREFIX)."""
    from rq import defaults

    return getattr(defaults, "RQ_KEY_PREFIX", "rq")


def rq_keys_of(r: redis.Redis, queue: str) -> tuple[set[bytes], dict[bytes, set[bytes]]]:
    """Every key RQ made for ``queue``, and ``queue``'s members of RQ's shared sets (every queue, every worker).
    Its keys: those naming the queue (the queue, its registries), one of its jobs (``origin`` the queue: the
    job, its results, its executions) or one of its workers (``queues`` naming it: the worker, its executions)."""
    prefix, name = rq_prefix(), queue.encode()
    jobs = {key.split(b":job:", 1)[1] for key in r.scan_iter(f"{prefix}:job:*", _type="hash")
            if r.hget(key, "origin") == name}
    workers = {key.split(b":worker:", 1)[1] for key in r.scan_iter(f"{prefix}:worker:*", _type="hash")
               if name in (r.hget(key, "queues") or b"").split(b",")}
    tokens = {name, *jobs, *workers}
    ours = {key for key in r.scan_iter(f"{prefix}:*") if any(token in key for token in tokens)}
    shared = {}
    for key in (f"{prefix}:queues", f"{prefix}:workers"):
        if members := {m for m in r.smembers(key) if any(token in m for token in tokens)}:
            shared[key.encode()] = members
    return ours, shared


def remove_rq_keys(redis_url: str, queue: str) -> None:
    """Delete every key of ``queue`` (``rq_keys_of``) once nothing works on it any more; fail if any is left."""
    r = redis.Redis.from_url(redis_url)
    try:
        ours, shared = rq_keys_of(r, queue)
        if ours:
            r.delete(*ours)
        for key, members in shared.items():
            r.srem(key, *members)
        # RQ's lock while a worker cleans job groups (none here): the tests' workers set it, as no other RQ
        # worker uses the test Redis; it expires by itself, but minutes after the run
        r.delete(f"{rq_prefix()}:clean_groups")
        assert rq_keys_of(r, queue) == (set(), {}), f"RQ keys of queue {queue} left behind"
    finally:
        r.close()
