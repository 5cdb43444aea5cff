"""RQ job functions: a backend that already runs RQ enqueues batchfleet work by dotted name.

RQ runs one job at a time per worker and cannot batch, so RQ is the front door and the fleet the engine:
each job function submits to the fleet and waits. Arguments and results are JSON only, for
``Queue(..., serializer=JSONSerializer)``::

    from redis import Redis
    from rq import Queue, Retry
    from rq.serializers import JSONSerializer

    q = Queue("llm", connection=Redis(), serializer=JSONSerializer)
    job = q.enqueue("batchfleet.producer.rq.generate", "Hello", max_new_tokens=32)
    q.enqueue("batchfleet.producer.rq.bulk", "/data/prompts.jsonl", "/data/answers.jsonl", retry=Retry(max=3))

The fleet's Redis and namespace come from BATCHFLEET_REDIS_URL / BATCHFLEET_NAMESPACE in the RQ worker's
environment (the ``Client()`` defaults); they may be another Redis than RQ's own. ``rq`` itself is
imported only inside ``bulk`` (for ``get_current_job``): importing this module needs neither rq nor torch.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import asdict
from typing import Any

from batchfleet.producer.bulk.file_run import Summary, bulk_file, throttled
from batchfleet.producer.client import Client

RESULT_FIELDS = ("id", "text", "token_ids", "finish_reason", "prompt_tokens", "completion_tokens", "queue_ms",
                 "ttft_ms", "total_ms", "worker", "batch_size")
META_EVERY_S = 1.0

_client: tuple[int, Client] | None = None  # (pid, client): a forked work-horse must not reuse its parent's


def _shared_client() -> Client:
    """One Client per process (RQ's SimpleWorker runs many jobs in one; a forking worker, one per horse)."""
    global _client
    if _client is None or _client[0] != os.getpid():
        _client = (os.getpid(), Client())
    return _client[1]


def generate(prompt: Any, timeout: float | None = None, **params: Any) -> dict:
    """Answer one prompt (text, token ids or chat messages) on the fleet; returns the ``Result`` fields as
    a JSON object (text, token_ids, finish_reason, prompt_tokens, completion_tokens, queue_ms, ttft_ms,
    total_ms, worker, batch_size). ``params``: Client.generate's (common/wire/params.py's fields, priority,
    structured-output options).
    Errors are raised (the job fails; RQ's Retry applies): InvalidRequest, PromptTooLong, QueueFull,
    NoWorkers, Timeout, JobFailed."""
    result = _shared_client().generate(prompt, timeout=timeout, **params)
    return {k: getattr(result, k) for k in RESULT_FIELDS}


def bulk(input_path: str, output_path: str, window: int = 256, timeout: float | None = None,
         **params: Any) -> dict:
    """Run a JSONL prompt file into an answer file with ``batchfleet bulk`` semantics; returns the summary.

    Runs at background priority unless ``priority`` is given. Idempotent: job ids and the reply inbox come from
    the run key kept beside the output (``<output>.run``), and an existing output is resumed, so a retried
    job (RQ ``Retry``, a requeue after its worker died) keeps the lines written, collects the answers of
    jobs the killed attempt left in flight and submits only the rest: every line appears once. A job on an
    output another run writes now fails at once with OutputBusy (producer/bulk/lock.py; RQ's Retry runs it
    again later). Progress goes to ``job.meta`` (total, done, failed, submitted, collected) about once a
    second."""
    from rq import get_current_job  # rq is needed only here, inside an RQ worker

    job = get_current_job()

    def report(s: Summary) -> None:
        if job is not None:
            job.meta.update({"total": s.total, "done": s.done, "failed": s.failed_lines, "submitted": s.submitted,
                             "collected": s.collected})
            job.save_meta()

    summary = asyncio.run(bulk_file(input_path, output_path, window=window, defaults=params, timeout=timeout,
                                    resume=True, progress=throttled(report, META_EVERY_S)))
    report(summary)
    if summary.error is not None:  # no live worker, Redis gone: fail the job so RQ's Retry runs it again
        raise summary.error
    out = {k: v for k, v in asdict(summary).items() if k != "error"}
    out["output"] = output_path
    return out
