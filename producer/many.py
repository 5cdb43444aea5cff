"""``generate_many`` of the asyncio client (producer/aclient.py): all or nothing is sent, answers in order."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from batchfleet.common.wire.protocol import Result
from batchfleet.producer.ask import Ask
from batchfleet.producer.core import Deadline, Prompt
from batchfleet.producer.outgoing import Outgoing


async def generate_many(client: Any, prompts: Sequence[Prompt], deadline: Deadline, ask: Ask) -> list[Result]:
    """``client`` (an AsyncClient; not imported: it imports this) validates every prompt first (nothing is
    sent if one is bad), enqueues all, gathers in order; when one
    fails or the call is cancelled, nobody waits for the others (each is given up: cancelled, its answer
    dropped)."""
    fleet = await client._fleet_view(deadline)
    for prompt in prompts:  # raises before anything is sent
        fleet.build(client.keys, client.inbox.key, prompt, ask, None, None)
    jobs = await asyncio.gather(*(client._submit(x, deadline, None, False, ask) for x in prompts),
                                return_exceptions=True)
    failed = [j for j in jobs if isinstance(j, BaseException)]
    if failed:
        for j in jobs:
            if isinstance(j, Outgoing):
                client._give_up_later(j.id)
        raise failed[0]
    sent: list[Outgoing] = [j for j in jobs if isinstance(j, Outgoing)]  # all of them: none failed
    waits = [asyncio.ensure_future(client._result(j.id, deadline, give_up=True)) for j in sent]
    try:
        return list(await asyncio.gather(*waits))
    except BaseException:
        for w in waits:
            w.cancel()
        await asyncio.gather(*waits, return_exceptions=True)
        raise
