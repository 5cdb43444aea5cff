"""The Batch API's lease (gateway/batches/store.py, the lease functions of common/redis/functions.py): one gateway runs
a batch at a time; only the lease's holder renews or releases it."""

from __future__ import annotations

import asyncio
import uuid

import redis

from batchfleet.common.keys import Keys
from batchfleet.common.redis.clients import async_client
from batchfleet.common.redis.functions import LEASE_FUNCTION_NAMES, load_library
from batchfleet.gateway.batches.store import BatchStore


def test_a_batch_lease_is_renewed_and_released_only_by_its_holder(any_redis_url):
    """The lease functions of common/redis/functions.py: FCALL where the library is loaded (Redis 7), the same
    bodies by EVALSHA on Redis 6.2; another token neither renews nor drops the lease."""
    sync = redis.Redis.from_url(any_redis_url)
    has_functions = load_library(sync)
    keys = Keys(f"t-{uuid.uuid4().hex[:10]}")
    batch_id = "batch_" + "0" * 24
    lease = keys.batch_lease(batch_id)

    async def run() -> None:
        r = async_client(any_redis_url)
        store = BatchStore(r, keys)
        try:
            assert await store.take_lease(batch_id, "mine", 60_000)
            assert not await store.take_lease(batch_id, "theirs", 60_000)
            assert not await store.renew_lease(batch_id, "theirs", 120_000)
            assert 0 < sync.pttl(lease) <= 60_000
            assert await store.renew_lease(batch_id, "mine", 120_000)
            assert 60_000 < sync.pttl(lease) <= 120_000
            await store.release_lease(batch_id, "theirs")
            assert sync.get(lease) == b"mine"
            await store.release_lease(batch_id, "mine")
            assert sync.get(lease) is None
            assert store.functions._fcall == has_functions  # FCALL on Redis 7; 6.2 fell back to EVALSHA
        finally:
            await r.aclose()

    try:
        asyncio.run(run())
        if has_functions:  # the library holds them under their documented names
            assert sync.fcall(LEASE_FUNCTION_NAMES["lease_renew"], 1, lease, "x", 1000) == 0
    finally:
        sync.delete(lease)
        sync.close()
