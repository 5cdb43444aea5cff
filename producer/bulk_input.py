"""What a bulk run reads and names: input lines, the run key kept beside the output, the output read back.

Naming (what makes a run resumable, and unguessable): a run draws a random key (256 bits) and keeps it in
``<output>.run`` beside the output file. Its inbox token and every job id derive from that key (a line's
job id: ``b<key digest>.<line's "id">``, else its line number), so only who can read the key file can
compute them: no other producer can cancel the run's jobs or read its answers. A rerun on the same output
reads the key back and asks the same questions under the same names; a run that starts the output over
(no output yet, or ``--no-resume``) draws a new key, so answers of an earlier run never stand in for its own.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from dataclasses import dataclass, field

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

PARAM_KEYS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop")
LINE_KEYS = frozenset({"prompt", "id", *PARAM_KEYS})
KEY_SUFFIX = ".run"  # the run key file beside the output
# client-side failures have codes of their own next to the wire codes of common/errors.py
CLIENT_CODES: tuple[tuple[type[BaseException], str], ...] = (
    (PromptTooLong, PROMPT_TOO_LONG), (InvalidRequest, INVALID_REQUEST), (QueueFull, "queue_full"),
    (Timeout, DEADLINE_EXCEEDED), (FleetUnavailable, "no_workers"), (RedisUnavailable, "redis_unavailable"),
    (ValueError, INVALID_REQUEST), (TypeError, INVALID_REQUEST),
)


def looks_like_batch(first_line: bytes | str) -> bool:
    """Whether a file's first non-empty line is an OpenAI Batch API request (``custom_id`` and ``body``):
    ``bulk --format auto`` then runs it as one (gateway/batch_files.py)."""
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


def _digest(*parts: str, n: int = 32) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:n]


@dataclass(frozen=True)
class RunNames:
    """A run's inbox token and job id prefix, both derived from its random key."""

    key: str

    @classmethod
    def fresh(cls) -> RunNames:
        return cls(secrets.token_hex(32))

    @property
    def inbox(self) -> str:
        return _digest("inbox", self.key)

    @property
    def prefix(self) -> str:
        return "b" + _digest("jobs", self.key, n=16)


def run_names(output_path: str | None, resume: bool) -> tuple[RunNames, bool]:
    """(names, resuming) for a run writing ``output_path``: the key kept beside it when ``resume`` and both
    the output and its key file exist; else a fresh key, written beside the output (0600) before anything
    is submitted. Stdout (None): a fresh key, never resumed."""
    key_path = None if output_path is None else output_path + KEY_SUFFIX
    if resume and key_path is not None and os.path.exists(output_path) and os.path.exists(key_path):
        with open(key_path, encoding="utf-8") as f:
            key = f.read().strip()
        if len(key) == 64 and all(c in "0123456789abcdef" for c in key):
            return RunNames(key), True
    names = RunNames.fresh()
    if key_path is not None:
        fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(names.key + "\n")
    return names, False


@dataclass
class Line:
    """One non-empty input line: what to ask (``obj``) or why it cannot be asked (``error``)."""

    index: int  # 0-based line number in the input file (blank lines count, and get no answer)
    obj: dict = field(default_factory=dict)
    error: dict | None = None
    job_id: str | None = None

    def answer(self, **body: object) -> dict:
        out: dict = {"index": self.index}
        if "id" in self.obj:
            out["id"] = self.obj["id"]
        out.update(body)
        return out


def parse_lines(text_lines: list[str], prefix: str) -> list[Line]:
    """Parse and name every non-empty line: ``<prefix>.<line id>`` (hashed when not a valid job id), else
    ``<prefix>.l<line number>``."""
    seen: dict[str, int] = {}
    out: list[Line] = []
    for index, raw in enumerate(text_lines):
        if not raw.strip():
            continue
        line = Line(index)
        out.append(line)
        try:
            obj = json.loads(raw)
        except ValueError as exc:
            line.error = {"code": INVALID_REQUEST, "message": f"not JSON: {exc}"}
            continue
        if isinstance(obj, str):
            obj = {"prompt": obj}
        if not isinstance(obj, dict) or "prompt" not in obj:
            line.error = {"code": INVALID_REQUEST,
                          "message": 'each line must be a JSON object with a "prompt" (or a JSON string)'}
            continue
        line.obj = obj
        line.error, key = _check(obj, index, seen)
        if line.error is None:
            line.job_id = f"{prefix}.{key}" if valid_job_id(f"{prefix}.{key}") else f"{prefix}.h{_digest(key)}"
    return out


def _check(obj: dict, index: int, seen: dict[str, int]) -> tuple[dict | None, str]:
    """(error or None, the line's name) of a parsed line; ``seen``: user ids met so far -> line number."""
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
                "message": f"duplicate id {user_id!r} (line {seen[str(user_id)]} has it)"}, ""
    seen[str(user_id)] = index
    return None, str(user_id)


@dataclass
class Written:
    """What an output file already holds: answered line numbers and how many of them are error lines."""

    done: set[int] = field(default_factory=set)
    failed: int = 0


def read_output(output_path: str) -> Written:
    """The lines already in an output file; a partial last line (a kill mid-write) is cut off."""
    with open(output_path, "rb+") as f:
        data = f.read()
        keep = data.rfind(b"\n") + 1
        if keep < len(data):
            f.truncate(keep)
    out = Written()
    for raw in data[:keep].splitlines():
        try:
            obj = json.loads(raw)
            index = int(obj["index"])
        except (ValueError, KeyError, TypeError):
            continue  # not one of ours: left as it is
        if index not in out.done:
            out.done.add(index)
            out.failed += "error" in obj
    return out
