"""OpenAI Batch API lines: an input line -> what to run (or why not), an answer -> an output or error line.

Pure (no I/O), shared by the gateway's batches and ``batchfleet bulk --format openai`` (gateway/batches/format.py).
An input line is ``{"custom_id", "method": "POST", "url", "body"}``; its body goes through the gateway's own validation
(gateway/openai/chat/request.py ``request_job``), so a body the gateway would refuse becomes an error line carrying the
same status and message. A line that is not a batch request at all (not JSON, no custom_id, another url, a
repeated custom_id) is a ``LineError``: OpenAI fails the whole batch for it, bulk writes an error line.

Output lines, as OpenAI writes them: ``{"id": "batch_req_...", "custom_id", "response": {"status_code",
"request_id", "body"}, "error": null}``; a request that never ran has ``"response": null`` and
``"error": {"code", "message"}``. The id ends with the input line number and the line's fingerprint
(``batch_req_<prefix>_<line>_<sha>``), so a resumed run reads back which lines are written, and for which
content.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from batchfleet.gateway.errors import APIError, invalid
from batchfleet.gateway.openai.chat.request import Job, request_job
from batchfleet.gateway.openai.embeddings.request import EmbedJob, embed_job
from batchfleet.gateway.openai.responses.request import ResponsesCall, parse_call
from batchfleet.gateway.strict import strict_json
from batchfleet.producer.bulk.lines import MAX_LINE_BYTES, TOO_LONG, line_sha

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings")
LINE_KEYS = frozenset({"custom_id", "method", "url", "body"})
MAX_CUSTOM_ID_CHARS = 512
MAX_LINE_ERRORS = 100  # a malformed file's errors listed in the batch object (OpenAI lists some, not all)


class LineError(ValueError):
    """A line that is not a batch request (OpenAI fails the whole batch); ``line`` is 1-based."""

    def __init__(self, code: str, message: str, line: int, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.line, self.param = code, message, line, param

    def as_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "param": self.param, "line": self.line}


@dataclass(frozen=True)
class BatchLine:
    """One input line: ``job`` to run, or ``error``, the gateway's answer to its body."""

    index: int  # 0-based line number in the input
    custom_id: str
    chat: bool
    job: Job | EmbedJob | None  # an EmbedJob for a /v1/embeddings line
    error: APIError | None
    sha: str | None = None  # the raw line's fingerprint (producer/bulk/lines.py ``line_sha``)
    call: ResponsesCall | None = None  # a /v1/responses line's request (its answer repeats some fields)


@dataclass(frozen=True)
class Limits:
    """What the gateway's routes would apply to a body: the longest deadline and chat's default length."""

    timeout_cap: float
    chat_max_tokens: int


def parse_line(raw: bytes | str, index: int, limits: Limits, endpoint: str | None = None,
               seen: set[str] | None = None) -> BatchLine:
    """Parse input line ``index``; LineError when it is no batch request (``endpoint``: the batch's own, a
    line for another is malformed; ``seen``: custom_ids met so far, extended here)."""
    line = index + 1
    if raw is TOO_LONG:
        raise LineError("line_too_long", f"line {line}: over {MAX_LINE_BYTES} bytes", line)
    try:
        obj = strict_json(raw)
    except APIError as exc:
        raise LineError("invalid_json_line", f"line {line}: {exc.message}", line) from None
    if not isinstance(obj, dict):
        raise LineError("invalid_json_line", f"line {line}: each line must be a JSON object", line)
    unknown = sorted(set(obj) - LINE_KEYS)
    if unknown:
        raise LineError("invalid_request", f"line {line}: unknown field(s) {', '.join(unknown)}; a line holds "
                        "custom_id, method, url and body", line, unknown[0])
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID_CHARS:
        raise LineError("invalid_request", f"line {line}: custom_id must be a non-empty string of at most "
                        f"{MAX_CUSTOM_ID_CHARS} characters", line, "custom_id")
    if obj.get("method") != "POST":
        raise LineError("invalid_request", f"line {line}: method must be \"POST\"", line, "method")
    url = obj.get("url")
    if url not in ENDPOINTS:
        raise LineError("invalid_url", f"line {line}: url must be one of {', '.join(ENDPOINTS)}", line, "url")
    if endpoint is not None and url != endpoint:
        raise LineError("mismatched_endpoint", f"line {line}: url {url} differs from the batch's endpoint "
                        f"{endpoint}", line, "url")
    if "body" not in obj:
        raise LineError("invalid_request", f"line {line}: body is missing", line, "body")
    if seen is not None:
        if custom_id in seen:
            raise LineError("duplicate_custom_id", f"line {line}: custom_id {custom_id[:100]!r} is used by an "
                            "earlier line; each must be unique", line, "custom_id")
        seen.add(custom_id)
    chat = url != "/v1/completions"
    call = None
    try:
        if url == "/v1/embeddings":
            return BatchLine(index, custom_id, False, embed_job(obj["body"], limits.timeout_cap), None,
                             line_sha(_bytes(raw)))
        if url == "/v1/responses":
            call = parse_call(obj["body"])
            if call.request.previous_response_id is not None:  # a batch runs its lines at once, unordered
                raise invalid("previous_response_id is not supported in a batch request", "previous_response_id")
            job = call.job([], limits.timeout_cap, limits.chat_max_tokens)
        else:
            job = request_job(chat, obj["body"], limits.timeout_cap, limits.chat_max_tokens)
        if job.stream:
            raise invalid("stream is not supported in a batch request", "stream")
    except APIError as exc:
        return BatchLine(index, custom_id, chat, None, exc, line_sha(_bytes(raw)))
    return BatchLine(index, custom_id, chat, job, None, line_sha(_bytes(raw)), call)


def _bytes(raw: bytes | str) -> bytes:
    return raw.encode() if isinstance(raw, str) else raw


def request_name(prefix: str, index: int, sha: str | None = None) -> str:
    """The output line's ``id`` of input line ``index`` (whose fingerprint is ``sha``)."""
    return f"batch_req_{prefix}_{index}" + ("" if sha is None else f"_{sha}")


def _written(obj: Any, prefix: str) -> tuple[int, str | None] | None:
    head = f"batch_req_{prefix}_"
    name = obj.get("id") if isinstance(obj, dict) else None
    if not isinstance(name, str) or not name.startswith(head):
        return None
    index, _, sha = name[len(head):].partition("_")
    return (int(index), sha or None) if index.isdigit() else None


def written_index(obj: Any, prefix: str) -> int | None:
    """The input line number an output or error line answers (None: not a line of this run)."""
    found = _written(obj, prefix)
    return None if found is None else found[0]


def written_sha(obj: Any, prefix: str) -> str | None:
    """The fingerprint of the input line an output or error line answers."""
    found = _written(obj, prefix)
    return None if found is None else found[1]


def response_line(prefix: str, line: BatchLine, request_id: str, status: int, body: dict) -> dict[str, Any]:
    """A line of the output file (status 200) or of the error file (any other status)."""
    return {"id": request_name(prefix, line.index, line.sha), "custom_id": line.custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body}, "error": None}


def failure_line(prefix: str, index: int, custom_id: str | None, code: str, message: str,
                 sha: str | None = None) -> dict[str, Any]:
    """An error-file line for a request that never got a response (expired, cancelled, malformed in bulk)."""
    return {"id": request_name(prefix, index, sha), "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


def custom_id_of(raw: bytes) -> str | None:
    """A malformed line's custom_id, when it has one to name."""
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    return obj.get("custom_id") if isinstance(obj, dict) and isinstance(obj.get("custom_id"), str) else None


def line_code(obj: dict[str, Any]) -> str:
    """An error line's code (``model_not_found``, ``batch_expired``, ...), else its HTTP status as a string."""
    response = obj.get("response") or {}
    error = obj.get("error") or (response.get("body") or {}).get("error") or {}
    return str(error.get("code") or response.get("status_code"))
