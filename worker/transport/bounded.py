"""Reading stream entries with bounded worker memory, whatever size a producer gave them.

Enqueue caps payloads (common/redis/functions.py), but a producer with raw ``XADD`` access can add entries of
any size (up to Redis' own limits: 512 MB per field, millions of fields). A worker reads with plain
``XREADGROUP COUNT n`` (one Redis command per distinct count, pipelined), and its client parses every reply
under a guard (worker/transport/reply_guard.py): each bulk string is charged its length from its ``$<len>`` header
before its body is read, each element at least 64 bytes, and a reply (or a pipeline's replies together)
past ``REPLY_LIMIT_BYTES`` raises ``ReplyTooLarge``: the connection is dropped with the rest of the reply
unread. What a read returns whole is then cut down (``shrink``): an entry over ``MAX_ENTRY_BYTES`` or
``MAX_FIELDS`` keeps ``KEEP_FIELDS`` fields of ``KEEP_BYTES`` each, with its real size (``oversize``), so the
worker answers it (``invalid_request``) or dead-letters it without holding it.

A read the guard cut off still delivered its entries in Redis: they are pending on this consumer, never
seen. They are recovered at once (``RECOVER``, worker/transport/scripts.py): the entries pending on us above the
largest id we were handed in each stream before that read (worker/transport/delivered.py says why those are exactly
the unseen ones), one at a time inside Redis, cut down there as the reclaim script does, until
``READ_BUDGET_BYTES`` returned or ``SCAN_BUDGET_BYTES`` looked at (the script's own Lua heap); the rest come
with the next reads, before anything new. A read that fails midway (a lost connection) is recovered the same
way. The blocking read (``wait``) is guarded and recovered the same way.

So a worker holds at most, per read: ``REPLY_LIMIT_BYTES`` of reply (about three copies of it for a moment:
the socket buffer, the parsed objects, the cut-down entries), or ``READ_BUDGET_BYTES`` + one
``MAX_ENTRY_BYTES`` entry from a recovery; on top of the requests it keeps (each <= ``MAX_ENTRY_BYTES``).
Redis itself builds a too-large reply whole in its output buffer until the connection drops.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping
from typing import Any

import redis

from batchfleet.common.keys import Keys
from batchfleet.common.redis.clients import xread, xread_args
from batchfleet.common.wire.priority import PRIORITIES
from batchfleet.common.wire.protocol import MAX_PAYLOAD_BYTES
from batchfleet.worker.transport.base import Entry
from batchfleet.worker.transport.delivered import Delivered
from batchfleet.worker.transport.fair_share import FairShare
from batchfleet.worker.transport.reply_guard import ELEMENT_BYTES, ReplyTooLarge, guard, one_budget
from batchfleet.worker.transport.scripts import WorkerScripts
from batchfleet.worker.transport.tenant_gc import bell_gone, gone

MAX_ENTRY_BYTES = MAX_PAYLOAD_BYTES + 64 * 1024  # payload + id, reply key and field names, with room to spare
MAX_FIELDS = 32  # names + values (16 pairs); a request has 3 pairs
KEEP_FIELDS = 32  # names + values kept of a too-large entry (16 pairs, as the dead-letter copy keeps)
KEEP_BYTES = 4096
READ_BUDGET_BYTES = 4 << 20  # whole entries returned by one script call
SCAN_BUDGET_BYTES = 64 << 20  # raw entry bytes one script call looks at (its Lua heap)
# the most one reply on the worker's client may take (or a read's replies together): a script's budget, the
# entry that crosses it, and room for the 64-byte charge per element (a reclaim of small entries)
BELL_DRAIN = 100  # rings of the tenant bell a ring heard takes with it (``BoundedReader._answer_rings``)
REPLY_LIMIT_BYTES = READ_BUDGET_BYTES + MAX_ENTRY_BYTES + (1 << 20)

GUARDED = guard(REPLY_LIMIT_BYTES)  # what the worker's client wraps its connections in (worker/transport/consumer.py)

LIMIT_ARGS = (MAX_ENTRY_BYTES, MAX_FIELDS, KEEP_FIELDS, KEEP_BYTES, READ_BUDGET_BYTES, SCAN_BUDGET_BYTES)


def as_str(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def fields_dict(flat: list) -> dict[bytes, bytes]:
    """A script's flat [name, value, ...] list as the dict redis-py gives for XREADGROUP (last name wins)."""
    return {flat[i]: flat[i + 1] for i in range(0, len(flat) - 1, 2)}


def entry_of(bucket: int, priority: str, raw: list, tenant: str = "") -> Entry | None:
    """An Entry from a script's {id, fields or false, oversize[, deliveries]}; None for one deleted while pending."""
    entry_id, flat, oversize = raw[0], raw[1], int(raw[2] or 0)
    if not isinstance(flat, list):
        return None
    deliveries = int(raw[3]) if len(raw) > 3 else 1
    return Entry(bucket, as_str(entry_id), fields_dict(flat), deliveries, oversize=oversize, priority=priority,
                 tenant=tenant)


def shrink(entry: Entry) -> Entry:
    """Cut a too-large entry read whole down, as the scripts do: the caller drops the original right away, so
    the worker keeps nothing of its size."""
    flat = [x for kv in entry.fields.items() for x in kv]
    size = sum(len(x) for x in flat)
    if size <= MAX_ENTRY_BYTES and len(flat) <= MAX_FIELDS:
        return entry
    kept = fields_dict([bytes(x[:KEEP_BYTES]) for x in flat[:KEEP_FIELDS]])
    return dataclasses.replace(entry, fields=kept, oversize=max(size, 1))


def by_stream(resp: Any) -> list:
    """An XREADGROUP answer as (stream, entries) pairs: redis-py's RESP2 shape (also RESP3's unless the URL asks
    for ``protocol=3`` explicitly), or its RESP3 one, {stream: [entries]}."""
    if not isinstance(resp, dict):
        return resp or []
    return [(stream, parts[0] if len(parts) == 1 and isinstance(parts[0], list) else parts)
            for stream, parts in resp.items()]


class BoundedReader:
    """``XREADGROUP`` of a consumer over its request streams (every tenant's), guarded and recovered (module
    docstring); how much of each tenant's streams a read asks for is their fair share (``shares``, one per
    priority: worker/transport/fair_share.py)."""

    def __init__(self, r: Any, scripts: WorkerScripts, group: str, consumer: str, keys: Keys,
                 buckets: tuple[int, ...]) -> None:
        self.r = r
        self.group = group
        self.consumer = consumer
        self.keys = keys
        self.buckets = buckets
        self.shares = {priority: FairShare() for priority in PRIORITIES}
        self._shares_lock = threading.Lock()  # shard waiters read (and charge) on their own threads
        self.streams: list[tuple[str, int, str]] = []  # (stream, bucket, priority), most urgent first
        self.where: dict[str, tuple[int, str, str]] = {}  # stream -> (bucket, priority, tenant)
        self.tenants: tuple[str, ...] = ("",)
        self.set_tenants(())
        self._recover_script = scripts.recover
        # a cluster client pipelines by its own slot lookup (a round trip per command): one command at a time
        self._one_by_one = hasattr(r, "get_node_from_key")
        self.delivered = Delivered()  # this consumer's floors and owed recoveries (worker/transport/delivered.py)
        # the last read was a blocking one that found nothing: whatever is there now arrived since, and a
        # blocking XREADGROUP returns it at once, so the next read goes straight to the blocking read
        self._quiet = False
        # every read also takes the rings of the tenant bell (``Keys.tenant_bell``, same group): a tenant new to the
        # set rang; ``rang`` tells the transport to read the set now (set from shard waiters' threads too)
        self.bell = keys.tenant_bell
        self.rang = threading.Event()

    def set_tenants(self, named: tuple[str, ...] | list[str] | set[str]) -> bool:
        """Read the streams of the default tenant and of ``named`` (``Keys.queued_tenants``) from now on; True when
        that added streams."""
        tenants = ("", *sorted(t for t in set(named) if t))
        if tenants == self.tenants and self.streams:
            return False
        # ``where`` first: a shard waiter's thread (worker/transport/shard_waiters.py) may read with the new streams
        self.where = {self.keys.stream(b, priority, t): (b, priority, t)
                      for priority in PRIORITIES for t in tenants for b in self.buckets}
        self.streams = self.keys.streams(self.buckets, tenants)
        self.tenants = tenants
        return True

    def served(self, replies: list) -> None:
        """Replies written (``Reply``s of this shard's entries): their real cost corrects their tenants' charges."""
        with self._shares_lock:
            for rep in replies:
                tokens = getattr(rep.message, "prompt_tokens", 0) + getattr(rep.message, "completion_tokens", 0)
                self.shares[rep.priority].done(rep.tenant, int(tokens))

    def order(self, priority: str, waiting: Mapping[str, int], n: int) -> list[str]:
        """The tenants of the next ``n`` admissions of ``priority`` (``FairShare.order``)."""
        with self._shares_lock:
            return self.shares[priority].order(waiting, n)

    def _entry(self, key: str, entry_id: Any, fields: Any) -> Entry:
        bucket, priority, tenant = self.where[key]
        return shrink(Entry(bucket, as_str(entry_id), fields or {}, priority=priority, tenant=tenant))

    def read(self, counts: dict[str, int], block_ms: int | None) -> list[Entry]:
        """Up to ``counts[priority]`` new entries per stream of each priority (interactive streams first), and first
        what a cut-off read left owed. When there are none and ``block_ms`` is not None, waits for the first with a
        ``XREADGROUP COUNT 1`` over the streams of priorities with room and returns it: the rest come with the next
        call. Right after a blocking read that found nothing, goes straight to the blocking read (an idle
        worker's cycle is one command)."""
        wanted = [s for s, _, priority in self.streams if counts.get(priority, 0) > 0]
        quiet, self._quiet = self._quiet and not self.delivered.owes(), False
        out = [] if quiet and block_ms is not None and wanted else self.read_now(counts)
        if out or block_ms is None or not wanted:
            return out
        out = self.wait(counts, block_ms)
        # what else arrived meanwhile is the next read's: a lone request starts one round trip sooner, and the
        # next read is not blocking (the engine is busy then) or finds them at once
        self._quiet = not out
        return out

    def wait(self, counts: dict[str, int], block_ms: int, r: Any = None) -> list[Entry]:
        """The blocking read alone: the first entry to arrive in a stream of a priority with room (``COUNT 1`` per
        stream); ``r``: the client to block on (default this reader's)."""
        wanted = [s for s, _, priority in self.streams if counts.get(priority, 0) > 0]
        return self._read(r or self.r, [(1, [*wanted, self.bell])], block_ms) if wanted else []

    def read_now(self, counts: dict[str, int]) -> list[Entry]:
        """Up to ``counts[priority]`` new entries per stream, without blocking; too-large entries come cut short. While
        a cut-off read's entries are owed, only those (its priorities had room for them when it read)."""
        if self.delivered.owes():
            return self.recover_owed()
        plan: dict[int, list[str]] = {}
        with self._shares_lock:
            shares = {priority: self.shares[priority].plan(n, self.tenants) for priority, n in counts.items() if n > 0}
        for stream, _, priority in self.streams:
            if (n := shares.get(priority, {}).get(self.where[stream][2], 0)) > 0:
                plan.setdefault(n, []).append(stream)
        if not plan:
            return []
        plan[min(plan)].append(self.bell)  # a busy worker hears the bell too: no extra command
        return self._read(self.r, list(plan.items()), None)

    def held(self, entries: list[Entry]) -> list[Entry]:
        """``entries`` taken another way (a reclaim), noted as handed over (never recovered as unseen)."""
        self.delivered.held([(self.keys.stream(*e.stream_of), e) for e in entries])
        return entries

    def _read(self, r: Any, plan: list[tuple[int, list[str]]], block_ms: int | None) -> list[Entry]:
        """``XREADGROUP >`` of each (count, streams) in ``plan`` under one reply budget; on a trip, the recovery.
        The bell's rings (``plan`` may name it) are deleted, never handed over: ``rang`` is set."""
        token, since = self.delivered.begin([s for _, streams in plan for s in streams if s != self.bell])
        tripped = False
        rings: list[str] = []
        try:
            with one_budget(REPLY_LIMIT_BYTES):
                replies = self._xreadgroup(r, plan, block_ms)
            got: dict[str, list[Entry]] = {}
            for resp in replies:
                for stream, entries in by_stream(resp):
                    key = as_str(stream)
                    if key == self.bell:
                        rings += [as_str(eid) for eid, _ in entries]
                    else:
                        got[key] = [self._entry(key, eid, fields) for eid, fields in entries]
            del replies  # the raw (maybe large) entries go now, not at the end of the call
        except ReplyTooLarge:
            tripped = True  # handled below, once this frame no longer holds the partial reply
        except BaseException as exc:
            self._failed(since, exc, several=len(plan) > 1)
            self.delivered.end(token, [])
            raise
        if rings:
            try:
                self._answer_rings(r, rings)
            except redis.RedisError:  # the entries read are this read's all the same (the next prune acks the rings)
                self.rang.set()
        if tripped:  # (a ring the cut-off read delivered unseen stays pending: the next prune acks it)
            self.delivered.owe(since)
            self.delivered.end(token, [])
            return self.recover_owed()
        self._charge(plan, got)
        return self.delivered.end(token, [(s, e) for s, _, _ in self.streams for e in got.get(s, ())])

    def _answer_rings(self, r: Any, rings: list[str]) -> None:
        """Delete the rings read (acked: nothing to reclaim) and have the transport read the tenants' set. The look
        that follows covers every ring added so far, so up to ``BELL_DRAIN`` more are taken and deleted with them
        (the same round trip, a second one when there were): a read takes one ring at a time, and a burst of new
        tenants otherwise costs a look at the whole set, and a read of every stream, per ring (40 s of them after
        1000 new tenants). The fleet's other workers still hear the rest, or the set at their next look."""
        self.rang.set()
        pipe = r.pipeline(transaction=False)
        pipe.xack(self.bell, self.group, *rings)
        pipe.xdel(self.bell, *rings)
        if self._one_by_one:  # a cluster client: the read on its own (``_xreadgroup``)
            pipe.execute()
            more = xread(r, {self.bell: ">"}, BELL_DRAIN, None, (self.group, self.consumer))
        else:
            pipe.execute_command(*xread_args({self.bell: ">"}, BELL_DRAIN, None, (self.group, self.consumer)))
            more = pipe.execute()[2]
        rings = [as_str(eid) for _, entries in by_stream(more) for eid, _ in entries]
        if rings:
            pipe = r.pipeline(transaction=False)
            pipe.xack(self.bell, self.group, *rings)
            pipe.xdel(self.bell, *rings)
            pipe.execute()

    def _charge(self, plan: list[tuple[int, list[str]]], got: dict[str, list[Entry]]) -> None:
        """Tell each tenant's share what a read gave: how many, and whether one of its streams came back full."""
        seen: dict[tuple[str, str], list[int]] = {}  # (priority, tenant) -> [entries, full]
        for n, streams in plan:
            for s in streams:
                if s == self.bell:
                    continue
                _, priority, tenant = self.where[s]
                k = len(got.get(s, ()))
                row = seen.setdefault((priority, tenant), [0, 0])
                row[0] += k
                row[1] |= k >= n
        with self._shares_lock:
            for (priority, tenant), (k, full) in seen.items():
                self.shares[priority].got(tenant, k, bool(full))

    def _xreadgroup(self, r: Any, plan: list[tuple[int, list[str]]], block_ms: int | None) -> list:
        if len(plan) == 1 or self._one_by_one:
            return [xread(r, dict.fromkeys(streams, ">"), n, block_ms, (self.group, self.consumer))
                    for n, streams in plan]
        pipe = r.pipeline(transaction=False)
        for n, streams in plan:
            pipe.execute_command(*xread_args(dict.fromkeys(streams, ">"), n, block_ms, (self.group, self.consumer)))
        return pipe.execute()

    def _failed(self, since: dict[str, str], exc: BaseException, several: bool = False) -> None:
        """A read whose connection failed after it was sent may have delivered entries nobody saw: owed
        (recovered once Redis answers again). Lost streams (NOGROUP) make every id we were handed meaningless,
        unless the stream is a retired tenant's (``gone``): a refused command delivered nothing, but a read of
        ``several`` commands may have delivered entries with the others, owed as after a lost connection (the
        recovery passes over streams no longer there). The bell without its group (``bell_gone``) is the same: the
        request streams kept theirs."""
        if gone(exc) or bell_gone(exc, self.bell):
            if several:
                self.delivered.owe(since)
        elif isinstance(exc, redis.ResponseError) and "NOGROUP" in str(exc):
            self.delivered.reset()
        elif isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):
            self.delivered.owe(since)

    def recover_owed(self) -> list[Entry]:
        """What cut-off reads left owed, within one script call's budgets (the rest stays owed), cut down inside
        Redis; each entry handed over once (worker/transport/delivered.py)."""
        token, owed = self.delivered.take_owed()
        keys = [s for s, _, _ in self.streams if s in owed]
        try:
            resp = self._recover_script(keys=keys, args=[self.group, self.consumer, *LIMIT_ARGS, ELEMENT_BYTES,
                                                         *(owed[k] for k in keys)])
        except BaseException as exc:
            if gone(exc) or not (isinstance(exc, redis.ResponseError) and "NOGROUP" in str(exc)):
                self.delivered.owe(owed)  # still owed: the next read tries again
            self._failed({}, exc)
            self.delivered.end(token, [])
            raise
        got: list[tuple[str, Entry]] = []
        left: dict[str, str] = {}
        for key, (cursor, raws, done) in zip(keys, resp):
            bucket, priority, tenant = self.where[key]
            got += [(key, e) for raw in raws if (e := entry_of(bucket, priority, raw, tenant)) is not None]
            if not int(done):
                left[key] = as_str(cursor)
        self.delivered.owe(left)
        return self.delivered.end(token, got)


def autoclaim_args(group: str, consumer: str, min_idle_ms: int, count: int) -> list:
    """The AUTOCLAIM script's args before the per-stream cursors (worker/transport/scripts.py)."""
    return [group, consumer, min_idle_ms, count, *LIMIT_ARGS]
