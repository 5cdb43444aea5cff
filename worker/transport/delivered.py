"""Which entries of its streams a consumer has been handed, so that a read the reply guard cut off can be
recovered (worker/transport/bounded.py) without handing any entry over twice.

A read that trips the guard (worker/transport/reply_guard.py) leaves what Redis delivered pending on this consumer,
never seen. In a stream, every id an ``XREADGROUP >`` delivers is above every id delivered before it (to any
consumer of the group), so the entries pending on us above the largest id we were ever handed there (the
stream's *floor*: by a read, a recovery, or a reclaim of entries delivered earlier) are exactly the unseen
ones. The floor before a read is where its recovery starts (``owe``).

A sharded worker reads a shard from two threads at once (the loop's sweep and that shard's waiter,
worker/transport/shard_waiters.py), so a recovery may also meet entries that another read, open at the same time, hands
over: each id handed over while a read or recovery that could return it again is open (or owed) is kept
(``_given``) and never handed over a second time. With one thread it stays empty.
"""

from __future__ import annotations

import threading

from batchfleet.worker.transport.base import Entry

ZERO = "0-0"


def id_key(entry_id: str) -> tuple[int, int]:
    """A stream id (``<ms>-<seq>``) as numbers, in the order Redis keeps them."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


class Delivered:
    """Floors, owed recoveries and recently given ids, per stream, for one consumer (module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._floor: dict[str, str] = {}  # stream -> largest id handed over
        self._owed: dict[str, str] = {}  # stream -> id above which entries pending on us were never seen
        self._open: dict[int, dict[str, str]] = {}  # reads in flight -> the id each of their recoveries starts at
        self._given: dict[str, set[str]] = {}  # ids handed over that an open or owed recovery could return
        self._tokens = 0

    def owes(self) -> bool:
        return bool(self._owed)

    def begin(self, streams: list[str]) -> tuple[int, dict[str, str]]:
        """A ``>`` read of ``streams`` starts: its token, and each stream's floor (where a recovery starts)."""
        with self._lock:
            return self._open_read({s: self._floor.get(s, ZERO) for s in streams})

    def take_owed(self) -> tuple[int, dict[str, str]]:
        """A recovery starts: its token, and what is owed ({stream: recover above this id}), now its own."""
        with self._lock:
            owed, self._owed = self._owed, {}
            return self._open_read(owed)

    def owe(self, since: dict[str, str]) -> None:
        """Entries pending on us above ``since`` (per stream) were never seen: the next read recovers them."""
        with self._lock:
            for stream, cursor in since.items():
                if stream not in self._owed or id_key(cursor) < id_key(self._owed[stream]):
                    self._owed[stream] = cursor

    def end(self, token: int, got: list[tuple[str, Entry]]) -> list[Entry]:
        """Read ``token`` is over with ``got`` ((stream, entry) pairs): the entries not handed over already,
        now handed over."""
        with self._lock:
            self._open.pop(token, None)
            fresh = [(s, e) for s, e in got if e.entry_id not in self._given.get(s, ())]
            self._hand_over(fresh)
            return [e for _, e in fresh]

    def held(self, got: list[tuple[str, Entry]]) -> None:
        """Entries taken another way (a reclaim): handed over, never to be recovered."""
        with self._lock:
            self._hand_over(got)

    def reset(self) -> None:
        """The streams were re-created (Redis lost them): no id handed over before means anything now."""
        with self._lock:
            self._floor.clear()
            self._owed.clear()
            self._given.clear()
            for since in self._open.values():
                since.clear()

    def _open_read(self, since: dict[str, str]) -> tuple[int, dict[str, str]]:
        self._tokens += 1
        self._open[self._tokens] = since
        return self._tokens, dict(since)

    def _hand_over(self, got: list[tuple[str, Entry]]) -> None:
        for stream, e in got:
            if stream not in self._floor or id_key(e.entry_id) > id_key(self._floor[stream]):
                self._floor[stream] = e.entry_id
        low: dict[str, tuple[int, int]] = {}  # per stream, the lowest id a recovery open or owed starts at
        for since in (*self._open.values(), self._owed):
            for stream, cursor in since.items():
                low[stream] = min(low.get(stream, id_key(cursor)), id_key(cursor))
        if not low:  # nothing can be returned again (always so with one thread and no trip)
            self._given.clear()
            return
        for stream, e in got:
            self._given.setdefault(stream, set()).add(e.entry_id)
        self._given = {s: kept for s, ids in self._given.items()
                       if s in low and (kept := {i for i in ids if id_key(i) > low[s]})}
