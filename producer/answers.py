"""Final replies stored apart from the inbox stream (docs/PROTOCOL.md, "Replies").

A worker stores a job's final reply under ``Keys.done`` (``SET NX``: the first writer wins, with no script)
and rings for it with an inbox entry ``{id, done}``; several workers may ring for one job (a copy reclaimed
from one that died after answering rings again). The inbox reader fetches the answers of one read's rings
with one ``MGET`` and empties each (``SET "" XX KEEPTTL``: the empty answer keeps ruling out a second one
until it expires) before the caller's call returns it (``empty``; a bulk run's in the round trip that deletes
its ring, once its line is written): a client killed at any instant before that finds the answer again, and
one killed after it finds it taken (a later process of the inbox that submits the id again is refused). An
answer expires after the reply TTL, its ring with the inbox (whose TTL every write renews): a ring may outlive
its answer.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from batchfleet.common.keys import Keys
from batchfleet.common.redis.clients import same_node

Fields = dict[bytes, Any]


# the error of a waiter that reads a ring of an answer taken already: its request reused the id of a job answered
# into this inbox within the reply TTL (the taken answer rules out another until it expires), so none can come
REUSED = "this job id was answered in this inbox within the reply TTL already: submit under a new job id"
MAX_HANDED = 200_000  # answers handed over whose ring is not deleted yet; the oldest marks go beyond it


class Answers:
    """The answers rung for in one inbox: fetched per read, emptied with their rings' deletion. An answer is handed
    over once: its first ring read with the answer stored owns it (is dispatched, and empties it once deleted);
    another ring of it (a second writer's, or a copy's) reads as taken, so the caller never gets it twice, not
    even while the owner's deletion is still on its way or waits for a bulk run's line to be written."""

    def __init__(self) -> None:
        self._keys: dict[str, str] = {}  # owning ring entry id -> the answer's key, until the ring is deleted
        self._owner: OrderedDict[str, str] = OrderedDict()  # answer key -> its owning ring, until emptied and seen so
        self._emptied: list[str] = []  # answer keys emptied since the last fetch

    async def fetch(self, r: Any, inbox: str, entries: list[tuple[str, Fields]]) -> dict[str, bytes | None]:
        """Ring entry id -> its stored answer (None: expired; b"": taken already, or handed over by another
        ring) for every ring among ``entries``, with one MGET on ``r`` (every answer shares the inbox's slot)."""
        for key in self._emptied:  # emptied before this MGET is sent: Redis itself says b"" from now on
            self._owner.pop(key, None)
        self._emptied.clear()
        rings = [(entry_id, Keys.done(raw.decode(errors="replace"), inbox)) for entry_id, fields in entries
                 if b"done" in fields and isinstance(raw := fields.get(b"id", b""), bytes)]
        if not rings:
            return {}
        values = await r.execute_command("MGET", *(key for _, key in rings), **same_node(r, inbox))
        out: dict[str, bytes | None] = {}
        for (entry_id, key), value in zip(rings, values):
            if self._owner.setdefault(key, entry_id) != entry_id:
                out[entry_id] = b""  # another ring of an answer handed over: deleted alone, the answer kept
                continue
            out[entry_id] = value
            if value:
                self._keys[entry_id] = key
            else:
                del self._owner[key]  # nothing to hand over
        while len(self._owner) > MAX_HANDED:
            self._keys.pop(self._owner.popitem(last=False)[1], None)
        return out

    def forget(self, entry_id: str) -> None:
        """A ring whose answer was handed over and will never be deleted by this inbox (dropped from memory)."""
        key = self._keys.pop(entry_id, None)
        if key is not None:
            self._owner.pop(key, None)

    async def empty(self, r: Any, entry_id: str) -> None:
        """Empty the answer rung for by ``entry_id`` (``SET "" XX KEEPTTL``), its ring left for ``delete``: the
        record, in Redis, that the answer was handed over. Raises what Redis raises (nothing changes then)."""
        key = self._keys.get(entry_id)
        if key is None:  # no stored answer (not a ring, or emptied already)
            return
        await r.set(key, b"", xx=True, keepttl=True)
        if self._keys.pop(entry_id, None) is not None:
            self._emptied.append(key)

    async def delete(self, r: Any, inbox: str, ids: list[str]) -> None:
        """XDEL ``ids`` from the inbox, first emptying the answers rung for by those that are rings and not
        emptied yet. Raises what Redis raises; the answers stay to be emptied by a retry."""
        answers = {i: key for i in ids if (key := self._keys.get(i)) is not None}
        if not answers:
            await r.xdel(inbox, *ids)
            return
        async with r.pipeline(transaction=False) as pipe:
            # the rings first: a crash in between leaves an answer stored with no ring, which a resumed bulk run
            # reads as answered and not collected (producer/bulk/runner.py), never a ring for an emptied answer
            pipe.xdel(inbox, *ids)
            for key in answers.values():  # XX: an answer that expired meanwhile is not written again
                pipe.set(key, b"", xx=True, keepttl=True)
            await pipe.execute()
        for i, key in answers.items():
            if self._keys.pop(i, None) is not None:
                self._emptied.append(key)


def job_id_of(fields: Fields) -> str:
    """The job id an inbox entry names (its ``id`` field)."""
    raw = fields.get(b"id", b"")
    return raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
