"""A bulk run's files: the run key kept beside the output, the output read back, the sink that appends.

Naming (what makes a run resumable, and unguessable): a run draws a random key (256 bits) and keeps it in
its run record ``<output>.run`` (0600) beside the output file. Its inbox token and every job id derive from
that key (a prompt line's job id: ``b<key digest>.<line's "id">.l<line number>``, else its line number, then
the line's fingerprint), so only who can read the record can compute them: no other producer can cancel the run's jobs
or read its answers. A rerun on the same output reads the key back and asks the same questions under the
same names; a run that starts the output over (no output yet, or ``--no-resume``) draws a new key, so
answers of an earlier run never stand in for its own.

What a rerun may keep: the record also holds the run's parameters (``params``: format, defaults, timeout,
...); a rerun with others is refused (``RunChanged``: its kept answers were made with the old ones). Each
written line carries its input line's fingerprint (producer/bulk/lines.py ``line_sha``): ``read_back`` drops
the answers whose line changed since (and, asked to, the error lines), rewriting the file without them, and
the record keeps the tag under which each dropped line runs again (``fresh``).

Output files are appended to, one flushed line per answer; a run reads them back (``read_back``) to know
which input lines are answered, cutting off a partial last line a kill left.
"""

from __future__ import annotations

import json
import os
import secrets
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any

from batchfleet.common.errors import InvalidRequest
from batchfleet.common.wire.priority import DEPRECATED
from batchfleet.producer.bulk.lines import digest
from batchfleet.producer.bulk.work import LineFormat

KEY_SUFFIX = ".run"  # the run record beside the output


class RunChanged(InvalidRequest):
    """A rerun asked for other run parameters than the output's answers were made with."""


@dataclass(frozen=True)
class RunNames:
    """A run's inbox token and job id prefix, both derived from its random key."""

    key: str

    @classmethod
    def fresh(cls) -> RunNames:
        return cls(secrets.token_hex(32))

    @property
    def inbox(self) -> str:
        return digest("inbox", self.key)

    @property
    def prefix(self) -> str:
        return "b" + digest("jobs", self.key, n=16)


@dataclass
class RunRecord:
    """``<output>.run``: the key, the run's parameters (None: a record written before they were kept) and
    the tags of the lines that run again (``Spec.fresh``)."""

    names: RunNames
    params: dict[str, Any] | None = None
    fresh: dict[int, str] = field(default_factory=dict)

    @classmethod
    def load(cls, path: str) -> RunRecord | None:
        with open(path, encoding="utf-8") as f:
            text = f.read().strip()
        if _is_key(text):  # the bare key of an older record
            return cls(RunNames(text))
        try:
            obj = json.loads(text)
            record = cls(RunNames(obj["key"]), _renamed(obj.get("params")), {int(k): str(v) for k, v in
                                                                             (obj.get("fresh") or {}).items()})
        except (ValueError, KeyError, TypeError, AttributeError):
            return None
        return record if _is_key(record.names.key) else None

    def save(self, path: str) -> None:
        """Written whole to a temporary file, then renamed over the record (0600)."""
        tmp = path + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"key": self.names.key, "params": self.params, "fresh": self.fresh}, f)
            f.write("\n")
        os.replace(tmp, path)


def _renamed(params: Any) -> Any:
    """A run's parameters with today's names: a record written before the priority rename keeps the
    deprecated ``"priority": "batch"`` among its defaults, read as ``background``, so that run still resumes
    after an upgrade (docs/CONFIGURATION.md, "Deprecated names")."""
    defaults = params.get("defaults") if isinstance(params, dict) else None
    if isinstance(defaults, dict) and defaults.get("priority") in DEPRECATED:
        return {**params, "defaults": {**defaults, "priority": DEPRECATED[defaults["priority"]]}}
    return params


def _is_key(text: object) -> bool:
    return isinstance(text, str) and len(text) == 64 and all(c in "0123456789abcdef" for c in text)


def changes(old: dict[str, Any], new: dict[str, Any]) -> str:
    """``name: old -> new`` for each parameter that differs (a nested map's, by their own names)."""
    parts = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            parts.append(changes(a, b))
        elif a != b:
            parts.append(f"{k}: {json.dumps(a)} -> {json.dumps(b)}")
    return ", ".join(p for p in parts if p)


def run_record(output_path: str | None, resume: bool, params: dict[str, Any] | None = None) -> tuple[RunRecord, bool]:
    """(record, resuming) for a run writing ``output_path``: the record kept beside it when ``resume`` and
    both the output and its record exist (RunChanged when it holds other ``params``); else a fresh key,
    written beside the output (0600) before anything is submitted. Stdout (None): never resumed."""
    key_path = None if output_path is None else output_path + KEY_SUFFIX
    params = None if params is None else json.loads(json.dumps(params))  # as read back: lists, not tuples
    if resume and output_path is not None and key_path is not None \
            and os.path.exists(output_path) and os.path.exists(key_path):
        record = RunRecord.load(key_path)
        if record is not None:
            if params is not None and record.params is not None and record.params != params:
                raise RunChanged(f"{output_path} holds answers made with other run parameters "
                                 f"({changes(record.params, params)}): rerun with --no-resume to answer every "
                                 "line again with the new ones (or with the old ones to resume)")
            if params is not None and record.params is None:
                record.params = params
                record.save(key_path)
            return record, True
    record = RunRecord(RunNames.fresh(), params)
    if key_path is not None:
        record.save(key_path)
    return record, False


def run_names(output_path: str | None, resume: bool) -> tuple[RunNames, bool]:
    """``run_record``'s names (the run's parameters unchecked)."""
    record, resuming = run_record(output_path, resume)
    return record.names, resuming


@dataclass
class Written:
    """What output files already hold: answered line numbers, how many lines and how many error lines."""

    done: set[int] = field(default_factory=set)
    lines: int = 0
    failed: int = 0
    codes: Counter = field(default_factory=Counter)  # error code -> error lines kept
    dropped: dict[int, str] = field(default_factory=dict)  # line -> why its written line was dropped


# (line number, fingerprint written with it, an error line) -> why to drop the written line, None: keep it
Verdict = Callable[[int, "str | None", bool], "str | None"]


def read_back(path: str | None, fmt: LineFormat, into: Written | None = None,
              verdict: Verdict | None = None) -> Written:
    """Add the lines of this run written in ``path`` to ``into``; a partial last line (a kill mid-write) is
    cut off, a line that is not the run's is left as it is, a line ``verdict`` refuses is dropped (the file
    is rewritten without it, through a temporary file renamed over it)."""
    out = into or Written()
    if path is None or not os.path.exists(path):
        return out
    kept: list[tuple[int, int]] = []  # byte spans kept, when some line is dropped
    with open(path, "rb+") as f:
        keep = 0
        for raw in f:
            if not raw.endswith(b"\n"):
                break
            start, keep = keep, keep + len(raw)
            try:
                obj = json.loads(raw)
                index = fmt.index_of(obj)
            except (ValueError, KeyError, TypeError):
                index = None
            if index is None or index in out.done:
                kept.append((start, keep))
                continue
            failed = fmt.failed(obj)
            why = None if verdict is None else verdict(index, fmt.sha_of(obj), failed)
            if why is not None:
                out.dropped[index] = why
                continue
            kept.append((start, keep))
            out.done.add(index)
            out.lines += 1
            out.failed += failed
            if failed:
                out.codes[fmt.code_of(obj)] += 1
        f.truncate(keep)
    if sum(b - a for a, b in kept) != keep:
        _rewrite(path, kept)
    return out


def _rewrite(path: str, spans: list[tuple[int, int]]) -> None:
    tmp = path + ".tmp"
    with open(path, "rb") as src, open(tmp, "wb") as dst:
        for a, b in spans:
            src.seek(a)
            dst.write(src.read(b - a))
        dst.flush()
        os.fsync(dst.fileno())
    os.replace(tmp, path)


class FileSink:
    """Appends answer lines to one file and error lines to another (the same file is fine)."""

    def __init__(self, output: IO[str], errors: IO[str]) -> None:
        self.output, self.errors = output, errors

    def write(self, line: dict, ok: bool) -> None:
        f = self.output if ok else self.errors
        f.write(json.dumps(line) + "\n")
        f.flush()
