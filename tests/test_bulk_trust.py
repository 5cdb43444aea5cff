"""``batchfleet bulk`` as a data person and a script from OpenAI's docs use it (issue 31): a rerun checks
its input (swapped lines never carry each other's answers, a fixed line is answered again, other
parameters are refused, ``--retry-errors``), plain-text prompt files, progress lines when standard error is
not a terminal, SIGTERM stops like Ctrl-C, failed lines are explained and ``--model-alias-any`` maps any
model name."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from batchfleet.producer.bulk.lines import SHA_KEY, line_sha
from tests.helpers.loops import silent_fleet
from tests.test_bulk_runs import bulk_cli, last_line

ROOT = Path(__file__).resolve().parents[1]


def read(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def prompts(*texts: str) -> str:
    return "".join(json.dumps({"prompt": t}) + "\n" for t in texts)


def check_attached(src: Path, dst: Path) -> list[dict]:
    """Every answer's fingerprint is its input line's, and its prompt length is that line's (the test model's
    tokenizer: a token per byte, after a fixed number of special tokens)."""
    raw = src.read_bytes().splitlines()
    out = read(dst)
    assert sorted(o["index"] for o in out) == list(range(len(raw)))  # every line once
    extra = set()
    for o in out:
        assert o[SHA_KEY] == line_sha(raw[o["index"]]), o
        if "result" in o:
            extra.add(o["result"]["prompt_tokens"] - len(json.loads(raw[o["index"]])["prompt"]))
    assert len(extra) <= 1, out  # no answer attached to another line
    return out


def test_swapped_and_fixed_lines_are_answered_again_and_nothing_else(start_worker, redis_url, namespace, tmp_path):
    start_worker(max_wait_ms=5)
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(prompts("a", "bbbbbbbbbb", "ccc") + "{broken\n")
    first = bulk_cli(src, dst, redis_url, namespace)
    assert first.returncode == 3, first.stderr[-2000:]
    src.write_text(prompts("bbbbbbbbbb", "a", "ccc", "fixed"))  # two lines swapped, the broken one fixed
    again = bulk_cli(src, dst, redis_url, namespace)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "1 kept from an earlier run, 0 collected, 3 submitted" in last_line(again), again.stderr
    assert "3 dropped (their input line changed)" in again.stderr
    check_attached(src, dst)


def test_other_parameters_are_refused_and_error_lines_retried_when_asked(start_worker, redis_url, namespace,
                                                                         tmp_path):
    start_worker(max_wait_ms=5)
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(prompts("a", "bb", "ccc"))
    assert bulk_cli(src, dst, redis_url, namespace).returncode == 0
    longer = subprocess.run([sys.executable, "-m", "batchfleet.common.cli", "bulk", str(src), "-o", str(dst),
                             "--redis-url", redis_url, "--namespace", namespace, "--max-new-tokens", "32"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert longer.returncode == 2, longer.stderr
    assert "max_new_tokens: 2 -> 32" in longer.stderr and "--no-resume" in longer.stderr
    # an error line an earlier run left (a deadline it missed): kept, unless --retry-errors
    out = read(dst)
    out[1] = {"index": 1, SHA_KEY: out[1][SHA_KEY], "error": {"code": "deadline_exceeded", "message": "late"}}
    dst.write_text("".join(json.dumps(o) + "\n" for o in out))
    kept = bulk_cli(src, dst, redis_url, namespace)
    assert kept.returncode == 3 and "deadline_exceeded 1 (no answer in time" in kept.stderr, kept.stderr
    retried = bulk_cli(src, dst, redis_url, namespace, "--retry-errors")
    assert retried.returncode == 0, retried.stderr[-2000:]
    assert "1 error lines retried" in retried.stderr and "1 submitted" in last_line(retried)
    assert all("result" in o for o in check_attached(src, dst))


def test_a_plain_text_file_is_one_prompt_per_line_with_a_note_and_progress_lines(start_worker, redis_url,
                                                                                 namespace, tmp_path):
    start_worker(max_wait_ms=5)
    src, dst = tmp_path / "prompts.txt", tmp_path / "out.jsonl"
    src.write_text("What is Redis?\nTell me a joke\n\nSummarise {this}\n")
    run = bulk_cli(src, dst, redis_url, namespace)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "the first line is not JSON, so each line is read as one prompt" in run.stderr
    # stderr is a pipe: plain lines; 3 answers are too few to measure a pace, so no ETA is ever shown
    assert re.search(r"^prompts: 3/3 \(100%\) in \d+s, [\d.]+/s$", run.stderr, re.M)
    assert not re.search(r"^prompts: .*ETA", run.stderr, re.M)
    out = read(dst)
    assert [o["index"] for o in out] == [0, 1, 3] and all("result" in o for o in out)
    assert out[2]["result"]["prompt_tokens"] - out[1]["result"]["prompt_tokens"] == len("Summarise {this}") - len(
        "Tell me a joke")
    flagged = bulk_cli(src, tmp_path / "flagged.jsonl", redis_url, namespace, "--format", "text")
    assert flagged.returncode == 0 and "note:" not in flagged.stderr


def test_a_prompt_line_takes_every_api_parameter(start_worker, redis_url, namespace, tmp_path):
    start_worker(max_wait_ms=5)
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [{"prompt": "pick", "guided_choice": ["yes", "no"], "max_new_tokens": 8},
             {"prompt": "sample", "temperature": 0.8, "min_p": 0.1, "repetition_penalty": 1.2, "seed": 7,
              "logprobs": 2, "min_tokens": 2, "max_new_tokens": 3, "ignore_eos": True}]
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    run = bulk_cli(src, dst, redis_url, namespace)
    assert run.returncode == 0, run.stderr[-2000:]
    picked, sampled = read(dst)
    assert picked["result"]["text"] in ("yes", "no"), picked
    assert sampled["result"]["completion_tokens"] == 3 and len(sampled["result"]["logprobs"]) == 3, sampled


def test_sigterm_stops_like_ctrl_c_with_a_resume_hint(redis_url, namespace, tmp_path):
    # a live "worker" that never reads: the run waits on its answers until stopped
    with silent_fleet(redis_url, namespace):
        src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
        src.write_text(prompts(*(f"p{i}" for i in range(20))))
        proc = subprocess.Popen([sys.executable, "-m", "batchfleet.common.cli", "bulk", str(src), "-o", str(dst),
                                 "--redis-url", redis_url, "--namespace", namespace, "--drain-timeout", "0"], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        r_end = time.monotonic() + 60
        while not os.path.exists(str(dst) + ".run") and time.monotonic() < r_end:
            time.sleep(0.05)
        time.sleep(1.5)  # submitted by now
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err[-2000:]
    assert err.strip().splitlines()[-1].startswith("stopped by SIGTERM: 0 of 20 lines written"), err
    assert "run the same command again to resume" in err


def openai_line(custom_id: str, model: str) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}) + "\n"


def test_a_script_from_openai_docs_learns_why_and_runs_with_the_alias(start_worker, redis_url, namespace, tmp_path):
    start_worker(max_wait_ms=5)
    src, dst = tmp_path / "batch.jsonl", tmp_path / "out.jsonl"
    src.write_text(openai_line("a", "gpt-4o-mini") + openai_line("b", "gpt-4o-mini"))
    cmd = [sys.executable, "-m", "batchfleet.common.cli", "bulk", str(src), "-o", str(dst), "--redis-url",
           redis_url, "--namespace", namespace]
    failed = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert failed.returncode == 3, failed.stderr[-2000:]
    assert "model_not_found 2 (serve this name with --served-model-name" in failed.stderr, failed.stderr
    errors = read(tmp_path / "out.jsonl.errors.jsonl")
    assert "--model-alias-any" in errors[0]["response"]["body"]["error"]["message"]
    alias = subprocess.run([*cmd, "--model-alias-any"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert alias.returncode == 2 and "model_alias_any: false -> true" in alias.stderr  # other parameters
    alias = subprocess.run([*cmd, "--model-alias-any", "--no-resume"], cwd=ROOT, capture_output=True, text=True,
                           timeout=120)
    assert alias.returncode == 0, alias.stderr[-2000:]
    assert sorted(o["custom_id"] for o in read(dst)) == ["a", "b"]
