"""An answer is always its own line's (issue 54): a plain-text prompt's surrounding whitespace is part of the
prompt, so an answer written (or in flight at a kill -9) never stands for a line edited only there; a line
carrying an "id" moved to another position gets its answer, never an error line "answered already"."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from batchfleet.common.keys import Keys
from batchfleet.common.wire.priority import BACKGROUND
from batchfleet.producer.bulk.files import run_names
from batchfleet.producer.bulk.lines import SHA_KEY, PromptFormat, line_sha
from tests.conftest import TEST_BUCKETS
from tests.helpers.loops import silent_fleet, wait_until
from tests.test_bulk_runs import bulk_cli, last_line
from tests.test_bulk_trust import check_attached, read

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.unit
def test_a_text_prompts_fingerprint_and_job_are_its_exact_bytes():
    fmt = PromptFormat("bprefix", text=True)
    works = [fmt.parse(i, raw) for i, raw in enumerate([b"hello\n", b" hello\n", b"hello \r\n", b"\thello"])]
    assert [w.prompt for w in works] == ["hello", " hello", "hello ", "\thello"]
    assert len({w.line.sha for w in works}) == 4 and len({w.job_ids[0].rsplit(".", 1)[1] for w in works}) == 4
    assert fmt.parse(0, b"hello\r\n").line.sha == works[0].line.sha  # the line end is no part of the prompt
    assert works[1].line.sha == fmt.sha(b" hello\n") == line_sha(b" hello\n", text=True) != line_sha(b" hello\n")
    assert fmt.abandoned(1, b" hello\n", "cancelled", "m")[SHA_KEY] == works[1].line.sha
    # a JSON line: whitespace around the JSON text is no part of what it asks
    assert line_sha(b'  {"prompt": " a"}\r\n') == line_sha(b'{"prompt": " a"}')


@pytest.mark.unit
def test_a_line_with_an_id_names_its_jobs_after_its_position_too():
    fmt = PromptFormat("bprefix")
    raw = b'{"prompt": "a", "id": "doc-1"}\n'
    at_0, at_3 = fmt.parse(0, raw), PromptFormat("bprefix").parse(3, raw)
    assert at_0.line.sha == at_3.line.sha and at_0.job_ids != at_3.job_ids
    assert "doc-1" in at_0.job_ids[0]  # still recognisable in the fleet's logs


def text_lines(src: Path) -> dict[int, bytes]:
    """Input line number -> the prompt a text file's line is (blank lines get no answer)."""
    return {i: raw.rstrip(b"\r") for i, raw in enumerate(src.read_bytes().split(b"\n")) if raw.strip()}


def check_text(src: Path, dst: Path) -> None:
    """Every answer is its line's: one per non-blank line, its fingerprint the line's, and its prompt length
    the line's own (the test model's tokenizer: a token per byte, after a fixed number of special tokens)."""
    lines, out = text_lines(src), read(dst)
    assert sorted(o["index"] for o in out) == sorted(lines)
    assert all(o[SHA_KEY] == line_sha(lines[o["index"]], text=True) for o in out), out
    assert len({o["result"]["prompt_tokens"] - len(lines[o["index"]]) for o in out}) == 1, out


TEXT = "alpha\nbeta\ngamma\ndelta\n"
EDITED = " alpha\nbeta  \n\tgamma\ndelta\n"  # three lines edited only in their surrounding whitespace


def test_a_text_line_edited_only_in_its_whitespace_is_answered_again(start_worker, redis_url, namespace, tmp_path):
    start_worker(max_wait_ms=5)
    src, dst = tmp_path / "in.txt", tmp_path / "out.jsonl"
    src.write_text(TEXT)
    assert bulk_cli(src, dst, redis_url, namespace, "--format", "text").returncode == 0
    check_text(src, dst)
    src.write_text(EDITED)
    again = bulk_cli(src, dst, redis_url, namespace, "--format", "text")
    assert again.returncode == 0, again.stderr[-2000:]
    assert "3 dropped (their input line changed)" in again.stderr, again.stderr
    check_text(src, dst)


def test_a_text_line_in_flight_at_a_kill_and_edited_in_its_whitespace_is_not_given_the_old_answer(
        start_worker, redis_url, namespace, tmp_path):
    src, dst = tmp_path / "in.txt", tmp_path / "out.jsonl"
    src.write_text(TEXT)
    r = redis.Redis.from_url(redis_url)
    keys = Keys(namespace)
    with silent_fleet(redis_url, namespace):  # enqueued, never answered: every line is in flight at the kill
        run = subprocess.Popen([sys.executable, "-m", "batchfleet.common.cli", "bulk", str(src), "-o", str(dst),
                                "--redis-url", redis_url, "--namespace", namespace, "--format", "text",
                                "--max-new-tokens", "2"], cwd=ROOT, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
        wait_until(lambda: sum(r.xlen(keys.stream(b, BACKGROUND)) for b in TEST_BUCKETS) == 4, 60, "4 lines enqueued")
        run.send_signal(signal.SIGKILL)
        run.wait(30)
    inbox = keys.inbox(run_names(str(dst), resume=True)[0].inbox)
    start_worker(max_wait_ms=5)  # answers the old prompts into the run's inbox
    wait_until(lambda: r.xlen(inbox) >= 4, 60, "the old prompts answered")
    src.write_text(EDITED)
    again = bulk_cli(src, dst, redis_url, namespace, "--format", "text")
    assert again.returncode == 0, again.stderr[-2000:]
    assert "1 collected, 3 submitted" in last_line(again), again.stderr  # only the unchanged line's answer
    check_text(src, dst)


def test_a_line_with_an_id_moved_where_nothing_is_written_gets_its_answer(start_worker, redis_url, namespace,
                                                                         tmp_path):
    start_worker(max_wait_ms=5)
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    line = {"a": {"id": "a", "prompt": "aaaa"}, "b": {"id": "b", "prompt": "bb"}, "c": {"id": "c", "prompt": "c"},
            "n": {"id": "n", "prompt": "a new one"}}
    src.write_text("".join(json.dumps(line[k]) + "\n" for k in "abc"))
    assert bulk_cli(src, dst, redis_url, namespace).returncode == 0
    src.write_text("".join(json.dumps(line[k]) + "\n" for k in "nbca"))  # "a" moved to a line never answered
    again = bulk_cli(src, dst, redis_url, namespace)
    assert again.returncode == 0, again.stderr[-2000:] + json.dumps(read(dst))
    out = check_attached(src, dst)
    assert all("result" in o for o in out) and {o["id"] for o in out} == set("nbca")
