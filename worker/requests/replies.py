"""What a worker answers (pure: no Redis, no torch): the final reply to a request it stops, and the
reply to a completion the engine returned. Replies stay typed; the transport encodes them."""

from __future__ import annotations

import logging

from batchfleet.common.errors import GUIDE_FAILED
from batchfleet.common.wire.protocol import Error, Result
from batchfleet.worker.engine.base import Completion
from batchfleet.worker.requests.validate import Accepted
from batchfleet.worker.transport.base import Reply

log = logging.getLogger("batchfleet.worker.loop")
# what the engine did for a request, in every Result.extra (0 where an engine does not do it: hf)
ENGINE_EXTRA = ("cached_tokens", "preemptions")


def error_reply(acc: Accepted, code: str, message: str) -> Reply:
    """The final error reply to a held request (it settles the request's entry)."""
    return Reply.to(acc.entry, acc.request.id, Error(acc.request.id, code, message), acc.reply_key)


def completion_reply(c: Completion, acc: Accepted, now: float, worker: str) -> Reply:
    """The reply to a completion: its Result (timings relative to the request's enqueue, this host's
    clock), or an Error with the engine's code (``engine_error``, ``guide_failed``) when it could not serve
    it. ``Result.extra``: the request's ``bucket``, its prompt tokens the prefix cache supplied
    (``cached_tokens``) and its ``preemptions``, plus whatever else the engine reported. The engine knows
    the request by its run id (worker/requests/table.py); the reply names its job id."""
    return Reply.to(acc.entry, acc.request.id, _completion_message(c, acc, now, worker), acc.reply_key)


def _completion_message(c: Completion, acc: Accepted, now: float, worker: str) -> Result | Error:
    job_id = acc.request.id
    if c.error is not None:
        if c.error_code == GUIDE_FAILED:  # the client's guide, not the fleet: logged, not an engine fault
            log.warning("job %s failed its structured output: %s", job_id, c.error)
        return Error(job_id, c.error_code, c.error)
    t0 = acc.enqueued_at
    return Result(
        id=job_id, token_ids=c.token_ids, text=c.text, finish_reason=c.finish_reason,
        prompt_tokens=len(acc.gen.prompt), completion_tokens=len(c.token_ids),
        queue_ms=(c.started_at - t0) * 1000, ttft_ms=(c.first_token_at - t0) * 1000,
        total_ms=(now - t0) * 1000, worker=worker, batch_size=c.batch_size,
        extra={**dict.fromkeys(ENGINE_EXTRA, 0), **c.extra, "bucket": acc.entry.bucket},
        logprobs=None if acc.gen.params.logprobs is None else list(c.logprobs or []), embedding=c.embedding,
    )
