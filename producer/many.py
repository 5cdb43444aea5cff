"""``generate_many`` of the asyncio client (producer/aclient.py), and ``submit_many`` (the gateway's, for an
embeddings request's inputs): all or nothing is sent (every prompt validated first), the enqueues made at
once (concurrently, over the client's pool) rather than one round trip after another, answers in order."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from batchfleet.common.errors import InvalidRequest
from batchfleet.common.wire.protocol import Result
from batchfleet.producer.ask import Ask
from batchfleet.producer.core import Deadline, Prompt
from batchfleet.producer.outgoing import Outgoing


async def submit_many(client: Any, prompts: Sequence[Prompt], job_ids: Sequence[str] | None, deadline: Deadline,
                      ask: Ask) -> list[str]:
    """``client`` (an AsyncClient; not imported: it imports this) validates every prompt first (nothing is
    sent if one is bad), then enqueues all at once (``job_ids``: theirs, default new ones): their job ids,
    in order. When one is refused (QueueFull, NoWorkers...), the others enqueued are given up (cancelled,
    their answers dropped) and its error raised."""
    ids: Sequence[str | None] = [None] * len(prompts) if job_ids is None else job_ids
    if len(ids) != len(prompts):
        raise InvalidRequest(f"{len(ids)} job ids for {len(prompts)} prompts")
    fleet = await client._fleet_view(deadline)
    for prompt in prompts:  # raises before anything is sent (a long prompt tokenized on a worker thread)
        await client._build(fleet, prompt, ask, None, None, False)
    jobs = await asyncio.gather(*(client._submit(x, deadline, jid, False, ask) for x, jid in zip(prompts, ids)),
                                return_exceptions=True)
    failed = [j for j in jobs if isinstance(j, BaseException)]
    if failed:
        for j in jobs:
            if isinstance(j, Outgoing):
                client._give_up_later(j.id)
        raise failed[0]
    return [j.id for j in jobs if isinstance(j, Outgoing)]  # all of them: none failed


async def generate_many(client: Any, prompts: Sequence[Prompt], deadline: Deadline, ask: Ask) -> list[Result]:
    """``submit_many``, then the answers gathered in order; when one fails or the call is cancelled, nobody
    waits for the others (each is given up: cancelled, its answer dropped)."""
    submitted = await submit_many(client, prompts, None, deadline, ask)
    waits = [asyncio.ensure_future(client._result(j, deadline, give_up=True)) for j in submitted]
    try:
        return list(await asyncio.gather(*waits))
    except BaseException:
        for w in waits:
            w.cancel()
        await asyncio.gather(*waits, return_exceptions=True)
        raise
