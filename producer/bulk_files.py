"""A bulk run's files: the run key kept beside the output, the output read back, the sink that appends.

Naming (what makes a run resumable, and unguessable): a run draws a random key (256 bits) and keeps it in
``<output>.run`` beside the output file. Its inbox token and every job id derive from that key (a prompt
line's job id: ``b<key digest>.<line's "id">``, else its line number), so only who can read the key file can
compute them: no other producer can cancel the run's jobs or read its answers. A rerun on the same output
reads the key back and asks the same questions under the same names; a run that starts the output over
(no output yet, or ``--no-resume``) draws a new key, so answers of an earlier run never stand in for its own.

Output files are appended to, one flushed line per answer; a run reads them back (``read_back``) to know
which input lines are answered, cutting off a partial last line a kill left.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass, field
from typing import IO

from batchfleet.producer.bulk_lines import digest
from batchfleet.producer.bulk_types import LineFormat

KEY_SUFFIX = ".run"  # the run key file beside the output


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
class Written:
    """What output files already hold: answered line numbers, how many lines and how many error lines."""

    done: set[int] = field(default_factory=set)
    lines: int = 0
    failed: int = 0


def read_back(path: str | None, fmt: LineFormat, into: Written | None = None) -> Written:
    """Add the lines of this run written in ``path`` to ``into``; a partial last line (a kill mid-write) is
    cut off, a line that is not the run's is left as it is."""
    out = into or Written()
    if path is None or not os.path.exists(path):
        return out
    with open(path, "rb+") as f:
        keep = 0
        for raw in f:
            if not raw.endswith(b"\n"):
                break
            keep += len(raw)
            try:
                obj = json.loads(raw)
                index = fmt.index_of(obj)
            except (ValueError, KeyError, TypeError):
                continue
            if index is not None and index not in out.done:
                out.done.add(index)
                out.lines += 1
                out.failed += fmt.failed(obj)
        f.truncate(keep)
    return out


class FileSink:
    """Appends answer lines to one file and error lines to another (the same file is fine)."""

    def __init__(self, output: IO[str], errors: IO[str]) -> None:
        self.output, self.errors = output, errors

    def write(self, line: dict, ok: bool) -> None:
        f = self.output if ok else self.errors
        f.write(json.dumps(line) + "\n")
        f.flush()
