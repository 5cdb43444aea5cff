"""What a worker answers (pure: no Redis, no torch): the final reply to a request it stops, and the
reply to a completion the engine returned. Replies stay typed; the transport encodes them."""

from __future__ import annotations

from batchfleet.common.errors import ENGINE_ERROR
from batchfleet.common.protocol import Error, Result
from batchfleet.worker.engine.base import Completion
from batchfleet.worker.transport import Reply
from batchfleet.worker.validate import Accepted


def error_reply(acc: Accepted, code: str, message: str) -> Reply:
    """The final error reply to a held request (it settles the request's entry)."""
    return Reply(acc.gen.id, Error(acc.gen.id, code, message), acc.entry.bucket, acc.entry.entry_id, acc.reply_key,
                 acc.entry.lane)


def completion_reply(c: Completion, acc: Accepted, now: float, worker: str) -> Reply:
    """The reply to a completion: its Result (timings relative to the request's enqueue, this host's
    clock), or an ``engine_error`` Error when the engine could not serve it."""
    return Reply(c.id, _completion_message(c, acc, now, worker), acc.entry.bucket, acc.entry.entry_id,
                 acc.reply_key, acc.entry.lane)


def _completion_message(c: Completion, acc: Accepted, now: float, worker: str) -> Result | Error:
    if c.error is not None:
        return Error(c.id, ENGINE_ERROR, c.error)
    t0 = acc.enqueued_at
    return Result(
        id=c.id, token_ids=c.token_ids, text=c.text, finish_reason=c.finish_reason,
        prompt_tokens=len(acc.gen.prompt), completion_tokens=len(c.token_ids),
        queue_ms=(c.started_at - t0) * 1000, ttft_ms=(c.first_token_at - t0) * 1000,
        total_ms=(now - t0) * 1000, worker=worker, batch_size=c.batch_size, extra={"bucket": acc.entry.bucket},
        logprobs=None if acc.gen.params.logprobs is None else list(c.logprobs or []),
    )
