"""OpenAI-style error bodies, and the one mapping from batchfleet's exceptions to HTTP statuses.

Every error the gateway answers has the body ``{"error": {"message", "type", "param", "code"}}``, so the
official clients raise their usual exception types (BadRequestError, RateLimitError, ...).
"""

from __future__ import annotations

import math
from typing import Any

from batchfleet.common.errors import (
    CANCELLED,
    DEADLINE_EXCEEDED,
    GUIDE_FAILED,
    INVALID_REQUEST,
    PROMPT_TOO_LONG,
    BatchfleetError,
    FleetUnavailable,
    InvalidRequest,
    JobFailed,
    NoWorkers,
    PromptTooLong,
    QueueFull,
    RateLimited,
    RedisFull,
    RedisRefused,
    RedisUnavailable,
    Timeout,
)
from batchfleet.common.redis.refusals import as_fleet_error

NO_RETRY = {"x-should-retry": "false"}  # the official OpenAI clients honour it (they retry 5xx otherwise)
RETRY_AFTER_S = 1  # what a 429 / 503 tells a client to wait: queues drain in about a batch's time


class APIError(Exception):
    """An error answer: HTTP ``status`` and the fields of the OpenAI error object."""

    def __init__(self, status: int, message: str, type: str, code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None, code: str | None = "invalid_request") -> APIError:
    """A 400 for a request the gateway refuses before anything is sent to the fleet."""
    return APIError(400, message, "invalid_request_error", code, param)


def _retry_later(status: int, message: str, type: str, code: str) -> APIError:
    return APIError(status, message, type, code, headers={"Retry-After": str(RETRY_AFTER_S)})


def rate_limited(exc: RateLimited) -> APIError:
    """OpenAI's 429 for a tenant over a limit: type ``requests`` or ``tokens``, code ``rate_limit_exceeded``, its
    ``x-ratelimit-*`` headers and ``Retry-After`` (whole seconds, at least 1)."""
    window = exc.window
    headers = window.headers() if hasattr(window, "headers") else {}
    headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
    kind = "requests" if exc.limit == "requests_per_minute" else "tokens"
    return APIError(429, str(exc), kind, "rate_limit_exceeded", headers=headers)


def api_error(exc: BaseException, guide_param: str | None = None) -> APIError:
    """The answer for an exception raised while serving a request (order matters: subclasses first);
    ``guide_param``: the request field its structured-output guide came from (named by a ``guide_failed``)."""
    if isinstance(exc, APIError):
        return exc
    exc = as_fleet_error(exc)  # a raw Redis error of the gateway's own stores: no command in its text
    if isinstance(exc, Timeout):  # the job was cancelled: a retry would start it again past the timeout asked
        return APIError(504, str(exc), "timeout_error", "timeout", headers=NO_RETRY)
    if isinstance(exc, PromptTooLong):
        return invalid(str(exc), "prompt", "context_length_exceeded")
    if isinstance(exc, (InvalidRequest, ValueError)):  # the client's parameter checks (pydantic's too)
        field = getattr(exc, "field", None)  # a ParamError names its field (logit_bias past the vocabulary)
        return invalid(str(exc), field if isinstance(field, str) else None)
    if isinstance(exc, RateLimited):
        return rate_limited(exc)
    if isinstance(exc, QueueFull):
        return _retry_later(429, str(exc), "rate_limit_error", "queue_full")
    if isinstance(exc, NoWorkers):
        return _retry_later(503, str(exc), "service_unavailable_error", "no_workers")
    if isinstance(exc, FleetUnavailable):
        return _retry_later(503, str(exc), "service_unavailable_error", "fleet_unavailable")
    if isinstance(exc, RedisUnavailable):
        return _retry_later(503, str(exc), "service_unavailable_error", "redis_unavailable")
    if isinstance(exc, RedisFull):  # memory frees as answers are taken: the same request succeeds later
        return _retry_later(503, str(exc), "service_unavailable_error", "redis_full")
    if isinstance(exc, RedisRefused):  # an operator must act (permissions, a read-only node): not the client
        return _retry_later(503, str(exc), "service_unavailable_error", "redis_refused")
    if isinstance(exc, JobFailed):
        return _job_failed(exc, guide_param)
    if isinstance(exc, BatchfleetError):
        return APIError(500, str(exc), "server_error", "internal_error")
    return APIError(500, f"internal error ({type(exc).__name__})", "server_error", "internal_error")


def _job_failed(exc: JobFailed, guide_param: str | None = None) -> APIError:
    """A worker's Error reply: the fleet's own code is kept as the OpenAI ``code``. A guide llguidance gave
    up on at run time is the request's fault: a 400 naming the guide's field, as a guide refused before
    it was queued."""
    if exc.code == DEADLINE_EXCEEDED:
        return APIError(504, exc.message, "timeout_error", DEADLINE_EXCEEDED, headers=NO_RETRY)
    if exc.code == PROMPT_TOO_LONG:
        return invalid(exc.message, "prompt", "context_length_exceeded")
    if exc.code == INVALID_REQUEST:
        return invalid(exc.message)
    if exc.code == GUIDE_FAILED:
        return invalid(exc.message, guide_param, GUIDE_FAILED)
    if exc.code == CANCELLED:  # someone else cancelled this job (the gateway cancels only for gone clients)
        return APIError(500, exc.message, "server_error", CANCELLED)
    return APIError(500, exc.message, "server_error", exc.code)
