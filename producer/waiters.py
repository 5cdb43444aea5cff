"""What a caller of the client waits on for one job (producer/inbox.py routes the inbox's entries to it): the final
reply and, for a streamed job, the deltas before it."""

from __future__ import annotations

import asyncio

from batchfleet.common.errors import Timeout
from batchfleet.common.wire.protocol import Delta, Result

Final = tuple[str, Result | BaseException]  # (entry id, the Result or the error it stands for)


class WaitExpired(Timeout):
    """The caller's timeout passed with no reply (as opposed to a ``deadline_exceeded`` answer)."""


class Waiter:
    """One job's final reply, and its deltas when it streams."""

    def __init__(self, stream: bool, fingerprint: bytes | None = None) -> None:
        self.final: asyncio.Future[Final] = asyncio.get_running_loop().create_future()
        # the request submitted under this job id (``Outgoing.fingerprint``); None: no submit of this client
        # named it yet (a result() of a job submitted under a reused inbox name)
        self.fingerprint = fingerprint
        # streamed jobs: deltas in order, then None once ``final`` is set
        self.deltas: asyncio.Queue[Delta | None] | None = asyncio.Queue() if stream else None

    def settle(self, final: Final) -> None:
        """The job's final reply: the caller's wait ends, and a stream's deltas with it."""
        self.final.set_result(final)
        if self.deltas is not None:
            self.deltas.put_nowait(None)

    def answer(self) -> Final | None:
        """The final reply it holds (None: none yet, or the wait was cancelled)."""
        done = self.final.done() and not self.final.cancelled()
        return self.final.result() if done else None
