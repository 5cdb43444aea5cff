"""The fault test's checker (scripts/faultlib/checker.py) on hand-written histories: each violation kind is
found, attributed to its issue item only where its shape says so, and a clean history has none."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scripts.faultlib.checker import check
from scripts.faultlib.history import History
from scripts.faultlib.reference import ref_key

pytestmark = pytest.mark.unit

PROMPTS = ["alpha beta", "gamma delta"]
REFS = {ref_key("sync", 0, 4): {"tokens": [1, 2, 3, 4], "text": "abcd"},
        ref_key("sync", 1, 4): {"tokens": [5, 6, 7, 8], "text": "efgh"},
        ref_key("gateway", 0, 4): {"tokens": None, "text": "ABCD"}}


class Writer:
    """Writes a history with explicit times (``t``), as client.py would."""

    def __init__(self, folder: Path, client: str = "sync0") -> None:
        self.h = History(folder / f"{client}.jsonl", client, 1)
        self.client = client
        self.n = 0
        self.inc = 1  # the client process's incarnation

    def event(self, ev: str, op: str, t: float, **fields) -> None:
        line = {"ev": ev, "client": self.client, "inc": self.inc, "op": op, "t": t, **fields}
        self.h._file.write(json.dumps(line) + "\n")
        self.h._file.flush()

    def op(self, kind: str, t0: float, t1: float | None, outcome: str | None, job_id: str | None = "j1",
           prompt: int = 0, channel: str = "sync", accepted: bool = True, of: str | None = None, **end) -> str:
        self.n += 1
        op = f"{self.client}.{self.inc}.{self.n}"
        self.event("start", op, t0, kind=kind, job_id=job_id, inbox="in0", prompt=prompt, max_new_tokens=4,
                   timeout=10.0, channel=channel, of=of)
        if accepted:
            self.event("accepted", op, t0 + 0.01, job_id=job_id)
        if outcome is not None:
            self.event("end", op, t1, outcome=outcome, job_id=job_id, **end)
        return op


def run_check(tmp_path: Path, fills=(), bulk=()):
    return check(tmp_path, REFS, list(bulk), PROMPTS, [], 5.0, list(fills))


def test_clean_history_has_no_violation(tmp_path: Path) -> None:
    w = Writer(tmp_path)
    w.op("submit", 0, 1, "answer", tokens=[1, 2, 3, 4])
    w.op("reuse", 2, 2.1, "error", error_class="JobFailed", typed=True)  # an answered id reused: refused
    w.op("cancel", 3, 4, "error", job_id="j2", error_class="Cancelled", typed=True)
    w.op("submit", 5, 15, "timeout", job_id="j3")
    w.op("collect", 20, 21, "answer", job_id="j3", prompt=1, tokens=[5, 6, 7, 8])  # the late answer, collected
    w.op("completion", 0, 1, "answer", job_id=None, channel="gateway", accepted=False, text="ABCD")
    report = run_check(tmp_path)
    assert not report.every, report.every
    assert report.outcomes["answer"] == 3


def test_each_violation_kind_is_found(tmp_path: Path) -> None:
    w = Writer(tmp_path)
    w.op("submit", 0, 1, "answer", tokens=[1, 2, 3, 4])
    w.op("reuse", 2, 3, "answer", tokens=[1, 2, 3, 4])  # the same id answered again, after the first
    w.op("submit", 0, 10, "timeout", job_id="lost1")
    w.op("collect", 20, 30, "timeout", job_id="lost1")
    w.op("shared", 0, 10, "timeout", job_id="shared-1")
    w.op("submit", 0, 1, "answer", job_id="wrong", tokens=[9, 9, 9, 9])
    w.op("join", 0, 1, "answer", job_id="j9", prompt=1, tokens=[1, 2, 3, 4])  # the other prompt's answer
    w.op("submit", 0, 16, "error", job_id="late", error_class="NoWorkers", typed=True)  # 16 s > 10 + 5
    w.op("generate", 100, 101, "error", job_id=None, error_class="OutOfMemoryError", typed=False)  # Redis full
    w.op("generate", 200, 201, "error", job_id=None, error_class="KeyError", typed=False)
    report = run_check(tmp_path, fills=[(99.5, 100.5)])
    found = {(v["what"], v["item"]) for v in report.every}
    assert found == {("answered_twice", None), ("lost", None), ("lost", "54.1"), ("wrong_answer", None),
                     ("wrong_answer", "54.5"), ("waited_past_timeout", None), ("untyped_error", "54.6"),
                     ("untyped_error", None)}
    assert len(report.unexplained) == 5


def test_a_recovered_join_is_attributed_as_a_join(tmp_path: Path) -> None:
    w = Writer(tmp_path)
    first = w.op("join", 0, None, None)  # its process was killed with it in flight
    w.op("recover", 5, 6, "answer", prompt=1, tokens=[1, 2, 3, 4], of=first)
    assert [(v["what"], v["item"]) for v in run_check(tmp_path).every] == [("wrong_answer", "54.5")]


def test_shapes_found_by_this_test_are_attributed(tmp_path: Path) -> None:
    w = Writer(tmp_path)
    w.op("submit", 0, 1, "answer", tokens=[1, 2, 3, 4])
    w.inc = 2  # the process was killed and started again with the same inbox
    w.op("reuse", 5, 6, "answer", tokens=[1, 2, 3, 4])
    setup = "  File \"compose.py\", in _build\n    transport.setup()\n_Refused: used memory > 'maxmemory'."
    report = check(tmp_path, REFS, [], PROMPTS, [{"process": "w0g2", "exit": 1, "tail": setup}], 5.0)
    assert sorted((v["what"], v["item"]) for v in report.every) == [("answered_twice", "new.A"),
                                                                   ("process_crashed", "new.B")]


def test_concurrent_joins_of_one_prompt_may_share_an_answer(tmp_path: Path) -> None:
    w = Writer(tmp_path)
    w.op("join", 0, 2, "answer", tokens=[1, 2, 3, 4])
    w.op("join", 0.1, 2, "answer", tokens=[1, 2, 3, 4])
    assert not run_check(tmp_path).every


def test_bulk_output_lines_are_checked(tmp_path: Path) -> None:
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"prompt": p, "max_new_tokens": 4}) + "\n" for p in PROMPTS * 2))
    line = {"index": 0, "result": {"token_ids": [1, 2, 3, 4], "text": "abcd"}}
    out.write_text(json.dumps(line) + "\n" + json.dumps(line) + "\n"  # index 0 twice
                   + json.dumps({"index": 1, "result": {"token_ids": [1, 2, 3, 4]}}) + "\n"  # prompt 1's is 5..8
                   + '{"index": 2, "res\n'  # torn
                   # index 3 missing
                   )
    hist = tmp_path / "histories"
    hist.mkdir()
    report = check(hist, REFS, [{"round": 1, "input": str(src), "output": str(out), "finished": True, "rcs": [0]}],
                   PROMPTS, [], 5.0)
    assert dict(report.violations) == {"bulk_twice": 1, "bulk_wrong": 1, "bulk_corrupt": 1, "bulk_lost": 2}
