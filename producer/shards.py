"""Which shard of a sharded cluster fleet (common/keys.py) a producer sends a request to: by backlog.

The backlog of a shard for one bucket and priority is its stream's length (a worker deletes an entry when it
answers it, so the length counts what is queued, held and running there), sampled with one ``XLEN`` per
shard at most every ``SAMPLE_S`` per stream, plus what this producer sent there since the sample. The
request goes to the producer's home shard (its inbox's) unless another is shorter by more than a slack
(a quarter, at least 2): a request on its inbox's shard is answered and settled by one script call, one on
another shard by two (worker/transport/sharded.py). Many producers spread by their homes; one busy producer spills
over to the other shards as its home's stream grows. No call at all on a fleet of one shard.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from batchfleet.common.keys import Keys
from batchfleet.common.wire.protocol import FleetInfo
from batchfleet.producer.inbox import Inbox
from batchfleet.producer.outgoing import Outgoing

SAMPLE_S = 0.5
SAMPLE_TIMEOUT_S = 1.0  # a sample that takes longer (a master failing over) gives way to the home shard
log = logging.getLogger("producer")


class ShardPicker:
    """Per (bucket, priority) stream: the last sampled lengths and what was sent since (owned by one event loop)."""

    def __init__(self, r) -> None:
        self.r = r
        self._seen: dict[tuple[int, str], tuple[float, list[int]]] = {}  # -> (sampled at, length + sent since)
        self._turn = 0  # ties among the shortest go round
        self._lock = asyncio.Lock()

    async def pick(self, keys: Keys, bucket: int, priority: str, home: int = 0) -> int:
        """The shard for one request of ``bucket`` and ``priority`` from a producer whose inbox is on ``home``."""
        if keys.shards == 1:
            return 0
        where = (bucket, priority)
        seen = self._seen.get(where)
        if seen is None or len(seen[1]) != keys.shards or time.monotonic() - seen[0] > SAMPLE_S:
            async with self._lock:
                seen = self._seen.get(where)
                if seen is None or len(seen[1]) != keys.shards or time.monotonic() - seen[0] > SAMPLE_S:
                    try:
                        lengths = await asyncio.wait_for(self._sample(keys, bucket, priority), SAMPLE_TIMEOUT_S)
                    except Exception as exc:  # noqa: BLE001 - a master out of reach: the home shard, for now
                        log.debug("shard backlog not sampled: %r", exc)
                        lengths = [0] * keys.shards
                    seen = (time.monotonic(), lengths)
                    self._seen[where] = seen
        backlog = seen[1]
        low = min(backlog)
        if backlog[home] <= low + max(2, low // 4):
            shard = home
        else:
            ties = [s for s, n in enumerate(backlog) if n == low]
            self._turn += 1
            shard = ties[self._turn % len(ties)]
        backlog[shard] += 1
        return shard

    async def _sample(self, keys: Keys, bucket: int, priority: str) -> list[int]:
        """Each shard's stream length (one pipeline: the cluster client sends one batch per master); a shard
        that could not be read counts as empty only if every one failed, else as the longest."""
        pipe = self.r.pipeline(transaction=False)
        for k in keys.every_shard:
            pipe.xlen(k.stream(bucket, priority))
        got = await pipe.execute(raise_on_error=False)
        lengths = [n if isinstance(n, int) else None for n in got]
        worst = max((n for n in lengths if n is not None), default=0)
        return [worst if n is None else n for n in lengths]


class Router:
    """A client's place in the fleet's layout: ``keys`` (shard 0: the fleet as a whole), ``home`` (the shard
    of its inbox and of its jobs' cancel and done markers), and the shard each request goes to. Both follow
    the fleet description's shard count (common/keys.py)."""

    def __init__(self, keys: Keys, token: str, r) -> None:
        self.keys = self.home = keys
        self.token = token
        self.picker = ShardPicker(r)

    def follow(self, info: FleetInfo | None, inbox: Inbox) -> None:
        """Take the fleet's shard count: the inbox moves to its home shard, unless it is read already (then it
        stays where it is: a worker answers into any shard of the fleet)."""
        if info is None or info.shards == self.keys.shards:
            return
        keys = self.keys.with_shards(info.shards)
        home = keys.of_shard(keys.home_shard(self.token))
        if not inbox.move(home.inbox(self.token)):
            home = keys.of_shard(keys.shard_of(inbox.key) or 0)
        self.keys, self.home = keys, home

    async def route(self, job: Outgoing) -> tuple[Outgoing, Keys]:
        """``job`` aimed at the stream of the shard picked for it, and that shard's keys."""
        shard = self.keys.of_shard(await self.picker.pick(self.keys, job.bucket, job.priority, self.home.shard))
        if not shard.shard:
            return job, shard
        return dataclasses.replace(job, stream=shard.stream(job.bucket, job.priority, job.tenant)), shard
