"""What a caller of the client waits on for one job (producer/inbox.py routes the inbox's entries to it): the final
reply and, for a streamed job, the deltas before it."""

from __future__ import annotations

import asyncio

from batchfleet.common.errors import ANSWER_EXPIRED, AnswerExpired, Timeout
from batchfleet.common.wire.protocol import Delta, Result

Final = tuple[str, Result | BaseException]  # (entry id, the Result or the error it stands for)
EXPIRED_GRACE_S = 5.0  # a ring whose answer is gone fails its waiter this long after, unless the answer comes
EXPIRED = ("its answer expired (the workers' reply TTL) before this client read it; nothing more will come: "
           "submit it again under a new job id")


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

    def expired(self, job_id: str, entry_id: str) -> None:
        """A ring of this waiter's job (entry ``entry_id``) found its answer gone: it expired (the reply TTL)
        before it was read, so the waiter gets AnswerExpired instead of waiting for ever. Not at once: a worker
        whose answer write Redis refused while it took the ring (full: memory freed between the two commands of
        one pipeline) writes both again from its outbox; an answer that comes within EXPIRED_GRACE_S wins."""
        def give_up() -> None:
            if not self.final.done():
                self.settle((entry_id, AnswerExpired(job_id, ANSWER_EXPIRED, EXPIRED)))

        asyncio.get_running_loop().call_later(EXPIRED_GRACE_S, give_up)

    def answer(self) -> Final | None:
        """The final reply it holds (None: none yet, or the wait was cancelled)."""
        done = self.final.done() and not self.final.cancelled()
        return self.final.result() if done else None
