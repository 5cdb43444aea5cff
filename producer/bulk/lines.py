"""What a bulk run reads: input lines one at a time with bounded memory, and the prompt line format.

``numbered`` is the one line reader of every bulk input (``batchfleet bulk`` in both formats, the gateway's
batches): a line is read with at most MAX_LINE_BYTES in memory, a longer one is skipped unread and comes as
TOO_LONG. The prompt format (``PromptFormat``): each non-blank line is a JSON object ``{"prompt", "id"?,
params?}`` or a JSON string (the prompt itself); anything else becomes an error line carrying the protocol's
error code, and the run goes on. Answers: ``{index, id?, result}`` or ``{index, id?, error: {code, message}}``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import IO, Any

from batchfleet.common.errors import (
    DEADLINE_EXCEEDED,
    INVALID_REQUEST,
    PROMPT_TOO_LONG,
    FleetUnavailable,
    InvalidRequest,
    PromptTooLong,
    QueueFull,
    RedisUnavailable,
    Timeout,
)
from batchfleet.common.keys import valid_job_id
from batchfleet.common.wire.params import FIELDS
from batchfleet.common.wire.priority import BACKGROUND
from batchfleet.common.wire.protocol import Result
from batchfleet.producer.ask import STRUCTURED, Ask
from batchfleet.producer.bulk.prefix_order import prefix_key
from batchfleet.producer.bulk.work import Work

MAX_LINE_BYTES = (4 << 20) + 4096  # a body the gateway takes (4 MiB) and the line around it
TOO_LONG = b"<line too long>"  # what ``numbered`` yields in place of a longer line
# every parameter the API takes: the one table's (common/wire/params.py; ``guide`` is an object, its JSON forms are
# the structured-output options) and the priority
PARAM_KEYS = (*(k for k in FIELDS if k != "guide"), *STRUCTURED, "priority")
LINE_KEYS = frozenset({"prompt", "id", *PARAM_KEYS})
SHA_KEY = "input_sha256"  # an answer line's fingerprint of its input line (``line_sha``)
# client-side failures have codes of their own next to the wire codes of common/errors.py
CLIENT_CODES: tuple[tuple[type[BaseException], str], ...] = (
    (PromptTooLong, PROMPT_TOO_LONG), (InvalidRequest, INVALID_REQUEST), (QueueFull, "queue_full"),
    (Timeout, DEADLINE_EXCEEDED), (FleetUnavailable, "no_workers"), (RedisUnavailable, "redis_unavailable"),
    (ValueError, INVALID_REQUEST), (TypeError, INVALID_REQUEST),
)


def numbered(f: IO[bytes]) -> Iterator[tuple[int, bytes]]:
    """(line number, raw line) of every non-blank line of a binary file, read one line at a time; a line
    over MAX_LINE_BYTES is skipped unread and comes as TOO_LONG (memory stays bounded by one line)."""
    index = 0
    while raw := f.readline(MAX_LINE_BYTES + 1):
        if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
            while (rest := f.readline(MAX_LINE_BYTES)) and not rest.endswith(b"\n"):
                pass
            raw = TOO_LONG
        if raw.strip():
            yield index, raw
        index += 1


def looks_like_batch(first_line: bytes | str) -> bool:
    """Whether a file's first non-empty line is an OpenAI Batch API request (``custom_id`` and ``body``):
    ``bulk --format auto`` then runs it as one (gateway/batches/format.py)."""
    try:
        obj = json.loads(first_line)
    except ValueError:
        return False
    return isinstance(obj, dict) and "custom_id" in obj and "body" in obj


def error_code(exc: BaseException) -> str:
    """The protocol's code for an error (``prompt_too_long``, ``queue_full``, ...), never a class name."""
    code = getattr(exc, "code", None)
    if isinstance(code, str):
        return code
    return next((c for cls, c in CLIENT_CODES if isinstance(exc, cls)), "internal_error")


def digest(*parts: str, n: int = 32) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:n]


JSON_SPACE = b" \t\r\n"  # the whitespace JSON allows around a value (RFC 8259): no part of what a line asks


def line_sha(raw: bytes, text: bool = False) -> str:
    """An input line's fingerprint (16 hex digits of SHA-256) over exactly what the line asks: a JSON line's
    text without the whitespace around it (which JSON ignores), a plain-text line (``text``) whole but for its
    line end, as its prompt is sent (its leading and trailing spaces are part of it). An answer carries it, so
    a rerun keeps an answer only while its line asks the same (producer/bulk/file_run.py); the run's own
    parameters (defaults, timeout) are checked apart, by the run record (producer/bulk/files.py)."""
    return hashlib.sha256(text_prompt(raw) if text else raw.strip(JSON_SPACE)).hexdigest()[:16]


def text_prompt(raw: bytes) -> bytes:
    """A plain-text line's prompt: the line without its line end (``\\n``, ``\\r\\n``)."""
    return raw.rstrip(b"\r\n")


@dataclass
class Line:
    """One non-empty prompt line: what to ask (``obj``) or why it cannot be asked (``error``)."""

    index: int  # 0-based line number in the input file (blank lines count, and get no answer)
    obj: dict = field(default_factory=dict)
    error: dict | None = None
    job_id: str | None = None
    sha: str | None = None

    @property
    def key(self) -> str | None:
        """What lines submitted together share (producer/bulk/prefix_order.py)."""
        return prefix_key(self.obj.get("prompt")) if self.error is None else None

    def answer(self, **body: object) -> dict:
        out: dict = {"index": self.index}
        if "id" in self.obj:
            out["id"] = self.obj["id"]
        if self.sha is not None:
            out[SHA_KEY] = self.sha
        out.update(body)
        return out


def parse_line(raw: bytes | str, index: int, prefix: str, seen: dict[str, int], text: bool = False) -> Line:
    """Parse and name line ``index``: ``<prefix>.<line id>`` (hashed when not a valid job id), else
    ``<prefix>.l<line number>``; ``seen``: user ids met so far -> line number, extended here. ``text``: the
    line is the prompt itself (a plain-text prompts file), not JSON."""
    raw_bytes = raw.encode() if isinstance(raw, str) else raw
    line = Line(index, sha=line_sha(raw_bytes, text))
    if raw is TOO_LONG:
        line.error = {"code": INVALID_REQUEST, "message": f"line over {MAX_LINE_BYTES} bytes: split the prompt "
                      "or shorten it"}
        return line
    try:
        obj = text_prompt(raw_bytes).decode() if text else json.loads(raw)
    except UnicodeDecodeError:
        line.error = {"code": INVALID_REQUEST, "message": "not UTF-8 text: save the file as UTF-8"}
        return line
    except ValueError as exc:
        line.error = {"code": INVALID_REQUEST, "message": f"not JSON: {exc}; a line is a JSON object "
                      '{"prompt": ...} or a JSON string (a plain-text file, one prompt per line: --format text)'}
        return line
    if isinstance(obj, str):
        obj = {"prompt": obj}
    if not isinstance(obj, dict) or "prompt" not in obj:
        line.error = {"code": INVALID_REQUEST,
                      "message": 'each line must be a JSON object with a "prompt" (or a JSON string)'}
        return line
    line.obj = obj
    line.error, key = _check(obj, index, seen)
    if line.error is None:
        line.job_id = f"{prefix}.{key}" if valid_job_id(f"{prefix}.{key}") else f"{prefix}.h{digest(key)}"
    return line


def parse_lines(text_lines: list[str], prefix: str) -> list[Line]:
    """``parse_line`` over every non-empty line of a list (line numbers count the blank ones)."""
    seen: dict[str, int] = {}
    return [parse_line(raw, i, prefix, seen) for i, raw in enumerate(text_lines) if raw.strip()]


def _check(obj: dict, index: int, seen: dict[str, int]) -> tuple[dict | None, str]:
    """(error or None, the line's name) of a parsed line."""
    unknown = sorted(set(obj) - LINE_KEYS)
    if unknown:
        return {"code": INVALID_REQUEST, "message": f"unknown key(s) {', '.join(unknown)}; a line holds "
                f"{', '.join(sorted(LINE_KEYS))}"}, ""
    if "id" not in obj:
        return None, f"l{index}"
    user_id = obj["id"]
    if isinstance(user_id, bool) or not isinstance(user_id, (str, int)):
        return {"code": INVALID_REQUEST, "message": '"id" must be a string or an integer'}, ""
    if str(user_id) in seen:
        return {"code": INVALID_REQUEST,
                "message": f"duplicate id {user_id!r} (line {seen[str(user_id)]} has it): each id must be unique"}, ""
    seen[str(user_id)] = index
    return None, str(user_id)


def prompt_params(defaults: dict | None, timeout: float | None, plain: bool) -> dict[str, Any]:
    """A prompt run's parameters, as its run record keeps them (producer/bulk/files.py)."""
    return {"format": "text" if plain else "prompts", "defaults": dict(defaults or {}), "timeout": timeout}


@dataclass
class PromptFormat:
    """The prompt line format for the runner (producer/bulk/work.py ``LineFormat``): one job per line, in the
    background priority unless ``defaults`` says otherwise; answers written in submission order."""

    prefix: str
    defaults: dict = field(default_factory=dict)
    timeout: float | None = None
    text: bool = False  # a plain-text file: each line is a prompt
    seen: dict[str, int] = field(default_factory=dict)
    ordered = True
    check_answered = False  # an output started over gets a new run key, so new job ids
    refused: tuple[type[BaseException], ...] = (InvalidRequest, ValueError, TypeError)

    def parse(self, index: int, raw: bytes) -> Work:
        line = parse_line(raw, index, self.prefix, self.seen, self.text)
        if line.error is not None:
            return Work(index, line, error=line.answer(error=line.error))
        assert line.job_id is not None and line.sha is not None
        # the job is named after the line's content too: a line changed since an interrupted run never
        # collects the answer its old content left in the inbox. A line with an "id" is named after its
        # position as well, as written answers are kept by position (``index``): moved to a line with no
        # answer written, it runs under ids of its own, never under those its answer at the old position was
        # given (the fleet answers an id once, so they would be refused as answered already)
        name = line.job_id if "id" not in line.obj else f"{line.job_id}.l{index}"
        job_id = f"{name}.{line.sha}"
        if not valid_job_id(job_id):
            job_id = f"{self.prefix}.h{digest(name, line.sha)}"
        return Work(index, line, [job_id], line.obj["prompt"], line.key, self.timeout)

    def sha(self, raw: bytes) -> str:
        return line_sha(raw, self.text)

    async def asks(self, work: Work) -> list[Ask]:
        """The line's parameters over the run's defaults (JSON values), checked once into what its job asks."""
        obj = work.line.obj
        return [Ask.of({"priority": BACKGROUND, **self.defaults, **{k: obj[k] for k in PARAM_KEYS if k in obj}})]

    def answer(self, work: Work, results: list[Result]) -> dict:
        return work.line.answer(result=asdict(results[0]))

    def failure(self, work: Work, exc: BaseException) -> dict:
        return work.line.answer(error={"code": error_code(exc), "message": str(exc)})

    def abandoned(self, index: int, line: Any, code: str, message: str) -> dict:
        answer = line.answer if isinstance(line, Line) else Line(index, sha=self.sha(line)).answer
        return answer(error={"code": code, "message": message})

    def index_of(self, obj: Any) -> int | None:
        return int(obj["index"])  # KeyError, ValueError, TypeError: not one of ours

    def sha_of(self, obj: dict) -> str | None:
        return obj.get(SHA_KEY)

    def failed(self, obj: dict) -> bool:
        return "error" in obj

    def code_of(self, obj: dict) -> str:
        return str((obj.get("error") or {}).get("code"))
