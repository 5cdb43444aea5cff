"""Final replies stored apart from the inbox stream (docs/PROTOCOL.md, "Replies").

A worker stores a job's final reply under ``Keys.done`` (``SET NX``: the first writer wins, with no script)
and rings for it with an inbox entry ``{id, done}``; several workers may ring for one job (a copy reclaimed
from one that died after answering rings again). The inbox reader fetches the answers of one read's rings
with one ``MGET`` and empties each (``SET "" XX KEEPTTL``: the empty answer keeps ruling out a second one
until it expires) in the round trip that deletes its ring, once the caller has taken it: a client killed at
any instant before that finds the answer again. An answer expires after the reply TTL, its ring with the
inbox (whose TTL every write renews): a ring may outlive its answer.
"""

from __future__ import annotations

from typing import Any

from batchfleet.common.keys import Keys
from batchfleet.common.redis_conn import same_node

Fields = dict[bytes, Any]


class Answers:
    """The answers rung for in one inbox: fetched per read, emptied with their rings' deletion."""

    def __init__(self) -> None:
        self._keys: dict[str, str] = {}  # ring entry id -> the answer's key, until the ring is deleted

    async def fetch(self, r: Any, inbox: str, entries: list[tuple[str, Fields]]) -> dict[str, bytes | None]:
        """Ring entry id -> its stored answer (None: expired; b"": taken already) for every ring among
        ``entries``, with one MGET on ``r`` (every answer shares the inbox's slot)."""
        rings = [(entry_id, Keys.done(raw.decode(errors="replace"), inbox)) for entry_id, fields in entries
                 if b"done" in fields and isinstance(raw := fields.get(b"id", b""), bytes)]
        if not rings:
            return {}
        values = await r.execute_command("MGET", *(key for _, key in rings), **same_node(r, inbox))
        self._keys.update(rings)
        return {entry_id: value for (entry_id, _), value in zip(rings, values)}

    async def delete(self, r: Any, inbox: str, ids: list[str]) -> None:
        """XDEL ``ids`` from the inbox, first emptying the answers rung for by those that are rings."""
        answers = [key for i in ids if (key := self._keys.pop(i, None)) is not None]
        if not answers:
            await r.xdel(inbox, *ids)
            return
        async with r.pipeline(transaction=False) as pipe:
            # the rings first: a crash in between leaves an answer stored with no ring, which a resumed bulk run
            # reads as answered and not collected (producer/bulk_jobs.py), never a ring for an emptied answer
            pipe.xdel(inbox, *ids)
            for key in answers:  # XX: an answer that expired meanwhile is not written again
                pipe.set(key, b"", xx=True, keepttl=True)
            await pipe.execute()
