"""The ``Transport`` of a worker of a sharded Redis Cluster fleet (``--shards`` > 1, common/keys.py): one
``StreamConsumer`` per shard, all on one cluster client, behind one transport.

Each shard is a whole set of request streams, inboxes and markers under one hash tag, so every script still
touches one slot. Entries carry their shard (``Entry.shard``); whatever settles an entry goes to its shard.
A client's inbox, cancel and done markers live on its home shard (``Keys.home_shard``), which need not be
the shard its request was queued on: such a reply is written on the home shard first (first writer wins,
by the ``done`` marker there) and its entry acked on its own shard after. A worker killed between the two
leaves the entry pending: it is redelivered, re-run, its answer found written already (not written
twice), and only then acked. Dead letters stay on the entry's shard.

Reading: a sweep asks one shard after the other (starting after the last that had entries, so none starves)
without blocking; nothing there, the shards' waiter threads block (worker/transport/shard_waiters.py).

Its named parts (worker/transport/base.py) route each call to the shards' own parts: ``ShardedSettler``,
``ShardedPending``, ``ShardedPresence``, ``ShardedCancels``; the flush counter is shard 0's.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable
from typing import TypeVar

import redis

from batchfleet.common.config import ConnectionConfig
from batchfleet.common.keys import Keys
from batchfleet.common.redis.retry import TRANSIENT
from batchfleet.common.wire.priority import PRIORITIES
from batchfleet.common.wire.protocol import FleetInfo
from batchfleet.worker.transport.base import Cancel, Cancelling, Entry, Leases, Membership, Reply, Settling, Transport
from batchfleet.worker.transport.consumer import StreamConsumer, connect
from batchfleet.worker.transport.refused import refused as _refused
from batchfleet.worker.transport.shard_waiters import Waiters

log = logging.getLogger(__name__)

T = TypeVar("T", Entry, Reply)


def redis_transport(conn: ConnectionConfig, keys: Keys, buckets: tuple[int, ...], name: str, reply_ttl_s: int,
                    claim_idle_ms: int = 30_000, tenant_idle_s: float = 300.0) -> Transport:
    """The worker's Redis transport for the fleet layout ``keys`` (shard 0 of it); ``tenant_idle_s``: how long a
    named tenant's streams stay empty before it is retired (worker/transport/tenant_gc.py)."""
    if keys.shards == 1:
        return StreamConsumer(conn, buckets, name, reply_ttl_s, keys=keys, tenant_idle_s=tenant_idle_s)
    return ShardedConsumer(conn, keys, buckets, name, reply_ttl_s, claim_idle_ms, tenant_idle_s)


class ShardedConsumer(Transport):
    """One ``StreamConsumer`` per shard behind the ``Transport`` interface (module docstring)."""

    def __init__(self, conn: ConnectionConfig, keys: Keys, buckets: tuple[int, ...], name: str,
                 reply_ttl_s: int, claim_idle_ms: int = 30_000, tenant_idle_s: float = 300.0) -> None:
        self.keys = keys  # shard 0: every key of the fleet as a whole lives there
        self.name = name
        self.claim_idle_ms = claim_idle_ms  # how idle a released entry is made (any reclaim takes it at once)
        r = connect(conn)
        self.parts = [StreamConsumer(conn, buckets, name, reply_ttl_s, keys=k, r=r, tenant_idle_s=tenant_idle_s)
                      for k in keys.every_shard]
        for part in self.parts:  # a reply may be written on its inbox's shard: its cost goes to its entry's shard
            part.settler.served = self._served
        self.max_block_ms = self.parts[0].max_block_ms
        # one shard's fair share; none over several (each shard's counts only its own entries: tenants are then
        # ordered by deadline, then arrival, as without tenants)
        self.admission_order = self.parts[0].admission_order if len(self.parts) == 1 else None
        self._next = 0  # the shard the next sweep starts with
        self._quiet = False  # the last read waited and found nothing
        self.waiters = Waiters(self.parts)
        self.stopping = False
        self.settler = ShardedSettler(self.parts, keys)
        self.pending = ShardedPending(self.parts, self.waiters)
        self.presence = ShardedPresence(self.parts, self.waiters, self.pending, claim_idle_ms)
        self.cancel_watch = ShardedCancels(self.parts, keys)
        self.flush = self.parts[0].flush

    def _served(self, replies: list[Reply]) -> None:
        """Replies written first: each to the fair share of its entry's shard (worker/transport/fair_share.py)."""
        for shard, group in by_shard(replies).items():
            self.parts[shard].reader.served(group)

    def _each(self, call: Callable[[StreamConsumer], object]) -> None:
        for part in self.parts:
            call(part)

    # ---- joining -------------------------------------------------------------------------------------
    def setup(self) -> None:
        self._each(StreamConsumer.setup)
        self.waiters.start()

    def recover(self) -> None:
        self._each(StreamConsumer.recover)

    def ping(self) -> None:
        self.parts[0].r.ping()  # the one client every shard shares

    # ---- reading -------------------------------------------------------------------------------------
    @_refused
    def read(self, count: int | dict[str, int], block_ms: int | None, exact: bool = True) -> list[Entry]:
        """What the waiters read, else one sweep over the shards, else (``block_ms``) wait for the waiters to
        read something (``exact`` needs no polling here: the wait is on a local condition)."""
        counts = dict.fromkeys(PRIORITIES, count) if isinstance(count, int) else count
        # every shard's tenants followed (and retired) on time, also while an idle worker's reads are the waiters'
        self._each(StreamConsumer.follow_tenants)
        # right after a wait that found nothing, a blocking read skips the sweep (an idle worker's cycle is
        # the waiters' reads alone): an armed waiter's XREADGROUP ">" returns whatever arrived meanwhile
        quiet, self._quiet = self._quiet and not self.waiters.failing, False
        out = self.waiters.take() or ([] if quiet and block_ms is not None else self._sweep(counts))
        if out or block_ms is None or not any(counts.values()):
            return out
        out = self.waiters.wait(counts, max(1, min(int(block_ms), self.max_block_ms)) / 1000)
        # a wait a ring ended is no quiet one: the next sweep reads the tenants' set and the new tenant's streams
        self._quiet = not out and not any(p.reader.rang.is_set() for p in self.parts)
        return out

    def _sweep(self, counts: dict[str, int]) -> list[Entry]:
        n = len(self.parts)
        for i in range(n):
            shard = (self._next + i) % n
            got = self.parts[shard].read(counts, None)
            if got:
                self._next = (shard + 1) % n
                return [dataclasses.replace(e, shard=shard) for e in got]
        return []

    def log_batch(self, record: dict) -> None:
        self.parts[0].log_batch(record)

    def close(self) -> None:
        """Stop the waiters (each within one blocking read), release what they read that the loop never took,
        then leave every shard. A second call does nothing."""
        if self.stopping:
            return
        self.stopping = True
        stopped = self.waiters.stop()
        left = self.waiters.take()
        if left:  # released, not re-added: they stay pending on us, so our consumer name is kept too
            try:
                self.pending.release(left, self.claim_idle_ms, count_delivery=False)
            except (*TRANSIENT, redis.RedisError) as exc:  # their leases lapse: another worker reclaims them
                log.warning("could not release %d entries: %r", len(left), exc)
        if not stopped:  # one may still read an entry: keep our consumer names
            log.warning("a shard waiter did not stop; leaving without dropping this consumer's names")
            return
        self._each(lambda p: p.close(disconnect=False))
        self.parts[0].r.close()  # the one client they share


def by_shard(items: Iterable[T]) -> dict[int, list[T]]:
    """``items`` grouped by the shard of their stream."""
    out: dict[int, list[T]] = {}
    for item in items:
        out.setdefault(item.shard, []).append(item)
    return out


class ShardedSettler(Settling):
    """Each settling write on the entry's shard; a reply on its inbox's home shard first (module docstring)."""

    def __init__(self, parts: list[StreamConsumer], keys: Keys) -> None:
        self.parts = parts
        self.keys = keys

    def write_replies(self, replies: list[Reply]) -> list[bool]:
        """Replies on their entries' shard where the inbox is there too (one round trip settles both); the
        others on their inbox's shard first, their entries acked on their own shard after."""
        first = [False] * len(replies)
        groups: dict[tuple[int, bool], list[int]] = {}
        for i, rep in enumerate(replies):
            home = self._home(rep)
            groups.setdefault((home, home != rep.shard), []).append(i)
        for (home, moved), idx in groups.items():
            batch = [dataclasses.replace(replies[i], entry_id="") if moved else replies[i] for i in idx]
            for i, ok in zip(idx, self.parts[home].settler.write_replies(batch)):
                first[i] = ok
        for shard, entries in by_shard(r.settles for (_, moved), idx in groups.items() if moved
                                       for r in (replies[i] for i in idx)).items():
            self.parts[shard].settler.ack_all(entries)
        return first

    def _home(self, rep: Reply) -> int:
        home = self.keys.shard_of(rep.reply_key)
        return rep.shard if home is None else home

    def write_deltas(self, deltas: list[tuple[str, str, bytes]]) -> None:
        self.parts[0].settler.write_deltas(deltas)  # plain XADDs: the cluster client sends each to its key's master

    def give_up(self, entry: Entry, reason: str, reply: Reply | None) -> None:
        if reply is not None and self._home(reply) != entry.shard:
            self.parts[self._home(reply)].settler.write_replies([dataclasses.replace(reply, entry_id="")])
            reply = None
        self.parts[entry.shard].settler.give_up(entry, reason, reply)

    def ack(self, entry: Entry) -> None:
        self.parts[entry.shard].settler.ack(entry)

    def answered(self, entry: Entry, job_id: str, reply_key: str) -> None:
        home = self.keys.shard_of(reply_key)
        if home is None or home == entry.shard:
            self.parts[entry.shard].settler.answered(entry, job_id, reply_key)
            return
        self.parts[home].settler.answered(None, job_id, reply_key)  # the ring first, the ack after
        self.parts[entry.shard].settler.ack(entry)

    def hand_back(self, entries: list[Entry]) -> None:
        for shard, mine in by_shard(entries).items():
            self.parts[shard].settler.hand_back(mine)


class ShardedPending(Leases):
    """Each shard's pending list, for the entries of that shard."""

    def __init__(self, parts: list[StreamConsumer], waiters: Waiters) -> None:
        self.parts = parts
        self.waiters = waiters

    def reclaim(self, min_idle_ms: int, budget: int) -> list[Entry]:
        """Every shard's lapsed leases, within ``budget``; an entry reclaimed here is no longer also offered by
        the waiters (the loop would take it twice, and ack the running copy as a duplicate)."""
        out: list[Entry] = []
        for shard, part in enumerate(self.parts):
            if budget - len(out) <= 0:
                break
            out += [dataclasses.replace(e, shard=shard) for e in part.pending.reclaim(min_idle_ms, budget - len(out))]
        if out:
            self.waiters.drop({e.where for e in out})
        return out

    def release(self, entries: list[Entry], idle_ms: int, count_delivery: bool = True) -> None:
        for shard, mine in by_shard(entries).items():
            self.parts[shard].pending.release(mine, idle_ms, count_delivery)

    def refresh(self, entries: list[Entry], min_idle_ms: int) -> None:
        for shard, mine in by_shard(entries).items():
            self.parts[shard].pending.refresh(mine, min_idle_ms)

    def prune_consumers(self, min_idle_ms: int) -> int:
        return sum(part.pending.prune_consumers(min_idle_ms) for part in self.parts)


class ShardedPresence(Membership):
    """Membership on every shard (each has its live-worker set); clock and peers as shard 0 sees them."""

    def __init__(self, parts: list[StreamConsumer], waiters: Waiters, pending: ShardedPending,
                 claim_idle_ms: int) -> None:
        self.parts = parts
        self.waiters = waiters
        self.pending = pending
        self.claim_idle_ms = claim_idle_ms

    def join(self, info: FleetInfo, replace: bool = False) -> None:
        for part in self.parts:
            part.presence.join(info, replace)

    def heartbeat(self, status: dict) -> None:
        for part in self.parts:
            part.presence.heartbeat(status)

    def alive(self) -> None:
        """Every shard's live-worker set; and (the lease keeper calls this every few seconds) the entries the
        waiters read that the loop has not taken: renewed, or released once late (worker/transport/shard_waiters.py)."""
        for part in self.parts:
            part.presence.alive()
        late, kept = self.waiters.age()
        if late:
            self.pending.release(late, self.claim_idle_ms, count_delivery=False)
        if kept:
            self.pending.refresh(kept, 0)

    def clock_offset(self) -> float:
        return self.parts[0].presence.clock_offset()

    def live_peers(self) -> int:
        return self.parts[0].presence.live_peers()


class ShardedCancels(Cancelling):
    """The cancels stream of every shard; each job's markers on its inbox's shard."""

    def __init__(self, parts: list[StreamConsumer], keys: Keys) -> None:
        self.parts = parts
        self.keys = keys

    def cancels(self, waiting: bool = False) -> list[Cancel]:
        return [c for part in self.parts for c in part.cancel_watch.cancels(waiting)]

    def marks(self, job_ids: list[str], reply_keys: list[str | None]) -> list[tuple[str | None, bool]]:
        """A job's markers are on its inbox's shard (the client writes its cancels there, the reply writes its
        ``done`` marker there): each shard is asked about its own jobs. A cancel from another inbox would be
        elsewhere, but it is never honoured anyway; an entry without a valid reply key is rejected unread."""
        out: list[tuple[str | None, bool]] = [(None, False)] * len(job_ids)
        by_home: dict[int, list[int]] = {}
        for i, key in enumerate(reply_keys):
            home = self.keys.shard_of(key) if key is not None else None
            if home is not None:
                by_home.setdefault(home, []).append(i)
        for home, idx in by_home.items():
            got = self.parts[home].cancel_watch.marks([job_ids[i] for i in idx], [reply_keys[i] for i in idx])
            for i, mark in zip(idx, got):
                out[i] = mark
        return out
