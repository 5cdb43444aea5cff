"""Typed exceptions and the error codes carried on the wire."""

from __future__ import annotations

# Error codes a worker may answer with (Error.code). Clients map them back to exceptions.
INVALID_REQUEST = "invalid_request"
PROMPT_TOO_LONG = "prompt_too_long"
ENGINE_ERROR = "engine_error"
WORKER_FAILED = "worker_failed"
DEADLINE_EXCEEDED = "deadline_exceeded"
UNSUPPORTED_SCHEMA = "unsupported_schema"
CANCELLED = "cancelled"
GUIDE_FAILED = "guide_failed"  # the structured-output grammar library gave up on the request's guide at run time

# A client's own code, never a worker's: the job's answer expired (the reply TTL) before this client read it
ANSWER_EXPIRED = "answer_expired"

ERROR_CODES = frozenset(
    {INVALID_REQUEST, PROMPT_TOO_LONG, ENGINE_ERROR, WORKER_FAILED, DEADLINE_EXCEEDED, UNSUPPORTED_SCHEMA, CANCELLED,
     GUIDE_FAILED}
)


class BatchfleetError(Exception):
    """Base class of every batchfleet error."""


class ConfigError(BatchfleetError, ValueError):
    """A configuration value is invalid; raised at startup."""


class ProtocolError(BatchfleetError, ValueError):
    """A wire message could not be decoded or failed validation."""

    def __init__(self, message: str, code: str = INVALID_REQUEST) -> None:
        super().__init__(message)
        self.code = code


class InvalidRequest(BatchfleetError, ValueError):
    """Generation parameters, a prompt or a job id the fleet cannot accept; raised before anything is sent."""


class PromptTooLong(InvalidRequest):
    """The prompt does not fit the largest bucket, or prompt + max_new_tokens > max_seq_len. ``field``
    says which to shorten: ``"prompt"`` or ``"max_new_tokens"``."""

    def __init__(self, message: str, field: str = "prompt") -> None:
        super().__init__(message)
        self.field = field


class QueueFull(BatchfleetError):
    """The bucket's queue holds max_queue_len entries; nothing was enqueued."""


class RateLimited(BatchfleetError):
    """The tenant is over one of its limits (common/tenants.py): nothing was enqueued. ``limit`` names it
    (``requests_per_minute``, ``tokens_per_minute``, ``tokens_per_day``); ``retry_after_s``: seconds until the
    same request would fit; ``window``: the tenant's limits as they stood (a ``common.tenants.Window``: what the
    gateway's ``x-ratelimit-*`` headers say)."""

    def __init__(self, message: str, limit: str, retry_after_s: float, window: object = None) -> None:
        super().__init__(message)
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.window = window


class FleetUnavailable(BatchfleetError):
    """No worker has published the fleet's tokenizer and limits under this namespace."""


class NoWorkers(FleetUnavailable):
    """No worker has a fresh heartbeat under this namespace, so nothing would serve the request (raised by
    ``submit`` unless the client was made with ``require_workers=False``, for fleets that scale from zero)."""


class RedisUnavailable(BatchfleetError, ConnectionError):
    """Redis could not be reached (refused, frozen, timing out) for ``retry_s`` and the call had no timeout
    of its own (with one, ``Timeout`` is raised instead)."""


class RedisRefused(BatchfleetError):
    """Redis answered a command with an error of its own (a read-only replica, a missing permission, a script
    error): nothing a retry of this call cures. The message gives Redis' reason, never the command's keys or
    arguments (an inbox token is a secret: docs/SECURITY.md)."""


class RedisFull(RedisRefused):
    """Redis is full (``maxmemory`` reached under ``noeviction``): it refused the write, so nothing was written
    (a refused enqueue enqueued nothing). Retry later: memory frees as workers answer and clients take answers."""


class Timeout(BatchfleetError, TimeoutError):
    """No result arrived within the caller's timeout (or the request's deadline passed)."""


class JobFailed(BatchfleetError):
    """The worker answered the request with an error; `code` is one of ERROR_CODES."""

    def __init__(self, job_id: str, code: str, message: str) -> None:
        super().__init__(f"job {job_id} failed [{code}]: {message}")
        self.job_id = job_id
        self.code = code
        self.message = message


class Cancelled(JobFailed):
    """The job was cancelled (``cancel`` or a closed stream) before it finished; code ``cancelled``."""


class AnswerExpired(JobFailed):
    """The job was answered, but its answer expired (the workers' reply TTL) before this client read it; code
    ``answer_expired``. Nothing more will come: submit again under a new job id."""
